"""What the engine's selection code chose before the decode plan (commit e853843), for every situation of
tests/test_plan.py: backend x rows 1-128 x dtype x compute capability x NVRTC builds x top-p x int8 x
--compile-prefill, on GPT-XL t2i at 512 px. Writes tests/data/old_plan_choices.json, which the plan is checked
against.

    python tools/record_old_plan.py            # checks out e853843 into a temporary worktree and records there

The old code chose in Engine._sampler_for, Engine._build, and at run time inside the kernels' modules (ENABLED
globals, fused_ops.for_backend, smem_gemv's _serves, decode_block's pdl_for and plan). Here that code runs on the
CPU with the GPU's answers stood in (a model of stand-in tensors with GPT-XL's shapes, the compute capability,
whether NVRTC builds a kernel), and its choices are read back from what it built: no kernel runs.
"""
import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
from types import SimpleNamespace

OLD = "e853843"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "old_plan_choices.json")

BACKENDS = ("inductor-block", "inductor-block-nofuse", "inductor-step", "cudagraph", "eager")
DEVICES = ("cpu", "sm75", "sm80", "sm90", "sm90-nobuild", "sm100", "sm100-nobuild")
DTYPES = ("fp32", "bf16", "fp16")


def situations():
    """(backend, device, dtype, int8, top_p, compile_prefill, cfg) and the batch sizes: rows 1-128 with and
    without CFG (under CFG the steps run at 2B rows, and at B after cfg_interval)."""
    for backend, device, dtype, int8, top_p, prefill, cfg in itertools.product(
            BACKENDS, DEVICES, DTYPES, (False, True), (1.0, 0.9), (False, True), (True, False)):
        if prefill and not backend.startswith("inductor"):
            continue  # --compile-prefill is the inductor backend's
        yield (backend, device, dtype, int8, top_p, prefill, cfg), range(1, 65 if cfg else 129)


def key(s):
    backend, device, dtype, int8, top_p, prefill, cfg = s
    return f"{backend}|{device}|{dtype}|int8={int(int8)}|top_p={top_p}|compile_prefill={int(prefill)}|cfg={int(cfg)}"


# ---- inside the old checkout ----------------------------------------------------------------------------------

