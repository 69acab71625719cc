"""Per-kernel GPU time of one decode step of the default engine (compiled blocks, run without the
CUDA graph so the profiler sees each kernel), GPT-XL bf16, and the captured graph's replay time.

    python tools/profile_step.py --batch-sizes 1,32 [--steps 20]

Prints, for each batch size, the kernel time per step, the kernel count, the replay time of the
captured step at the same position (replay minus kernel time = the gaps between kernels), and the
top kernels by total CUDA time over --steps decode steps.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from torch.profiler import ProfilerActivity, profile

from fast_inference.workload import inputs, random_gpt_xl
from fast_inference.engine import Engine


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=14)
    a = p.parse_args()
    model = random_gpt_xl()
    with torch.no_grad():
        for B in map(int, a.batch_sizes.split(",")):
            model.clear_caches()
            engine = Engine(model, backend="inductor", compile_mode="default")
            cond, mask, condition = inputs(model, B, 512, "cuda")
            engine.generate(cond, 1024, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=2000)
            s = engine.runner
            s.input_pos.fill_(700)  # a mid-image position: filled cache ~ the average
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    s.input_pos.fill_(700)
                    engine.step_fns[True, 0]()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
            events.sort(key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in events) / a.steps
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(a.steps):
                s.input_pos.fill_(700)
                engine.graphs.replay((True, 0))
            end.record()
            torch.cuda.synchronize()
            print(f"batch {B}: {total / 1e3:.2f} ms of kernels per step, {sum(e.count for e in events) // a.steps} "
                  f"kernels; captured step replayed: {start.elapsed_time(end) / a.steps:.2f} ms (with a fill kernel)")
            for e in events[: a.top]:
                print(f"  {e.device_time_total / a.steps:8.1f} us/step  x{e.count // a.steps:<4d} {e.key[:90]}")


if __name__ == "__main__":
    main()
