"""One GPT-XL block of a one-token step at a few rows: the compiled block (inductor) against
decode_block's fused kernels, with and without programmatic dependent launch, and a sweep of each
kernel's (rows per program, warps) with the others at their default.

    python scripts/bench_decode_block.py [--rows 2,4] [--position 700]

CUDA-graph timed (blocks back to back, as in the captured step), bf16, random weights; prints us per
block and the block's weight bytes over that time. decode_block.CONFIG comes from here.
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from fast_inference import decode_block
from fast_inference.decode_attention import decode_attention
from fast_inference.engine import run_block
from fast_inference.model import ModelArgs, Transformer


def time_us(f):
    f()
    return triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4")
    ap.add_argument("--position", type=int, default=700)
    ap.add_argument("--tilings", default="1,2,4,8", help="rows per program to try")
    args = ap.parse_args()
    args_xl = ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed", n_layer=1)
    with torch.device("cuda"):
        model = Transformer(args_xl).to(torch.bfloat16).eval().requires_grad_(False)
    model.fuse_projections()
    layer, D = model.layers[0], args_xl.dim
    compiled = torch.compile(run_block, fullgraph=True, dynamic=False)
    mb = sum(p.numel() * p.element_size() for p in layer.parameters()) / 1e6
    default = dict(decode_block.CONFIG)
    with torch.no_grad():
        for R in map(int, args.rows.split(",")):
            model.setup_caches(R, 120 + 1024, torch.bfloat16)
            cache = layer.attention.kv_cache
            cache.k_cache.normal_()
            cache.v_cache.normal_()
            key_valid = torch.ones(R, model.max_seq, dtype=torch.bool, device="cuda")
            key_valid[:, :100] = False
            pos = torch.tensor([args.position], device="cuda")
            freqs = model.freqs_cis[pos]
            x = torch.randn(R, 1, D, device="cuda", dtype=torch.bfloat16)
            plain = lambda q, k, v: decode_attention(q, k, v, key_valid, pos)
            want = compiled(layer, x, freqs, plain, pos).float()
            t = time_us(lambda: compiled(layer, x, freqs, plain, pos))
            print(f"rows {R}, position {args.position}: compiled block {t:.1f} us ({mb / t:.2f} TB/s)", flush=True)

            def fused(pdl):
                attend = lambda q, k, v: decode_attention(q, k, v, key_valid, pos, pdl=pdl)
                decode_block.use_pdl = lambda device: pdl
                return lambda: decode_block.decode_block(layer, x, freqs, attend, pos)

            for pdl in (False, True):
                err = ((fused(pdl)().float() - want).norm() / want.norm()).item()
                t = time_us(fused(pdl))
                print(f"  fused, pdl={pdl}, default {default}: {t:.1f} us ({mb / t:.2f} TB/s), rel err vs compiled "
                      f"{err:.1e}", flush=True)
            best = dict(default)
            for name in default:
                times = []
                for bn, warps in itertools.product(map(int, args.tilings.split(",")), (4, 8)):
                    decode_block.CONFIG = dict(best, **{name: (bn, warps)})
                    try:
                        times.append((time_us(fused(True)), (bn, warps)))
                    except Exception as e:  # e.g. out of registers / shared memory
                        print(f"  {name} {(bn, warps)}: failed ({type(e).__name__})", flush=True)
                times.sort()
                best[name] = times[0][1]
                print(f"  {name:8s}: " + ", ".join(f"{c} {t:.1f}" for t, c in times[:5]), flush=True)
            decode_block.CONFIG = best
            t = time_us(fused(True))
            print(f"  fused, pdl, best {best}: {t:.1f} us ({mb / t:.2f} TB/s)", flush=True)
            decode_block.CONFIG = default
        # top-k 2000 of one row: PyTorch picks its single-block or multi-block radix select by width.
        for width in (16384, 20000, 20480, 32768):
            logits = torch.randn(1, width, device="cuda")
            t = time_us(lambda: torch.topk(logits, 2000, dim=-1, sorted=False))
            print(f"top-k 2000 of 1 x {width}: {t:.1f} us", flush=True)


if __name__ == "__main__":
    main()
