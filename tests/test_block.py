"""The fused one-token block (kernels/block.py with block_triton's kernels, as the plan launches them) against the
model's own block, in Triton's CPU interpreter (TRITON_INTERPRET=1), and its kernels compiled ahead of time for
sm_90."""
import subprocess
import sys

import pytest

import early
import interpret
import sm90

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import copy
import functools
import torch
import triton.language as tl
from fast_inference import plan as plans
from fast_inference.kernels import block_triton, draw_triton, prefetch_triton
from fast_inference.kernels.attention_triton import decode_attention
from fast_inference.kernels.block import fused_block
from fast_inference.model import Context

# The interpreter has no grid dependency control: the PDL data paths run with these as no-ops.
tl.extra.cuda.gdc_wait = tl.extra.cuda.gdc_launch_dependents = lambda *args, **kwargs: None
from fast_inference.generate import prepare
from fast_inference.quantize import quantize_int8
from test_reference import tiny_inputs, tiny_model

worst, cache_worst = 0.0, 0.0


class Counter:  # a prefetch_triton.Prefetcher's count, as the fused block sees it
    def __init__(self):
        self.progress = torch.zeros(1, dtype=torch.int32)


tiling, read = block_triton.tiling, []


# the counting kernels' weights, in launch order
def recording(name, x, weight, tiles, pdl, dot, progress=None, by_rows=True):
    if progress is not None:
        read.append(weight.data_ptr())
    return tiling(name, x, weight, tiles, pdl, dot, progress, by_rows)


block_triton.tiling = recording


def rows_plan(m, B, cfg, pdl, int8):  # the plan's Rows of the fused block (PDL where pdl: Hopper), no CUDA C++
    a = m.args
    s = plans.Situation(device="cuda", capability=(9, 0) if pdl else (8, 0), int8=int8, cfg=cfg > 1, batch=B,
                        dim=a.dim, n_head=a.n_head, ffn_hidden=a.ffn_hidden, vocab_size=a.vocab_size,
                        builds=lambda *key: False)
    p = plans.make(s)
    assert p.block == "fused"
    return p.guided

tile = lambda n: dict(qkv=(n, 4), wo=(n, 4), gate_up=(n, 2), w2=(n, 4))
dot = lambda n, bk, s=1: dict(qkv=(16, bk, 4, 2, s), wo=(n, bk, 4, 2, s), gate_up=(n, bk, 4, 3, s), w2=(16, bk, 4, 2, s),
                             output=(n, bk, 4, 2, s))
# (batch, cfg, model widths, GEMV tiling, dot tiling, PDL data paths, int8 weights, the model's SDPA as the attention
# instead of the decode attention kernel: the cudagraph backend's block); > 4 rows take the dot path, whose K
# chunks (bk) here are smaller than K so its loops run several times, or wider than K (128: masked);
# split-K (s): more splits than chunks (capped), or 3 uneven runs of chunks, some empty. `wide`: widths
# that are no powers of two (dim 160, hidden 448), so the GEMV rows are padded, and gate/up's K runs in five pieces
# Two layers (one for `wide`) and three steps: the interpreter is slow, and one block feeding the next is what counts
narrow, wide = dict(n_head=2, n_layer=2), dict(dim=160, n_head=5, multiple_of=32, n_layer=1)
STEPS = 3
# At <= 4 rows the head's float weights take the dot path too (DOT_ALWAYS): the GEMV cases give it a dot tiling
head = dot(32, 32)
cases = [(1, 4.0, narrow, tile(4), head, True, False, False),
         (1, 1.0, dict(n_head=4, n_layer=2), tile(2), head, False, False, False),
         (2, 4.0, narrow, tile(16), head, True, True, False), (1, 4.0, wide, tile(4), head, True, False, False),
         (2, 4.0, narrow, tile(4), head, True, False, True),
         (3, 4.0, narrow, None, dot(16, 32), True, False, False),
         (5, 1.0, narrow, None, dot(32, 128, 4), False, True, False),
         (8, 4.0, narrow, None, dot(16, 16, 3), True, False, False),
         (3, 4.0, wide, None, dot(16, 64), False, False, False)]
