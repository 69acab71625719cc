"""The kernels of one replayed decode step graph in start order (default engine, GPT-XL bf16, random weights,
cfg 4, top-k 2000): start, duration and the gap after the kernel before, for the kernels outside the blocks
and the first and last few, so the small kernels around the blocks show.

    python tools/step_timeline.py --batch-sizes 1,8 [--position 700] [--replays 6] [--by-name] [--setting CODE]
                                    [--backend cudagraph]

torch.profiler over `--replays` replays of the step graph at one position (the third is printed); the
profiler adds a little to each step. Memsets and copies the graph holds are listed with the kernels. --by-name:
that step's kernels counted and their time summed by name instead, largest first (where the time goes per kind
of kernel). --setting: Python run first with the plan and kernel modules in scope, as engine_ab.py's settings
(e.g. "overrides = 'prefetch=off'": the step without the L2 prefetcher). --backend cudagraph: that
backend's step (no Triton), the graph of the cache window that holds the position. One CUDA GPU.
"""
import argparse
import collections
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.profiler import ProfilerActivity, profile

from engine_ab import MODULES, compile_settings
from fast_inference import plan
from fast_inference.workload import inputs, random_gpt_xl
from fast_inference.engine import Engine

BLOCK = ("_qkv_kernel", "_partial_kernel", "_merge_kernel", "_linear_kernel", "_gate_up_kernel")


def kernels(graph, replays):
    """The kernel events of `replays` replays of graph, in start order."""
    return kernel_events(graph.replay, replays)


def kernel_events(run, times):
    """The kernel events of `times` calls of run(), in start order."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(events, key=lambda e: e["ts"])


def by_name(step, width=70):
    """[(name cut to width, count, summed duration in us)] of a step's kernel events, largest sum first."""
    count, total = collections.Counter(), collections.Counter()
    for e in step:
        count[e["name"][:width]] += 1
        total[e["name"][:width]] += e["dur"]
    return [(name, count[name], total[name]) for name in sorted(total, key=lambda n: -total[n])]


def write_by_name(events, runs, label, out, top=25):
    """The second of `runs` runs' kernel events (in start order, as kernel_events gives them) by name, largest time
    first, to the open file out under label."""
    per = len(events) // runs
    rows = by_name(events[per : 2 * per])
    total = sum(us for _, _, us in rows)
    out.write(f"{label}: {per} kernels, {total:.1f} us of kernel time\n")
    for name, n, us in rows[:top]:
        out.write(f"  {n:4d} x {us:8.1f} us  {100 * us / max(total, 1e-9):5.1f}%  {name}\n")
    out.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--position", type=int, default=700)
    ap.add_argument("--replays", type=int, default=6)
    ap.add_argument("--by-name", action="store_true", help="kernel count and time by name instead of the timeline")
    ap.add_argument("--backend", choices=("inductor", "cudagraph"), default="inductor")
    ap.add_argument("--setting", default="", help='Python run first with the plan and kernel modules in scope, '
                    "e.g. \"overrides = 'prefetch=off'\"")
    args = ap.parse_args()
    try:
        (setting,) = compile_settings([args.setting])
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("step_timeline.py needs a CUDA GPU")
    scope = dict(MODULES)
    exec(setting, scope)
    overrides = plan.parse_overrides(scope.get("overrides", ""))
    model = random_gpt_xl()
    with torch.no_grad():
        for B in map(int, args.batch_sizes.split(",")):
            model.clear_caches()
            engine = Engine(model, backend=args.backend, overrides=overrides)
            cond, mask, condition = inputs(model, B, 512, "cuda")
            engine.generate(cond, 1024, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=2000)
            engine.runner.input_pos.fill_(args.position)  # each replay advances it by one
            r = engine.runner
            graph = engine.graphs.graphs[True, r.window(args.position - r.prefix_len)]
            for _ in range(3):
                graph.replay()
            events = kernels(graph, args.replays)
            per = len(events) // args.replays
            span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / args.replays
            print(f"n = {B}: {per} kernels per step, {span:.1f} us per step under the profiler", flush=True)
            step = events[2 * per: 3 * per]
            if args.by_name:
                for name, n, us in by_name(step):
                    print(f"  {n:4d} x {us:8.1f} us  {name}", flush=True)
                continue
            end = step[0]["ts"]
            for i, e in enumerate(step):
                name = e["name"][:70]
                if not name.startswith(BLOCK) or i < 8 or i >= len(step) - 8:
                    print(f"  {i:4d} start {e['ts'] - step[0]['ts']:8.1f} us  duration {e['dur']:6.1f}  "
                          f"gap {e['ts'] - end:5.1f}  {name}", flush=True)
                end = e["ts"] + e["dur"]


if __name__ == "__main__":
    main()
