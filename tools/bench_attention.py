"""Sweep the split-KV decode kernel's (BLOCK, num_warps, merge num_warps) against SDPA at GPT-XL shapes.

    python tools/bench_attention.py [--rows 2,16,64] [--positions 300,700,1100]

Prints, per (rows, position), SDPA over the whole cache, the ideal (the K/V bytes of the keys the
kernel reads, from the first attendable one to the position, at 4.27 TB/s) and every config, best
first; the table (CONFIGS) in fast_inference/kernels/attention_triton.py comes from here.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from fast_inference.kernels.attention_triton import config_for, decode_attention
from fast_inference.model import attention_mask

H, L, HD = 20, 1144, 64  # GPT-XL heads, 120 text + 1024 image positions, head size
PAD = 100  # leading text keys that are padding (skipped by the kernel), as in bench.py


def configs():
    yield from itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 4))


def time_us(f):
    return triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,16,64")
    ap.add_argument("--positions", default="700")
    args = ap.parse_args()
    for R, pos in itertools.product(map(int, args.rows.split(",")), map(int, args.positions.split(","))):
        q = torch.randn(R, H, 1, HD, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(R, H, L, HD, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv = torch.ones(R, L, dtype=torch.bool, device="cuda")
        kv[:, :PAD] = False
        p = torch.tensor([pos], device="cuda")
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(kv, p))
        want = sdpa().float()
        ideal = 2 * R * H * (pos + 1 - PAD) * HD * 2 / 4.27e12 * 1e6
        print(f"R={R} pos={pos}: SDPA {time_us(sdpa):.1f} us | ideal {ideal:.1f} us | "
              f"default {config_for(R)}", flush=True)
        rows = []
        for cfg in configs():
            f = lambda: decode_attention(q, k, v, kv, p, config=cfg)
            err = ((f().float() - want).norm() / want.norm()).item()
            rows.append((time_us(f), cfg, err))
        for t, cfg, err in sorted(rows)[:12]:
            print(f"  block {cfg[0]:3d} warps {cfg[1]} merge warps {cfg[2]}: {t:7.1f} us "
                  f"({ideal / t:4.0%} of ideal)  rel err {err:.1e}", flush=True)
        t, cfg, err = next(r for r in rows if r[1] == config_for(R))
        print(f"  default {cfg}: {t:.1f} us; worst rel err over all configs {max(r[2] for r in rows):.1e}", flush=True)


if __name__ == "__main__":
    main()
