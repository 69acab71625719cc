"""A speculative pass against the plain step in one process, for several plans (issue 75): GPT-XL 512 px, bf16, random
weights with the output scaled to a mean sampled entropy (bench.py's --target-entropy), cfg 4, top-k 2000, left drafts
with Gumbel coupling (the defaults), L = 16. The plain engine is built and timed once per batch size; each plan's
speculative engine after it, on the same model and inputs.

    python tools/pass_ab.py --batch-sizes 1,8 --entropy 3 --plans "" "window_attention=triton,window_inputs=triton" \
        "window_attention=triton,window_inputs=triton,window_block=fused,verify=triton" [--profile-dir DIR] [--json F]

Per (n, plan): the plain step's ms, the pass's ms and its ratio to the step, tokens per pass, tok/s and its ratio to
the plain engine's (bench.py's bench_fast and bench_speculative: the median of --runs images after a warm-up one).
--profile-dir: for each plan at n = 1, the kernels of one replayed pass graph summed by name, largest first, and the
plain step's, to DIR/pass_profile_n1.txt (tools/step_timeline.py's profiler: 3 replays, the second printed). Every
pass runs with jacobi=on (the plan's PASS_GAINS would run plain steps where the pass lost). One CUDA GPU.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from step_timeline import kernels, write_by_name
from fast_inference.workload import bench_fast, bench_speculative, inputs, random_gpt_xl, scale_to_entropy
from fast_inference.engine import Engine
from fast_inference.kernels import block_triton
from fast_inference.draft_tree import format_tree
from fast_inference.flags import tree_arg
from fast_inference.speculative import COUPLINGS, DEFAULT_COUPLING, DEFAULT_INIT

N = 1024  # 512 px


def profile(graph, label, out):
    """One replay's kernels of graph (of 3 under the profiler) by name, largest time first, to out."""
    for _ in range(2):
        graph.replay()
    write_by_name(kernels(graph, 3), 3, label, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--entropy", type=float, default=3.0, help="mean sampled entropy in nats (bench.py's)")
    ap.add_argument("--plans", nargs="+", default=[""], help="comma-separated plan overrides, one set per engine")
    ap.add_argument("--draft-window", type=int, default=16)
    ap.add_argument("--draft-coupling", choices=COUPLINGS, default=DEFAULT_COUPLING)
    ap.add_argument("--draft-tree", type=tree_arg, default=(), metavar="WxD[+SxE]|none",
                    help="each pass a draft tree (needs --draft-coupling pathwise); the plan's draft_tree=on is added")
    ap.add_argument("--compile-mode", choices=["reduce-overhead", "max-autotune"], default="reduce-overhead",
                    help="the speculative engines' (fast_engine.py's flag; max-autotune tunes the compiled block's "
                         "GEMMs at the pass's rows); the plain engine keeps the default")
    ap.add_argument("--runs", type=int, default=3, help="timed images per engine after a warm-up one")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dot-tilings", default=None, help="tools/bench_block.py --json's file: its best dot-path "
                    "tilings at each row count become block_triton.DOT_CONFIG_ROWS for every plan here")
    args = ap.parse_args()
    if args.dot_tilings:
        with open(args.dot_tilings) as f:
            found = json.load(f)
        block_triton.DOT_CONFIG_ROWS = {int(r): {n: tuple(c) for n, c in v["best"].items()} for r, v in found.items()}
        modes = ", ".join(v.get("pass_pdl", "off") for v in found.values())
        print(f"dot-path tilings by rows: {block_triton.DOT_CONFIG_ROWS} (swept with bench_block.py --pass-pdl {modes}: "
              f"the plan's window_block_pdl)", flush=True)
    if not torch.cuda.is_available():
        sys.exit("pass_ab.py needs a CUDA GPU")
    model = random_gpt_xl()
    kw = dict(cfg_scale=4.0, top_k=2000, temperature=1.0, top_p=1.0)
    bargs = argparse.Namespace(image_size=512, fast_runs=args.runs, draft_window=args.draft_window,
                               draft_init=DEFAULT_INIT, draft_coupling=args.draft_coupling, draft_tree=args.draft_tree)
    with torch.no_grad():
        scale, entropy = scale_to_entropy(model, args.entropy, bargs, kw, "cuda")
    print(f"{torch.cuda.get_device_name()} | GPT-XL bf16 512 px, output x {scale:.3g} (mean entropy {entropy:.2f} "
          f"nats), cfg 4, top-k 2000 | L = {args.draft_window}, {DEFAULT_INIT} drafts, {args.draft_coupling} coupling, "
          f"tree {format_tree(args.draft_tree)}",
          flush=True)
    print("| n | plan | plain ms/step | pass ms | pass / step | tokens per pass | tok/s | x plain |", flush=True)
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    prof = None
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
        prof = open(os.path.join(args.profile_dir, "pass_profile_n1.txt"), "w")
    with torch.no_grad():
        for B in map(int, args.batch_sizes.split(",")):
            model.clear_caches()
            plain = Engine(model)
            fast = bench_fast(plain, model, B, N, bargs, kw, "cuda")
            if prof is not None and B == 1:
                r = plain.runner
                profile(plain.graphs.graphs[True, r.window(N // 2)], "plain step, n = 1", prof)
            for overrides in args.plans:
                model.clear_caches()
                plain.runner = None  # the speculative engine takes the caches
                tree = ("draft_tree=on",) if args.draft_tree else ()
                engine = Engine(model, speculative="jacobi", compile_mode=args.compile_mode,
                                draft_window=args.draft_window, draft_coupling=args.draft_coupling,
                                draft_tree=args.draft_tree,
                                overrides=tuple(o for o in overrides.split(",") if o) + ("jacobi=on",) + tree)
                spec = bench_speculative(engine, B, N, bargs, kw, "cuda")
                row = dict(n=B, plan=overrides or "(default)", step_ms=fast["step_ms"], pass_ms=spec["pass_ms"],
                           pass_vs_step=spec["pass_ms"] / fast["step_ms"], tokens_per_pass=spec["tokens_per_pass"],
                           tok_s=spec["tok_s"], vs_plain=spec["tok_s"] / fast["tok_s"], plain_tok_s=fast["tok_s"],
                           verify=engine.plan.jacobi.verify, block=engine.plan.jacobi.block)
                results.append(row)
                print(f"| {B} | {row['plan']} | {row['step_ms']:.3f} | {row['pass_ms']:.3f} | "
                      f"{row['pass_vs_step']:.2f} | {row['tokens_per_pass']:.2f} | {row['tok_s']:.0f} | "
                      f"{row['vs_plain']:.2f} |", flush=True)
                if args.json:  # after each row: a run stopped by its time limit keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump(dict(entropy=entropy, scale=scale, rows=results), f, indent=1)
                if prof is not None and B == 1:
                    profile(engine.graphs.graphs[("pass",)], f"pass, n = 1, {row['plan']} (block {row['block']}, "
                            f"verify {row['verify']})", prof)
                del engine
    if prof is not None:
        prof.close()
        print(f"wrote {prof.name}", flush=True)


if __name__ == "__main__":
    main()