for B, cfg, widths, config, dot_config, pdl, int8, sdpa in cases:
    block_triton.CONFIG, block_triton.DOT_CONFIG = config, dot_config
    block_triton.DOT_CONFIG_INT8 = dot_config  # int8 weights too (their GEMV tiling stays CONFIG_INT8's)
    attention = None if sdpa else functools.partial(decode_attention, pdl=pdl)
    ref = tiny_model(cls=8, seed=4, vocab_size=512, **widths)  # the interpreter runs every program
    ref.fuse_projections()
    if int8:  # then the model's int8 projections are the reference
        quantize_int8(ref)
    fast = copy.deepcopy(ref)
    cond, mask, condition = tiny_inputs(ref, B=B)
    p = prepare(ref, cond, condition, mask, cfg, 0.9)
    rows, T = p.prefix.shape[:2]
    tokens = torch.randint(0, ref.args.vocab_size, (rows, STEPS), generator=torch.Generator().manual_seed(2))
    for m in (ref, fast):
        m.setup_caches(rows, T + STEPS, torch.float32)
        key_valid = p.key_valid(m.max_seq)
        m(p.prefix, torch.arange(T), key_valid, p.controls, last_only=True)
    counter, read[:] = Counter(), []
    r = rows_plan(fast, B, cfg, pdl, int8)
    ctx = Context(attention=attention, block=functools.partial(fused_block, rows=r, prefetcher=counter),
                  block_adds_control=True)
    for i in range(STEPS):
        pos = torch.tensor([T + i])
        x = ref.tok_embeddings(tokens[:, i : i + 1])
        want = ref(x, pos, key_valid, p.controls, last_only=True)
        got = fast(x, pos, key_valid, p.controls, last_only=True, ctx=ctx)
        worst = max(worst, (got - want).abs().max().item())
    # Each projection counted once as it ran, in the order of the weights the prefetcher fetches
    assert counter.progress.item() == len(read) == 4 * len(fast.layers) * STEPS, (counter.progress, len(read))
    assert read == [w.data_ptr() for w in prefetch_triton.segments(fast)] * STEPS
    h = torch.randn(rows, 1, ref.args.dim)
    head = functools.partial(block_triton.logits, pdl=r.head.pdl, dot=r.head.impl == "triton_dot")
    worst = max(worst, (head(fast, h) - ref.logits(h)).abs().max().item())
    # The head with the draw's race noise: the same logits, and sampled draws that read the noise equal
    # those that make it (several of the draw's chunks: its counter layout)
    images, (pos, seed) = rows // 2 if cfg > 1 else rows, (torch.tensor([T + 7]), torch.tensor(19))
    noise = torch.full((images, ref.args.vocab_size), float("nan"))
    draw_triton.CHUNK, draws = 128, []
    logits = head(fast, h, (noise, pos, seed))
    assert torch.equal(logits, head(fast, h)) and noise.isfinite().all()
    for n in (None, noise):
        token = torch.zeros(images, 1, dtype=torch.long)
        draw_triton.draw(logits.view(rows, -1), token, torch.zeros(images, 20, dtype=torch.long), pos, seed,
                         torch.tensor(cfg), torch.tensor(1.0), T, 100, cfg > 1, True, n, n is not None)
        draws.append(token)
    assert torch.equal(*draws), draws
    draw_triton.CHUNK = 4096
    for a, b in zip(ref.layers, fast.layers):
        for name in ("k_cache", "v_cache"):
            d = getattr(a.attention.kv_cache, name) - getattr(b.attention.kv_cache, name)
            cache_worst = max(cache_worst, d.abs().max().item())