def record_all():
    import torch

    from fast_inference import (cuda_ops, decode_attention, decode_block, engine, fused_ops, prefetch, smem_attention,
                                smem_gemv)
    from fast_inference.model import ModelArgs

    dtypes = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)

    class T:
        """A stand-in tensor: the shape, dtype and device the selection code reads."""

        def __init__(self, shape, dtype, device):
            self.shape, self.dtype, self.device = torch.Size(shape), dtype, device

        is_cuda = property(lambda self: self.device.type == "cuda")
        is_contiguous = lambda self, memory_format=None: True
        element_size = lambda self: torch.empty((), dtype=self.dtype).element_size()
        dim = lambda self: len(self.shape)

    class FakeSampler:
        def __init__(self, model, batch, num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                     decode_attention=None, block_fn=None, draw_fn=None, windows=1, inputs_fn=None, keep_logits=True):
            self.model, self.batch, self.cfg = model, batch, cfg
            self.decode_attention, self.block_fn, self.draw_fn, self.inputs_fn = decode_attention, block_fn, draw_fn, \
                inputs_fn
            self.windows = windows
            self.finish_fn, self.logits_fn = self.finish, model.logits
            # as the old Sampler: the text partial where a decode attention kernel runs (t2i: the prefix's RoPE rows are
            # zero)
            text = decode_attention is not None and getattr(decode_attention, "text", True)
            self.cache = SimpleNamespace(text_len=prefix_len if text else 0)
            self.kv_lens = [None] * (windows if windows > 1 else 1)
            self.head_noise, self.noise, self.input_pos, self.seed = False, None, None, None
            self.prefetcher, self.prefill_block, self.text_table = None, None, None

        def prefill(self, prefix):
            pass

        def finish(self, h, guided):
            pass

        def step_fn(self, guided, w):
            return lambda: None

    class FakePrefetcher:
        def __init__(self, model, compiled=False):
            self.compiled, self.down, self.progress = compiled, {}, "progress"

        def prepare(self, rows, input_pos, down=False):
            self.down[rows] = down

    def fake_model(args, dtype, int8, device):
        D, F, V, hd = args.dim, args.ffn_hidden, args.vocab_size, args.head_dim
        wdt = torch.int8 if int8 else dtype
        lin = lambda n, k: SimpleNamespace(weight=T((n, k), wdt, device), **({"scales": T((n,), dtype, device)}
                                                                               if int8 else {}))
        layer = SimpleNamespace(
            attention=SimpleNamespace(wqkv=lin(3 * D, D), wo=lin(D, D), head_dim=hd, n_head=args.n_head, kv_cache=None),
            feed_forward=SimpleNamespace(w13=T((2 * F, D), wdt, device), w13_scales=T((2 * F,), dtype, device) if int8
                                         else None, w2=lin(D, F)),
            attention_norm=SimpleNamespace(weight=T((D,), dtype, device), eps=1e-5),
            ffn_norm=SimpleNamespace(weight=T((D,), dtype, device), eps=1e-5))
        model = SimpleNamespace(args=args, layers=[layer] * args.n_layer, output=lin(V, D),
                                tok_embeddings=SimpleNamespace(weight=T((V, D), dtype, device)), max_seq=-1)
        model.logits = lambda x: None
        model.clear_caches = lambda: None
        model.fuse_projections = lambda: None
        return model

    state = {}

    def capability(device=None):
        return state["cap"]

    torch.cuda.get_device_capability = capability
    torch.cuda.current_device = lambda: 0
    smem_gemv._nvrtc = lambda: state["builds"] or (_ for _ in ()).throw(OSError("no NVRTC"))
    smem_gemv._driver = lambda: SimpleNamespace(cuLaunchKernelEx=None)
    smem_gemv.compiled = lambda device, name, make_source, smem, file: "fn" if state["builds"] else None
    smem_attention._counts_for = lambda device: None
    decode_block.tile_counts = lambda device, tiles=4096: None
    decode_attention.text_table = lambda caches: "table"
    prefetch.Prefetcher = FakePrefetcher
    engine.Sampler = FakeSampler

    args = ModelArgs.from_name("GPT-XL", block_size=1024, vocab_size=16384)
    num_tokens, prefix_len = 1024, args.prefix_len
    out, table = {}, {}
    for s, batches in situations():
        backend, device_name, dtype_name, int8, top_p, compile_prefill, cfg = s
        cuda = device_name != "cpu"
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        state["cap"] = {"sm75": (7, 5), "sm80": (8, 0), "sm90": (9, 0), "sm100": (10, 0)}.get(device_name.split("-")[0])
        state["builds"] = not device_name.endswith("nobuild")
        dtype = dtypes[dtype_name]
        runs = []
        for B in batches:
            for cache in (smem_gemv._available, cuda_ops._builds):
                cache.clear()
            prefetch.available.cache_clear()
            model = fake_model(args, dtype, int8, device)
            engine.is_int8 = lambda m, int8=int8: int8
            be = backend.split("-")[0]
            scope = "step" if backend == "inductor-step" else "block"
            fused_ops.for_backend(be)
            try:
                eng = engine.Engine(model, backend=be, compile_scope=scope, compile_prefill=compile_prefill,
                                    fused_block=backend != "inductor-block-nofuse")
            except ValueError as e:
                choices = {"error": str(e)}
            else:
                eng._sampler_for(B, num_tokens, prefix_len, 256, cfg, 2000, top_p, True, False)
                choices = read_choices(eng, model, B, cfg, int8, dtype, device)
            runs.append(choices)
        out[key(s)] = runs_to_ranges(runs, batches, table)
    return out, [json.loads(text) for text in table]


