"""The compiled block's step graph timed against what the process captured before it (PERF_NOTES,
"Inductor's PDL and the second capture"). GPT-XL bf16, random weights, default engine, one CUDA GPU.

    python scripts/graph_order_probe.py 32              # n = 32 is the process's first capture
    python scripts/graph_order_probe.py 1,32            # the fused path's graphs first
    python scripts/graph_order_probe.py graph,32        # one trivial cuBLAS graph captured first
    python scripts/graph_order_probe.py 32,recapture    # the n = 32 step captured again afterwards

Items run in order:
- a batch size: two 1,024-token images (the decode ms/step of the second is printed); one smaller
  than the batch before it replays that batch's graph (the engine pads a batch up to the captured one);
- `graph`: captures and replays a CUDA graph of one 64 x 1,280 x 1,280 matmul;
- `recapture`: captures the current step a second time (`recapture-keep`: the same with
  torch.cuda.empty_cache a no-op, as torch.cuda.graph calls it);
- `drop`: destroys every graph but the last shape's first step graph;
- `gc`: gc.collect() only; `free`: 1 GiB allocated, freed and handed back to the driver, no capture.
At the end the step graphs are replayed at position 700 (a mid-image cache), the first one again last.

The same question without the engine: scripts/capture_probe.py.
"""
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference.bench import inputs, random_gpt_xl
from fast_inference.engine import Engine, capture


def replay_ms(s, graph, n=50):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        s.input_pos.fill_(700)
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def trivial_graph():
    a = torch.randn(64, 1280, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1280, 1280, device="cuda", dtype=torch.bfloat16)
    a @ w
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        a @ w
    g.replay()
    return g


def main():
    items = sys.argv[1].split(",") if len(sys.argv) > 1 else ["32"]
    keep, graphs = [], []
    model = random_gpt_xl()
    engine = Engine(model)
    with torch.no_grad():
        for item in items:
            if item == "graph":
                keep.append(trivial_graph())
            elif item == "recapture":
                graphs.append(capture(engine.sampler, engine.step_fns[True, 0]))
            elif item == "recapture-keep":  # the same with torch.cuda.empty_cache a no-op
                empty, torch.cuda.empty_cache = torch.cuda.empty_cache, lambda: None
                graphs.append(capture(engine.sampler, engine.step_fns[True, 0]))
                torch.cuda.empty_cache = empty
            elif item == "drop":  # every other graph destroyed: only the last shape's first step graph lives
                graphs, keep = graphs[:1], []
                gc.collect()
                torch.cuda.synchronize()
            elif item == "gc":
                gc.collect()
            elif item == "free":  # memory given back to the driver, no capture
                torch.empty(1 << 30, device="cuda", dtype=torch.uint8)  # dropped at once: cached, then freed
                torch.cuda.empty_cache()
            else:
                cond, mask, condition = inputs(model, int(item), 512, "cuda")
                for _ in range(2):
                    engine.generate(cond, 1024, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=2000)
                graphs = [engine.graphs[True, 0]]
                print(f"n = {item}: decode {engine.last_timings['decode'] / 1023 * 1e3:.3f} ms/step", flush=True)
        if not graphs:
            return
        s = engine.sampler
        times = [f"{replay_ms(s, g):.3f}" for g in graphs] + ([f"{replay_ms(s, graphs[0]):.3f}"] if len(graphs) > 1 else [])
        print(f"{sys.argv[1] if len(sys.argv) > 1 else '32'}: step graph(s) replayed at position 700: "
              f"{' / '.join(times)} ms", flush=True)


if __name__ == "__main__":
    main()