print(worst, cache_worst)
"""


def test_fused_block_matches_model_in_interpreter():
    """Three teacher-forced decode steps through two layers after a prefill: logits within 1e-4 and identical cache rows
    (up to float32 rounding) for 1, 2 and 4 rows (GEMV path) and 5, 6 and 16 rows (dot path, also
    split-K), with and without CFG, with the decode attention kernel and with the model's SDPA taking the QKV
    kernel's rotated q and cache rows (the cudagraph backend's block), several tilings, power-of-two widths and others
    (gate/up's GEMV rows in five pieces), each projection counted once for a prefetcher, in prefetch_triton.segments'
    order, the first of two
    blocks adding the second's control rows in its down projection (adds_control); and the head (final norm
    fused into the output projection), whose race noise draws the same tokens as the draw's own."""
    out = early.result(SCRIPT, ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    worst, cache_worst = map(float, out.stdout.split()[-2:])
    assert worst < 1e-4 and cache_worst < 1e-5, (worst, cache_worst)


ENGINE_SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import dataclasses
import functools
import torch
import triton.language as tl
from fast_inference import engine as engine_module, plan
from fast_inference.engine import Engine
from fast_inference.generate import generate
from fast_inference.kernels import block_triton, draw_triton, inputs_triton, prefetch_triton
from fast_inference.kernels.block import fused_block
from test_reference import tiny_inputs, tiny_model


class Prefetcher:  # prefetch_triton.Prefetcher's part outside a capture (its kernel is Hopper's): the count
    def __init__(self, model, compiled=False):
        self.progress, self.counted, self.compiled, self.plans = torch.zeros(2, dtype=torch.int32), [], compiled, []

    def prepare(self, rows, input_pos, down=False):
        self.plans.append((rows, down))

    def start(self, rows):
        assert rows in [r for r, _ in self.plans]
        return False

    def reset(self):  # after each step run outside a capture
        self.counted.append(self.progress[0].item())
        self.progress.zero_()


tl.extra.cuda.gdc_wait = tl.extra.cuda.gdc_launch_dependents = lambda *args, **kwargs: None
# The plan of a Hopper GPU (no CUDA C++ kernels), its steps run as they come (no CUDA graphs on the CPU); the eager ops
# and the text partial in torch's ops. Here the interpreter runs its Triton kernels on the CPU.
make = plan.make


def on_hopper(s):
    p = make(dataclasses.replace(s, device="cuda", capability=(9, 0), interpret=False, builds=lambda *key: False))
    return dataclasses.replace(p, step="eager", prefill="eager", text_sums="torch", eager=plan.EagerOps(),
                               prefill_ops=plan.EagerOps())


engine_module.plans.make, prefetch_triton.Prefetcher = on_hopper, Prefetcher
# Wide GEMV tiles, few programs: the interpreter's time goes with them (the head takes the dot path: 8 programs of
# DOT_CONFIG's 64 rows); the tilings are the fused block's test's, the engine's wiring this one's
block_triton.CONFIG = dict(qkv=(32, 4), wo=(16, 4), gate_up=(16, 4), w2=(16, 4))
model = tiny_model(cls=8, seed=6, vocab_size=512, n_layer=2)  # small: the interpreter runs every program
cond, mask, condition = tiny_inputs(model, B=2)
# 4 tokens: the prefill's and 3 decode steps, 2 guided and, after cfg_interval, 1 unguided
forced = torch.randint(0, model.args.vocab_size, (2, 4), generator=torch.Generator().manual_seed(3))
kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=1, forced=forced)
_, want = generate(model, cond, 4, return_logits=True, **kw)
engine = Engine(model, backend="inductor", compile_scope="block")
_, got = engine.generate(cond, 4, **kw)
r = engine.runner
assert r.contexts[True].block.func is fused_block and engine.block_fn is None  # nothing compiled
counted = r.prefetcher.counted  # every projection of every step counted, for the prefetcher
assert counted and set(counted) == {4 * len(model.layers)}, counted
assert sorted(r.prefetcher.plans) == [(2, False), (4, False)]  # with CFG and without (cfg_interval)
assert r.draw_fn.func is draw_triton.draw and r.inputs_fn.func is inputs_triton.step_inputs and r.plan.head_noise
worst = max((w if w.shape == g.shape else w.chunk(2)[0]).sub(g).abs().max().item() for w, g in zip(want, got))
greedy = engine.generate(cond, 4, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1)
same = torch.equal(greedy, generate(model, cond, 4, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1))
draws = []
for seed in (5, 5, 6):  # the fused draw's Philox key comes from torch's generator
    torch.manual_seed(seed)
    draws.append(engine.generate(cond, 4, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=20))
