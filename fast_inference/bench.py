"""Reference vs fast engine on one GPU: tok/s, ratio, ms/step, % of roofline.

    python fast_inference/bench.py --random-weights                  # GPT-XL t2i 512px, n = 1, 8, 32

Each batch size runs in a process of its own, reference and fast engine, as the CLI and
fast_eval.py run one shape: a process's second CUDA-graph capture takes the programmatic dependent
launch's overlap from its step graphs (docs/PERF_NOTES.md, "Inductor's PDL and a second capture"),
so later shapes in one process stepped slower (n = 8 1.71 -> 1.78 ms, n = 32 3.26 -> 3.47 on an H200,
0af2a2b; since 8592fe6 step graphs captured earlier no longer cost a later shape: "Second captures after
#32"). --in-process times them all in this process, one after the other.

Reference: the official loop (generate.py) timed over --ref-steps decode steps, as the difference
of two runs (10 and 10 + ref-steps steps, caches sized for the full image), so prefill and set-up
cancel; its image time is extrapolated as prefill + (N - 1) x step. Fast: full images after one
warm-up image (whose compile/capture time is reported separately). Roofline: the bytes a decode
step must read -- transformer weights plus the filled part of the KV cache, averaged over the
image -- over the measured device-to-device copy bandwidth (read + write counted).
"""
import argparse
import copy
import json
import math
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference import plan as plans
from fast_inference.engine import BACKENDS, COMPILE_SCOPES, SPECULATIVE, Engine, vq_kernels
from fast_inference.components import check_memory, check_writable
from fast_inference.flags import DRAFT_DEFAULTS, Parser, official_tf32, ranged, tree_arg
from fast_inference.settings import RANGES, UserError, check_ranges, span
from fast_inference.workload import (bench_fast, bench_speculative, inputs, scale_to_entropy, step_bytes,
                                     timed)
from fast_inference.generate import generate
from fast_inference.model import ModelArgs, Transformer
from fast_inference.quantize import MODES as QUANTIZE_MODES, quantize_int8
from fast_inference.speculative import COUPLINGS, DEFAULT_INIT, DRAFT_INITS


