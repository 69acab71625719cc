"""Time the split-KV decode kernel (keys per program) against SDPA, GPT-XL shapes.

    python scripts/bench_decode_attention.py
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from fast_inference.decode_attention import decode_attention
from fast_inference.model import attention_mask


def main():
    for R, pos in [(2, 700), (64, 700)]:
        H, L, hd = 20, 1144, 64
        q = torch.randn(R, H, 1, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(R, H, L, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        kv = torch.ones(R, L, dtype=torch.bool, device="cuda")
        kv[:, :100] = False
        p = torch.tensor([pos], device="cuda")
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(kv, p))
        ideal = 2 * R * H * (pos + 1) * hd * 2 / 4.27e12 * 1e6
        t = triton.testing.do_bench_cudagraph(lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask(kv, p)), return_mode="median") * 1e3
        print(f"R={R} pos={pos}: SDPA {t:.1f} us | ideal {ideal:.1f} us", flush=True)
        for block in (32, 64, 128, 256):
            f = lambda: decode_attention(q, k, v, kv, p, block=block)
            err = ((f().float() - want.float()).norm() / want.float().norm()).item()
            t = triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3
            print(f"  block {block:3d}: {t:7.1f} us  rel err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