same = same and torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
# The head without the race's noise, the draw making its own: the same draws
r.plan = dataclasses.replace(r.plan, head_noise=False)
r.heads = {g: functools.partial(block_triton.logits, model, pdl=rows.head.pdl, dot=rows.head.impl == "triton_dot")
           for g, rows in r.rows_plan.items()}
torch.manual_seed(5)
same = same and torch.equal(draws[0], engine.generate(cond, 4, emb_masks=mask, condition=condition, cfg_scale=4.0,
                                                      top_k=20))
print(worst, same)
"""


def test_engine_runs_the_fused_block_in_interpreter():
    """The engine's own wiring of the fused path (step inputs, block, PDL attention, fused head and draw, the
    prefetcher's count) at 4 rows with CFG and a cfg_interval: teacher-forced logits within 1e-4 of the
    reference, same greedy tokens, the same sampled tokens for the same seed and others for another, and the
    same again with the draw making its race noise instead of the head."""
    out = early.result(ENGINE_SCRIPT, ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    worst, same = out.stdout.split()[-2:]
    assert float(worst) < 1e-4 and same == "True", out.stdout


ENV = interpret.ENV


AOT_SCRIPT = r"""
import torch
from fast_inference import plan
from fast_inference.kernels import block_triton as db, prefetch_triton as prefetch
from sm90 import build


def args(name, dtype, rows, K, tiles, int8):
    # tiling() with the launch options split off, PDL and the path as the plan takes them on an H100/H200; meta
    # tensors stand in for x and W
    pdl = plan.block_pdl(plan.Situation(device="cuda", capability=(9, 0), int8=int8), rows)
    dot = rows > plan.GEMV_ROWS or (name in plan.DOT_ALWAYS and not int8)
    meta = lambda n, dt: torch.empty(n, K, dtype=dt, device="meta")
    bn, kw = db.tiling(name, meta(rows, dtype), meta(1, torch.int8 if int8 else dtype), tiles, pdl, dot)
    options = {"launch_pdl": kw.pop("launch_pdl", False), **{o: kw.pop(o) for o in ("num_warps", "num_stages") if o in kw}}
    kw.pop("PROGRESS")  # a pointer (in the signatures below), counted where BUMP: as with a prefetcher
    return bn, dict(kw, EPS=1e-5, K=K, QUANT=int8, BUMP=True), options