# The numeric flags' ranges (settings.RANGES' form), checked before anything runs.
BENCH_RANGES = dict(image_size=RANGES["image_size"], cfg_scale=RANGES["cfg_scale"], top_k=RANGES["top_k"],
                    ref_steps=(0, None, "0 = skip the reference"), fast_runs=(1, None, None),
                    e2e_runs=(0, None, "0 = skip"), draft_window=RANGES["draft_window"],
                    target_entropy=(0.01, 9.7, "nats; at most log(16384)"))


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--gpt-model", default="GPT-XL")
    p.add_argument("--gpt-ckpt", default=None)
    p.add_argument("--random-weights", action="store_true", help="no checkpoint: random weights")
    p.add_argument("--adapter-size", default="small")
    p.add_argument("--image-size", type=int, default=512, help=ranged("image_size", "image side", BENCH_RANGES))
    p.add_argument("--batch-sizes", default="1,8,32", help="images per batch, comma-separated (each >= 1)")
    p.add_argument("--cfg-scale", type=float, default=4.0, help=ranged("cfg_scale", "guidance scale", BENCH_RANGES))
    p.add_argument("--top-k", type=int, default=2000, help=ranged("top_k", "top-k", BENCH_RANGES))
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--quantize", choices=list(QUANTIZE_MODES), default="none",
                   help="int8: the fast engine on a weight-only int8 copy (the reference keeps the model's weights)")
    p.add_argument("--backend", choices=list(BACKENDS), default="inductor")
    p.add_argument("--compile-mode", default="reduce-overhead")
    p.add_argument("--compile-prefill", action="store_true")
    p.add_argument("--compile-scope", choices=list(COMPILE_SCOPES), default="block")
    p.add_argument("--no-fused-block", action="store_true",
                   help="block scope: the compiled block at every batch size (default: fused kernels at <= 16 rows, n <= 8)")
    p.add_argument("--plan", action="append", default=[], metavar="KEY=VALUE",
                   help="override the fast engine's decode plan (fast_engine.py --help lists the keys)")
    p.add_argument("--speculative", choices=list(SPECULATIVE), default="none",
                   help="jacobi: also time speculative Jacobi decoding (fast_engine.py --help), beside the plain engine")
    p.add_argument("--draft-window", type=int, default=None,
                   help=f"positions a pass verifies, {span('draft_window', BENCH_RANGES)}; {DRAFT_DEFAULTS}")
    p.add_argument("--draft-init", choices=list(DRAFT_INITS), default=DEFAULT_INIT)
    p.add_argument("--draft-coupling", choices=list(COUPLINGS), default=None, help="default: as --draft-window")
    p.add_argument("--draft-tree", type=tree_arg, default=None, metavar="WxD[+SxE]|none",
                   help="a draft tree per pass (fast_engine.py --help; --draft-coupling pathwise); default: as "
                        "--draft-window")
    p.add_argument("--target-entropy", type=float, default=None,
                   help=ranged("target_entropy", "scale the output layer so that the sampled distributions' mean "
                               "entropy is this (random weights' are nearly flat: drafts are then rarely accepted)",
                               BENCH_RANGES))
    p.add_argument("--ref-steps", type=int, default=200, help="reference decode steps timed (0: skip; >= 0)")
    p.add_argument("--fast-runs", type=int, default=2, help="timed fast images per batch size (>= 1)")
    p.add_argument("--e2e-runs", type=int, default=5,
                   help="timed images end to end at n = 1 (their median is reported; 0: skip; >= 0)")
    p.add_argument("--out-dir", default="sample/bench")
    p.add_argument("--tag", default="", help="name suffix of the JSON/PNG files")
    p.add_argument("--in-process", action="store_true",
                   help="every batch size in this process (default: each in a process of its own)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a child's JSON (one batch size)
    p.add_argument("--no-header", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def copy_bandwidth(device, nbytes=2 << 30):
    """Device-to-device copy rate in bytes/s, counting read + write."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3)


def bench_reference(model, B, N, args, kw, device):
    if args.ref_steps <= 0:
        return None
    cond, mask, condition = inputs(model, B, args.image_size, device)
    run = lambda steps: generate(model, cond, N, emb_masks=mask, condition=condition, max_steps=steps, **kw)
    run(2)  # warm-up (cuBLAS handles, allocator)
    t_short, _ = timed(lambda: run(10), device)
    t_long, _ = timed(lambda: run(10 + args.ref_steps), device)
    step = (t_long - t_short) / args.ref_steps
    prefill = max(t_short - 10 * step, 0.0)
    return dict(step_ms=step * 1e3, tok_s=B / step, image_s=prefill + (N - 1) * step)


# one image end to end through the plain engine, then through the speculative one (--speculative): median, each run
E2E_KEYS = ("end_to_end_s", "end_to_end_runs_s", "speculative_end_to_end_s", "speculative_end_to_end_runs_s")


def end_to_end(engine, model, vq, args, kw, device):
    """One image: condition encoder + prefill + decode + VQ decode, warm: the median of --e2e-runs images, and
    each (one image's time moves by ~1 ms from one to the next, the decode's share of a 1.0 s target's margin)."""
    cond, mask, condition = inputs(model, 1, args.image_size, device)
    grid = args.image_size // 16
    N = grid * grid

    def one():
        tokens = engine.generate(cond, N, emb_masks=mask, condition=condition, **kw)
        return vq.decode_code(tokens, (1, 8, grid, grid))

    one()
    runs = [timed(one, device)[0] for _ in range(args.e2e_runs)]
    return sorted(runs)[len(runs) // 2], runs


def plot(rows, path):
    """A bar chart of tok/s (log scale), reference vs fast, drawn with PIL (no matplotlib needed)."""
    import math

    from PIL import Image, ImageDraw

    W, H, pad = 640, 360, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    top = max(max(r["fast"]["tok_s"], (r["reference"] or {}).get("tok_s", 1)) for r in rows)
    scale = lambda v: (H - pad) - (H - 2 * pad) * math.log10(max(v, 1)) / math.log10(top * 1.5)
    slot = (W - 2 * pad) / len(rows)
    for i, r in enumerate(rows):
        x = pad + i * slot + slot * 0.15
        for j, (name, color) in enumerate((("reference", (160, 160, 160)), ("fast", (40, 110, 200)))):
            v = (r[name] or {}).get("tok_s", 0)
            if v:
                d.rectangle([x + j * slot * 0.35, scale(v), x + j * slot * 0.35 + slot * 0.3, H - pad], fill=color)
                d.text((x + j * slot * 0.35, scale(v) - 12), f"{v:.0f}", fill="black")
        d.text((x + slot * 0.2, H - pad + 8), f"n={r['n']}", fill="black")
    d.text((pad, 15), "tok/s (log scale): reference (grey) vs fast (blue)", fill="black")
    img.save(path)


def fail(message, code=2):
    """A user's mistake (code 2, as the other tools), or a failed child's code: one line, nothing written."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def check_args(args):
    """Everything checked before any process starts or GPU memory is touched -> the batch sizes."""
    check_ranges(args, BENCH_RANGES)
    if args.image_size % 16:
        raise UserError(f"--image-size {args.image_size} is not a multiple of 16; use e.g. {-(-args.image_size // 16) * 16}")
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise UserError(f"--batch-sizes {args.batch_sizes!r}: give whole numbers >= 1 separated by commas, e.g. 1,8,32")
    if args.speculative != "none" and (args.backend == "cudagraph" or args.compile_scope == "step"):
        raise UserError("--speculative jacobi runs on --backend inductor with --compile-scope block, or on --backend "
                        "eager")
    drafts = plans.given_drafts(args.draft_window, args.draft_coupling, args.draft_tree)
    if args.speculative != "none" and drafts.tree and drafts.coupling != "pathwise":
        raise UserError("--draft-tree is exact with --draft-coupling pathwise only; add it, or --draft-tree none")
    if args.speculative != "none" and args.draft_init == "above" and args.image_size // 16 < drafts.window:
        raise UserError(f"--draft-init above needs --image-size >= {16 * drafts.window} (--draft-window x 16)")
    if not args.random_weights and not args.gpt_ckpt:
        raise UserError("pass --random-weights or --gpt-ckpt PATH")
    if args.gpt_ckpt and not os.path.isfile(args.gpt_ckpt):
        raise UserError(f"--gpt-ckpt {args.gpt_ckpt} not found")
    try:
        bench_model_args(args)
    except ValueError as e:
        raise UserError(f"--gpt-model {args.gpt_model}: {e}") from None
    if os.sep in args.tag or (os.altsep and os.altsep in args.tag):
        raise UserError(f"--tag {args.tag!r} names a folder; --tag is a file-name suffix, the folder is --out-dir")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UserError(f"--out-dir {args.out_dir} is a file; give a folder")
    check_writable(os.path.join(args.out_dir, "bench.json"))
    return sizes


def bench_model_args(args):
    grid = args.image_size // 16
    return ModelArgs.from_name(args.gpt_model, block_size=grid * grid, adapter_size=args.adapter_size,
                               condition_type="hed")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    try:
        sizes = check_args(args)
    except UserError as e:
        fail(e)
    if not torch.cuda.is_available():
        fail("bench.py needs a CUDA GPU")
    if len(sizes) > 1 and not args.in_process:
        result = isolated(args, argv, sizes)
    else:
        result = measure(args, sizes)
        if args.part:  # a child of isolated(): its parent prints the rest and writes the files
            with open(args.part, "w") as f:
                json.dump(result, f)
            return
    for key, what in (("end_to_end", ""), ("speculative_end_to_end", f", --speculative {args.speculative}")):
        if result.get(key + "_s") is not None:
            runs = result[key + "_runs_s"]
            print(f"end-to-end, one image{what} (condition encoder + prefill + decode + VQ decode, warm): "
                  f"{result[key + '_s']:.3f} s (median of {len(runs)}: {min(runs):.3f}-{max(runs):.3f} s)")
    os.makedirs(args.out_dir, exist_ok=True)
    stem = os.path.join(args.out_dir, f"bench_{args.gpt_model}_{args.backend}{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result["rows"], stem + ".png")
    print(f"wrote {stem}.json and {stem}.png")


def isolated(args, argv, sizes):
    """Each batch size measured by a process of its own (this script with --in-process), one after the
    other; their rows in one result. A failed child ends the run with nothing written."""
    parts = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, B in enumerate(sizes):
            part = os.path.join(tmp, f"n{B}.json")
            cmd = [sys.executable, os.path.abspath(__file__), *argv, "--batch-sizes", str(B), "--in-process",
                   "--part", part] + (["--no-header"] if i else [])
            code = subprocess.run(cmd).returncode
            if code != 0:
                fail(f"the n = {B} process failed (its error is above); nothing written", 2 if code == 2 else 1)
            with open(part) as f:
                parts.append(json.load(f))
    e2e = [p for p in parts if p["end_to_end_s"] is not None]  # the n = 1 part's
    return dict(parts[0], args=vars(args), rows=[r for p in parts for r in p["rows"]],
                **{k: e2e[0].get(k) if e2e else None for k in E2E_KEYS})


def measure(args, sizes):
    """Every batch size in this process: the model, the VQ decoder and one engine, built once."""
    device = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.precision]
    official_tf32()
    grid = args.image_size // 16
    margs = bench_model_args(args)
    drafts = plans.given_drafts(args.draft_window, args.draft_coupling, args.draft_tree)
    try:
        # the VQ decodes only the end-to-end images, at n = 1
        check_memory(margs, args.image_size, args.image_size, max(sizes), args.cfg_scale, device, dtype,
                     "use smaller --batch-sizes or --image-size", int8=args.quantize == "int8",
                     window=plans.widest_window(drafts) if args.speculative != "none" else 0, coupling=drafts.coupling,
                     decoded=int(1 in sizes and args.e2e_runs > 0))
    except UserError as e:
        fail(e)
    with torch.device(device):
        model = Transformer(margs)
    if args.gpt_ckpt:
        from fast_inference.checkpoint import load_weights, read_state_dict

        load_weights(model, read_state_dict(args.gpt_ckpt), source=args.gpt_ckpt)
    model = model.to(dtype).eval().requires_grad_(False)
    from fast_inference.vq import VQ_models

    with torch.device(device):
        vq = vq_kernels(VQ_models["VQ-16"]().eval().requires_grad_(False), args.backend, device, args.plan)
    bw = copy_bandwidth(device)
    N = grid * grid
    kw = dict(cfg_scale=args.cfg_scale, top_k=args.top_k, temperature=1.0, top_p=1.0)
    entropy = scale = None
    if args.target_entropy is not None:
        with torch.no_grad():
            scale, entropy = scale_to_entropy(model, args.target_entropy, args, kw, device)
    fast_model = quantize_int8(copy.deepcopy(model)) if args.quantize == "int8" else model
    engine = Engine(fast_model, backend=args.backend, compile_mode=args.compile_mode,
                    compile_prefill=args.compile_prefill, compile_scope=args.compile_scope,
                    fused_block=not args.no_fused_block, overrides=args.plan)
    jacobi = None if args.speculative == "none" else Engine(
        fast_model, backend=args.backend, compile_mode=args.compile_mode, compile_prefill=args.compile_prefill,
        compile_scope=args.compile_scope, fused_block=not args.no_fused_block, overrides=args.plan + ["jacobi=on"],
        speculative=args.speculative, draft_window=args.draft_window, draft_init=args.draft_init,
        draft_coupling=args.draft_coupling, draft_tree=args.draft_tree)
    rows, e2e = [], dict.fromkeys(E2E_KEYS)  # end to end is timed with n = 1 only
    scope = ""
    if args.backend == "inductor":
        fused = "" if args.compile_scope == "step" else ", compiled block only" if args.no_fused_block else \
            f", fused block at <= {plans.FUSED_ROWS} rows"
        scope = f" (compile scope {args.compile_scope}{fused})"
    weights = " (fast: int8 weights)" if args.quantize == "int8" else ""
    where = "one process" if args.in_process and not args.part else "a process per batch size"
    if not args.no_header:
        print(f"{torch.cuda.get_device_name()} | {args.gpt_model} {args.image_size}px ({N} tokens) | cfg "
              f"{args.cfg_scale} top-k {args.top_k} | {args.precision}{weights} | backend {args.backend}{scope} | "
              f"{where} | copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
        if entropy is not None:
            print(f"output layer x {scale:.3g}: the sampled distributions' mean entropy {entropy:.2f} nats over the "
                  f"first 64 tokens (random weights: {math.log(min(args.top_k or margs.vocab_size, margs.vocab_size)):.2f} "
                  f"at most)", flush=True)
    with torch.no_grad():
        for B in sizes:
            torch.cuda.reset_peak_memory_stats()
            ref = bench_reference(model, B, N, args, kw, device)
            model.clear_caches()
            fast = bench_fast(engine, fast_model, B, N, args, kw, device)
            rows_ = 2 * B if args.cfg_scale > 1 else B
            roof_ms = step_bytes(fast_model, rows_, margs.cls_token_num, N) / bw * 1e3
            speculative = None
            if jacobi is not None:  # after the plain engine: its own caches and graphs
                speculative = bench_speculative(jacobi, B, N, args, kw, device)
                speculative.update(pass_vs_step=speculative["pass_ms"] / fast["step_ms"],
                                   vs_fast=speculative["tok_s"] / fast["tok_s"])
            row = dict(n=B, reference=ref, fast=fast, roofline_step_ms=roof_ms, copy_bandwidth_Bps=bw,
                       roofline_pct=100 * roof_ms / fast["step_ms"], peak_mem_gb=torch.cuda.max_memory_allocated() / 1e9,
                       speculative=speculative, output_scale=scale, entropy=entropy)
            rows.append(row)
            print_row(row, flush=True)
            if B == 1 and args.e2e_runs > 0:  # while the n=1 graphs are warm
                e2e.update(zip(E2E_KEYS[:2], end_to_end(engine, fast_model, vq, args, kw, device)))
                if jacobi is not None:
                    e2e.update(zip(E2E_KEYS[2:], end_to_end(jacobi, fast_model, vq, args, kw, device)))
    return dict(args=vars(args), device=torch.cuda.get_device_name(), torch=torch.__version__, copy_bandwidth_Bps=bw,
                rows=rows, **e2e)


def print_row(r, flush=False):
    ref, fast = r["reference"], r["fast"]
    ref_s = f"{ref['tok_s']:8.1f} tok/s ({ref['step_ms']:6.1f} ms/step)" if ref else "   (skipped)"
    ratio = f"{fast['tok_s'] / ref['tok_s']:6.1f}x" if ref else "   -"
    print(f"n={r['n']:<3d} reference {ref_s} | fast {fast['tok_s']:9.1f} tok/s ({fast['step_ms']:6.2f} ms/step) | "
          f"{ratio} | roofline {r['roofline_pct']:5.1f}% ({r['roofline_step_ms']:.2f} ms) | compile "
          f"{fast['compile_s']:.1f}s | peak {r['peak_mem_gb']:.1f} GB", flush=flush)
    s = r.get("speculative")
    if s:
        print(f"      jacobi L={s['window']} ({s['init']}, coupling {s['coupling']}, tree {s['tree']}) {s['tok_s']:9.1f} tok/s "
              f"({s['vs_fast']:.2f}x the plain engine) | "
              f"{s['passes_per_image']:.0f} passes per image, {s['tokens_per_pass']:.2f} tokens per pass | one pass "
              f"{s['pass_ms']:.2f} ms = {s['pass_vs_step']:.2f} plain steps | compile {s['compile_s']:.1f}s", flush=flush)


if __name__ == "__main__":
    main()
