"""The head's draw: sampling.py's ops (the engine's path without Triton) against draw_triton's
two kernels, at GPT-XL's vocabulary, CUDA-graph timed; the draw's parts, and a sweep of its warps
and race chunk. The draw makes the race's noise itself here (the fused head makes it in the engine at
<= 16 rows), and the logits are random normals: how often the race's first winner is in the top-k, and
so the time, depends on their spread.

    python tools/bench_draw.py [--batch 1,8,32] [--top-k 2000]

Also checks on the GPU that greedy draws are identical, and that sampled draws stay in the top-k set.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from fast_inference.kernels import draw_triton

PDL = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9  # as the plan launches it (EARLY)
from fast_inference.sampling import cfg_merge, filter_logits, sample

V = 16384  # LlamaGen's VQ codebook


def time_us(f):
    return triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--top-k", type=int, default=2000)
    args = ap.parse_args()
    for B in map(int, args.batch.split(",")):
        dev = "cuda"
        logits = (torch.randn(2 * B, V, device=dev) * 3).to(torch.bfloat16)  # the output projection's dtype
        token = torch.zeros(B, 1, dtype=torch.long, device=dev)
        out = torch.zeros(B, 1024, dtype=torch.long, device=dev)
        pos, seed = torch.tensor([500], device=dev), torch.tensor(7, device=dev)
        scale, temp = torch.tensor(4.0, device=dev), torch.tensor(1.0, device=dev)

        def torch_path(sample_logits=True):  # Sampler.emit without the fused draw
            x = logits.float()
            t = sample(cfg_merge(x, scale), temp, args.top_k, sample_logits=sample_logits, race=True)
            token.copy_(t)
            out.index_copy_(1, pos - 120 + 1, t)
            pos.add_(0)  # the engine advances the position here

        def fused(sample_logits=True):
            draw_triton.draw(logits, token, out, pos, seed, scale, temp, 120, args.top_k, True,
                             sample_logits, pdl=PDL)
            pos.add_(0)

        torch_path(False)
        want = token.clone()
        fused(False)
        greedy_same = torch.equal(token, want)
        kept = filter_logits(cfg_merge(logits.float(), scale), temp, args.top_k) > float("-inf")
        inside = True
        for s in range(20):
            seed.fill_(s)
            fused()
            inside &= bool(kept.gather(1, token).all())
        t_torch = time_us(torch_path)
        print(f"B={B} ({2 * B} rows, top-k {args.top_k}): sampling.py ops {t_torch:.1f} us | greedy identical "
              f"{greedy_same} | sampled draws inside the top-k set {inside}", flush=True)
        default = (draw_triton.WARPS, draw_triton.RACE_CHUNK)
        parts = []  # the default config without the top-k select, without the race, without either
        for top_k, sample_logits in ((0, True), (args.top_k, False), (0, False)):
            f = lambda: draw_triton.draw(logits, token, out, pos, seed, scale, temp, 120, top_k,
                                         True, sample_logits, pdl=PDL)
            parts.append(f"{time_us(f):.1f}")
        print(f"  default {default}: without top-k / without the race / without either: {' / '.join(parts)} us")
        rows = []
        for warps, chunk in itertools.product((8, 16, 32), (1024, 2048, 4096)):
            draw_triton.WARPS, draw_triton.RACE_CHUNK = warps, chunk
            rows.append((time_us(fused), warps, chunk))
        draw_triton.WARPS, draw_triton.RACE_CHUNK = default
        for t, warps, chunk in sorted(rows):
            mark = " (default)" if (warps, chunk) == default else ""
            print(f"  fused draw, {warps:2d} warps, race chunk {chunk}: {t:6.1f} us{mark}", flush=True)


if __name__ == "__main__":
    main()