# GPT-XL and GPT-7B in bf16 (the GEMV tiling is capped for wide K), GPT-XL in fp32 and with int8 weights;
# GEMV and dot paths
for dt, D, F, hd, int8 in (("bf16", 1280, 3584, 64, False), ("bf16", 4096, 11008, 128, False),
                           ("fp32", 1280, 3584, 64, False), ("bf16", 1280, 3584, 64, True)):
    t, dtype = "*" + dt, torch.bfloat16 if dt == "bf16" else torch.float32
    w = {"W": "*i8" if int8 else t, "S": t}
    split = {"PART": "*fp32", "COUNT": "*i32", "PROGRESS": "*i32"}
    lin = {"X": t, **w, "RES": t, "ADD": t, "OUT": t, **split, "R": "i32", "N": "i32"}
    head = {"X": t, "NW": t, **w, "OUT": t, "NOISE": "*fp32", "POS": "*i64", "SEED": "*i64", **split, "R": "i32",
            "N": "i32"}
    qkv = {"X": t, "NW": t, **w, "FREQS": "*fp32", "POS": "*i64", "Q": t, "KC": t, "VC": t, **split, "R": "i32",
           "stride_cr": "i32", "stride_ch": "i32", "stride_cn": "i32"}
    gu = {"X": t, "NW": t, **w, "OUT": t, **split, "R": "i32", "F": "i32"}
    # the dot path's tilings were swept for GPT-XL; GPT-7B (not a ControlAR model) spills 8 B in gate/up
    for rows in (2, 4, 8, 16) if D == 1280 else (2,):
        for name, K, then in (("wo", D, False), ("w2", F, False), ("w2", F, True)):  # w2 adding the control rows
            bn, kw, options = args(name, dtype, rows, K, 1, int8)
            kw.pop("EPS")
            build(db._linear_kernel, lin, dict(kw, BN=bn, THEN=then), options)
        bn, kw, options = args("output", dtype, rows, D, 1, int8)
        for images in (0, rows // 2):  # the head with and without the draw's noise (16,384 tokens)
            build(db._head_kernel, head, dict(kw, BN=bn, IMAGES=images, IP=max(1, images), VP=16384, CHUNK=4096),
                  options)
        pairs, kw, options = args("qkv", dtype, rows, D, 2, int8)
        kw.pop("K")
        build(db._qkv_kernel, qkv, dict(kw, D=D, HD=hd, BP=min(pairs, hd // 2), WINDOW=0), options)
        if rows > plan.GEMV_ROWS:  # a pass's rows at their own positions (the dot path)
            build(db._qkv_kernel, qkv, dict(kw, D=D, HD=hd, BP=min(pairs, hd // 2), WINDOW=4), options)
        bn, kw, options = args("gate_up", dtype, rows, D, 2, int8)
        build(db._gate_up_kernel, gu, dict(kw, BN=bn), options)
    if D == 1280 and not int8:  # a pass's fused block at 2 x 1 image x 16 queries (plan.pass_rows: no PDL)
        for name, K, tiles in (("qkv", D, 2), ("wo", D, 1), ("gate_up", D, 2), ("w2", F, 1)):
            bn, kw, options = args(name, dtype, 32, K, tiles, int8)
            kw.update(PDL=0, BUMP=False)
            options["launch_pdl"] = False
            if name == "qkv":
                kw.pop("K")
                build(db._qkv_kernel, qkv, dict(kw, D=D, HD=hd, BP=min(bn, hd // 2), WINDOW=16), options)
            elif name == "gate_up":
                build(db._gate_up_kernel, gu, dict(kw, BN=bn), options)
            else:
                kw.pop("EPS")
                build(db._linear_kernel, lin, dict(kw, BN=bn, THEN=name == "w2"), options)
    if D == 1280 and not int8:  # down(): w2 with its residual add in the compiled block, counting, under PDL
        for rows in (32, 64):
            bn, kw, options = args("w2", dtype, rows, F, 1, int8)
            kw.pop("EPS")
            build(db._linear_kernel, lin, dict(kw, BN=bn, THEN=False), options)
    # Under FIRST (the GEMV path's launch) the next kernel may launch before this one's wait, while the kernel that
    # wrote the residual may still run: the residual and the control rows are then read after the wait; under EARLY
    # before it
    if dt == "bf16" and D == 1280 and not int8:
        for mode in (plan.FIRST, plan.EARLY):
            plan.GEMV_PDL = mode
            bn, kw, options = args("w2", dtype, 2, F, 1, int8)
            kw.pop("EPS")
            ptx = build(db._linear_kernel, lin, dict(kw, BN=bn, THEN=True), options).asm["ptx"]
            wait = ptx.index("griddepcontrol.wait")
            assert (ptx.index("griddepcontrol.launch_dependents") < wait) == (mode == plan.FIRST), mode
            assert ("ld.global.cg" in ptx[:wait]) == (mode == plan.EARLY), mode  # the residual's and control rows' loads
        plan.GEMV_PDL = plan.FIRST
# The prefetcher beside the step (one warp per program: bulk L2 prefetches, spins on the count)
for evict_last in (False, True):
    build(prefetch._prefetch_kernel, {"SEGS": "*i64", "PROGRESS": "*i32", "POS": "*i64", "n_segs": "i32",
                                      "total": "i32"},
          dict(CHUNK=prefetch.CHUNK, EVICT_LAST=evict_last, KV_EVICT_LAST=not evict_last), {"num_warps": 1})
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """GPT-XL and GPT-7B shapes in bf16, GPT-XL in fp32 and with int8 weights, at 2 rows (GEMV path, its
    tiling capped for wide K, with programmatic dependent launch), GPT-XL also at 4 (the GEMV path's most rows,
    gate/up's pieces the most registers) and 8 and 16 rows (dot path, with PDL's late
    trigger), each projection (counting for a prefetcher) and the head (with the draw's noise and without),
    the residual read after the wait where the GEMV path lets the next kernel launch before it (plan.GEMV_PDL's FIRST),
    w2 as `down` at 32 and 64 rows (bf16 and fp32, with PDL's late trigger), and the prefetcher's kernel: an H100/H200 cubin with Triton's bundled ptxas, and no register spills (a
    GEMV whose weight rows spill would crawl)."""
    sm90.run(AOT_SCRIPT)


# Minutes each in the interpreter, a minute of ptxas: started beside the other tests (early.py)
EARLY = {"test_fused_block_matches_model_in_interpreter": (SCRIPT, ENV),
         "test_engine_runs_the_fused_block_in_interpreter": (ENGINE_SCRIPT, ENV),
         "test_kernels_compile_for_sm90": (AOT_SCRIPT, sm90.env())}


DOWN_SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
from fast_inference.kernels import block_triton
from test_reference import tiny_model

model = tiny_model(seed=3, n_layer=1, dim=64, n_head=2)
model.fuse_projections()
layer, D = model.layers[0], model.args.dim
attend = lambda q, k, v, freqs, cache: q.transpose(1, 2)  # the attention aside: down is what differs
worst = 0.0
with torch.no_grad():
    for R in (17, 64):  # the dot path at 32 and 64 padded rows; w2's K in 128-wide chunks, split 3 ways
        x = torch.randn(R, 1, D, generator=torch.Generator().manual_seed(R))
        want = layer(x, None, attend)
        got = layer(x, None, attend, down=block_triton.down)
        assert got.shape == want.shape
        worst = max(worst, (got - want).abs().max().item())
print(worst)
"""


def test_down_matches_the_block_in_interpreter():
    """TransformerBlock.forward with `down` (w2 and the residual add in the dot path's split-K kernel) equals the
    model's own w2 and add at 17 and 64 rows, in float32."""
    out = subprocess.run([sys.executable, "-c", DOWN_SCRIPT], env=ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1e-5, out.stdout


COMPILED_DOWN_SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import functools
import torch
from torch._inductor.utils import run_and_get_code
from fast_inference.kernels import block_triton
from fast_inference.model import Context
from test_reference import tiny_model

model = tiny_model(seed=3, n_layer=2, dim=64, n_head=2)
model.fuse_projections()
R, L, T = 20, model.args.cls_token_num + 16, model.args.cls_token_num
model.setup_caches(R, L, torch.float32)
for layer in model.layers:  # both runs write the same key and value at pos and read no later one
    layer.attention.kv_cache.k_cache.normal_()
    layer.attention.kv_cache.v_cache.normal_()
pos, key_valid = torch.tensor([T + 5]), torch.ones(R, L, dtype=torch.bool)
x = torch.randn(R, 1, model.args.dim)
count = torch.zeros(1, dtype=torch.int32)
block = torch.compile(lambda layer, x, freqs, attend, input_pos: layer(x, freqs, attend, down=functools.partial(
    block_triton.down, progress=count)), fullgraph=True, dynamic=False)
with torch.no_grad():
    want = model.blocks(x, pos, key_valid)
    got, code = run_and_get_code(lambda: model.blocks(x, pos, key_valid, ctx=Context(block=block)))
assert count.item() == len(model.layers), count  # once per layer, as the prefetcher expects
assert "torch.ops.fast_inference.down.default(" in code[0]
print((got - want).abs().max().item())
"""


def test_compiled_block_calls_down_as_an_op_in_interpreter():
    """Under torch.compile (fullgraph) the block calls `down` as the op inductor leaves as it is (so that it launches
    under PDL), counts once per layer for a prefetcher, and gives the model's result, in float32."""
    out = subprocess.run([sys.executable, "-c", COMPILED_DOWN_SCRIPT], env=ENV, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.split()[-1]) < 1e-5, out.stdout


def test_down_launches_as_the_plan_says(monkeypatch):
    """`down` passes its op the launch mode the plan gives it and a scratch count without a prefetcher's; the plan
    gives the compiled block's w2 the dot path's PDL (the late trigger) on Hopper, none with down_pdl=off or where PDL
    does not exist."""
    import torch

    from fast_inference import plan
    from fast_inference.kernels import block_triton

    calls = []
    monkeypatch.setattr(block_triton, "down_op", lambda a, w, h, progress, count, p: calls.append((count, p)) or h)
    w2, a, h = torch.nn.Linear(8, 4, bias=False), torch.zeros(20, 1, 8), torch.zeros(20, 1, 4)
    block_triton.down(a, w2, h)
    block_triton.down(a, w2, h, progress=torch.zeros(1, dtype=torch.int32), pdl=plan.LATE)
    assert calls == [(False, 0), (True, plan.LATE)]
    w2_of = lambda **kw: plan.make(plan.Situation(device="cuda", batch=16, **kw)).guided.projection("w2")
    assert w2_of(capability=(9, 0)) == plan.Projection("triton_dot_down", plan.LATE)
    assert w2_of(capability=(9, 0), overrides=(("down_pdl", "off"),)) == plan.Projection("triton_dot_down", 0)
    assert w2_of(capability=(8, 0)) == plan.Projection("triton_dot_down", 0)


def test_down_serves_one_token_steps_past_the_fused_rows():
    """The plan gives the compiled block `down` at FUSED_ROWS < rows <= DOWN_ROWS on CUDA with float weights only: not
    the fused block's rows, more rows than measured, the CPU or int8 weights."""
    from fast_inference import plan

    cuda = plan.Situation(device="cuda", capability=(9, 0))
    lo, hi = plan.FUSED_ROWS, plan.DOWN_ROWS
    assert plan.serves_down(cuda, lo + 1) and plan.serves_down(cuda, hi)
    assert not plan.serves_down(cuda, lo) and not plan.serves_down(cuda, hi + 1)
    assert not plan.serves_down(plan.Situation(device="cpu"), hi)
    assert not plan.serves_down(plan.Situation(device="cuda", capability=(9, 0), int8=True), hi)


def test_down_traces_without_a_warning(monkeypatch):
    """The compiled block traces `down`: dynamo warns of nothing there (a functools cache on the PDL check it once
    made made it warn at every compile of the block, n = 16 and 32 in bench.py and fast_eval.py)."""
    import warnings

    import torch

    from fast_inference.kernels import block_triton

    monkeypatch.setattr(block_triton, "down_op", lambda a, w, h, progress, count, p: h + p)  # the kernel aside
    w2 = torch.nn.Linear(8, 4, bias=False)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        down = torch.compile(lambda a, h: block_triton.down(a, w2, h, pdl=2), backend="eager", fullgraph=True)
        out = down(torch.zeros(20, 1, 8), torch.ones(20, 1, 4))
    assert torch.equal(out, torch.ones(20, 1, 4) + 2)
    assert not [w for w in caught if "dynamo" in str(w.message).lower()], [str(w.message)[:200] for w in caught]


def test_the_merge_launches_under_pdl_on_the_dot_path(monkeypatch):
    """The decode attention's kernels launch as the block's on the GEMV path (PDL, FIRST: the next one before the
    wait; EARLY where GEMV_PDL says so), the merge with PDL's late trigger on the dot path where the partial kernel
    has no PDL (MERGE_PDL), and without PDL where there is none."""
    from fast_inference import plan
    from fast_inference.plan import EARLY, FIRST, LATE

    hopper, int8 = plan.Situation(device="cuda", capability=(9, 0)), plan.Situation(device="cuda", capability=(9, 0),
                                                                                    int8=True)
    on = {}
    assert plan.merge_pdl(hopper, 2, on) == plan.attention_pdl(hopper, 2) == plan.block_pdl(hopper, 2) == FIRST
    assert plan.block_pdl(hopper, 4) == FIRST and plan.block_pdl(hopper, 5) == LATE
    assert plan.merge_pdl(int8, 2, on) == plan.attention_pdl(int8, 2) == EARLY
    monkeypatch.setattr(plan, "GEMV_PDL", EARLY)
    assert plan.merge_pdl(hopper, 2, on) == plan.attention_pdl(hopper, 2) == EARLY
    assert not plan.attention_pdl(hopper, 16) and plan.merge_pdl(hopper, 16, on) == LATE
    assert not plan.merge_pdl(hopper, 16, {"merge_pdl": "off"})
    monkeypatch.setattr(plan, "MERGE_PDL", False)
    assert not plan.merge_pdl(hopper, 16, on)
    assert not plan.merge_pdl(plan.Situation(device="cuda", capability=(8, 0)), 2, on)