def runs_to_ranges(runs, batches, table):
    """[[first batch, last batch, index of the choices in table], ...] over the runs of equal choices."""
    ranges = []
    for B, c in zip(batches, runs):
        text = json.dumps(c, sort_keys=True)
        if text not in table:
            table[text] = len(table)
        if ranges and ranges[-1][2] == table[text]:
            ranges[-1][1] = B
        else:
            ranges.append([B, B, table[text]])
    return ranges


def read_choices(eng, model, B, cfg, int8, dtype, device):
    """The old engine's choices for one shape, in the plan's words (tests/test_plan.py compares them)."""
    import torch

    from fast_inference import (cuda_draw, cuda_inputs, decode_attention, decode_block, decode_inputs,
                                decode_sampling, engine, fused_ops, smem_attention, smem_gemv)
    from fast_inference.pdl import use_pdl

    s = eng.sampler
    fn = lambda f: getattr(f, "func", f)
    kw = lambda f: getattr(f, "keywords", {})
    c = {}
    c["step"] = "hand_graph" if eng.hand_capture else "compiled_step" if (eng.backend == "inductor"
                                                                           and not eng.block_scope) else "eager"
    c["inputs"] = {None: "model", decode_inputs.step_inputs: "triton", cuda_inputs.step_inputs: "cuda"}[s.inputs_fn]
    compiled = eng.block_fn is not None and fn(s.block_fn) is eng.block_fn
    if s.block_fn is None:
        c["block"] = "model"
    elif compiled:
        c["block"] = "compiled"
    elif fn(s.block_fn) is engine.run_block:
        c["block"] = "layer"
    else:
        assert fn(s.block_fn) is decode_block.decode_block
        c["block"] = "fused"
    kernels = kw(s.block_fn).get("kernels")
    layer = model.layers[0]
    D, F = model.args.dim, model.args.ffn_hidden

    class X:  # a stand-in activation
        def __init__(self, shape):
            self.shape, self.dtype, self.device = torch.Size(shape), dtype, device

        is_cuda = property(lambda self: self.device.type == "cuda")
        is_contiguous = lambda self, memory_format=None: True

    def projection(name, r):
        """(impl, pdl mode) of projection `name` of the fused block at r rows (decode_block's order: smem_gemv first)."""
        w = dict(qkv=layer.attention.wqkv.weight, wo=layer.attention.wo.weight, gate_up=layer.feed_forward.w13,
                 w2=layer.feed_forward.w2.weight)[name]
        K = w.shape[1]
        cols = dict(qkv=3 * D, wo=D, gate_up=F, w2=D)[name]
        scales = None if not int8 else "scales"
        pdl = decode_block.pdl_for(r, device, int8)
        extra = (layer.attention_norm.weight,) if name in ("qkv", "gate_up") else ()
        serves = smem_gemv._serves(name, X((r, K)), cols, w, *extra, scales=scales, kernels=kernels)
        if name == "qkv":
            serves = serves and layer.attention.head_dim % smem_gemv.CONFIG["qkv"][1] == 0
        if serves:
            mode = smem_gemv._entry("linear", name, K, r, pdl, kernels)[-1]
            return f"cuda/pdl{int(mode)}"
        gemv = r <= decode_block.GEMV_ROWS and (name not in decode_block.DOT_ALWAYS or int8)
        return f"triton_{'gemv' if gemv else 'dot'}/pdl{int(pdl)}"

    att = s.decode_attention
    for kind, r in (("guided", 2 * B if cfg else B), ("unguided", B)) if cfg else (("steps", B),):
        p = {}
        if c["block"] == "fused":
            for name in ("qkv", "wo", "gate_up", "w2"):
                p[name] = projection(name, r)
        elif c["block"] == "compiled":
            down = decode_block.serves_down(layer, r, cuda=device.type == "cuda")
            p["w2"] = f"triton_dot_down/pdl{int(decode_block.pdl_for(r, device) if decode_block.DOWN_PDL else 0)}" \
                if down else "inductor"
        if att is None:
            a = "sdpa_windows" if s.windows > 1 else "sdpa"
        elif fn(att) is decode_attention.decode_attention:
            k = kw(att)
            if r in decode_attention.WHOLE_ROWS:
                a = f"triton_whole{decode_attention.WHOLE}"
            else:
                a = f"triton_split{decode_attention.config_for(r)}"
            a += f"/pdl{int(k.get('pdl', False))}/merge_pdl{int(k['merge_pdl']) if 'merge_pdl' in k else '-'}"
            a += "/progress" if "progress" in k else ""
        else:
            assert att is smem_attention.decode_attention
            a = "cuda_loop" if r > smem_attention.LOOP_ROWS else "cuda"
        c[kind] = dict(projections=p, attention=a)
        if s.prefetcher is not None:
            c[kind]["prefetch_down"] = bool(s.prefetcher.down.get(r, False))
    c["prefetch"] = "none" if s.prefetcher is None else "compiled" if s.prefetcher.compiled else "fused"
    c["windows"] = s.windows
    if s.finish_fn != s.finish:
        c["head"] = "compiled_finish"
    elif fn(s.logits_fn) is decode_block.logits:
        c["head"] = "fused"
    elif s.logits_fn is model.logits:
        c["head"] = "model"
    else:
        c["head"] = "compiled"
    c["draw"] = {None: "torch", decode_sampling.draw: "triton", cuda_draw.draw: "cuda"}[s.draw_fn]
    c["head_noise"] = s.head_noise
    c["text_sums"] = "none" if not s.cache.text_len else "triton" if s.text_table is not None else "torch"
    prefill_whole = eng.prefill_fn != s.prefill
    c["prefill"] = ("compiled_block" if s.prefill_block is not None else "compiled_whole" if prefill_whole
                    else "eager_graph" if s.capture_prefill else "eager")
    x = X((2, 7, D))
    gate = X((2, 7, 2 * F))
    eager = dict(rms_norm="cuda" if fused_ops.norms(x, layer.attention_norm.weight) else "torch",
                 silu_mul="triton" if fused_ops.supported(gate) else "cuda" if fused_ops.fuses(gate) else "torch",
                 rope="triton" if fused_ops.supported(x) else "cuda" if fused_ops.fuses(x) else "torch")
    if c["prefill"] == "compiled_whole":
        c["prefill_ops"] = dict(rms_norm="torch", silu_mul="torch", rope="torch")
    elif c["prefill"] == "compiled_block":
        c["prefill_ops"] = dict(rms_norm="torch", silu_mul="torch", rope=eager["rope"])
    else:
        c["prefill_ops"] = eager
    if c["block"] in ("model", "layer") and c["step"] != "compiled_step":
        c["step_ops"] = dict(eager, rope=eager["rope"] if att is None else "attention")
    elif c["block"] == "compiled" or c["step"] == "compiled_step":
        c["step_ops"] = dict(rms_norm="torch", silu_mul="torch", rope="torch" if att is None else "attention")
    c["vq_norm"] = "triton" if fused_ops.supported(x) else "torch"
    c["draw_pdl"] = int(c["draw"] == "triton" and use_pdl(device))
    c["inputs_pdl"] = int(c["inputs"] == "triton" and use_pdl(device))
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # run in the old checkout
    ap.add_argument("--out", default=OUT)
    a = ap.parse_args()
    if a.inside:
        import logging

        logging.disable(logging.CRITICAL)
        situations_, choices = record_all()
        with open(a.out, "w") as f:
            json.dump(dict(commit=OLD, choices=choices, situations=situations_), f, separators=(",", ":"),
                      sort_keys=True)
        return
    with tempfile.TemporaryDirectory() as d:
        tree = os.path.join(d, "old")
        subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree, OLD], check=True)
        try:
            env = dict(os.environ, PYTHONPATH=tree)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--inside", "--out", a.out], env=env,
                           check=True, cwd=tree)
        finally:
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=True)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
