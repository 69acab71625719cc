"""Sweep the split-KV decode kernel's (BLOCK, num_warps, merge num_warps) against SDPA at GPT-XL shapes.

    python tools/bench_attention.py [--rows 2,16,64] [--positions 300,700,1100]
    python tools/bench_attention.py --window 16,48 [--rows 2,16] [--positions 700] [--default-only]

Prints, per (rows, position), SDPA over the whole cache, the ideal (the K/V bytes of the keys the
kernel reads, from the first attendable one to the position, at 4.27 TB/s) and every config, best
first; the table (CONFIGS) in fast_inference/kernels/attention_triton.py comes from here.
With --window L: the window attention of a speculative pass instead (L queries per row, a chain's mask, the text
as its partial, the fold form): its tile, warps and splits over the cache (window_tiles' choice by
WINDOW_PROGRAMS, or a fixed count) against the default window_config, each config's output against the default's;
--default-only: the default alone (an A/B of two checkouts' kernels, tools/gpu_session.sh passab).
"""
import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from fast_inference.kernels.attention_triton import (chain_masks, config_for, decode_attention, text_sums, window_attention,
                                                     window_config)
from fast_inference.model import attention_mask

H, L, HD = 20, 1144, 64  # GPT-XL heads, 120 text + 1024 image positions, head size
PAD = 100  # leading text keys that are padding (skipped by the kernel), as in bench.py
TEXT = 20  # the text's other keys (the window form reads them as one partial)


def configs():
    yield from itertools.product((32, 64, 128, 256), (2, 4, 8), (1, 4))


def window_configs():
    """(BLOCK, warps, merge warps), splits (None: window_tiles' choice)."""
    for block, warps, splits in itertools.product((16, 32, 64, 128), (2, 4, 8), (None, 1, 2, 4, 8, 16)):
        yield (block, warps, 4), splits


def time_us(f):
    return triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,16,64")
    ap.add_argument("--positions", default="700")
    ap.add_argument("--window", default=None, help="comma-separated L: sweep the window attention instead")
    ap.add_argument("--default-only", action="store_true", help="with --window: time the default config alone")
    args = ap.parse_args()
    if args.window:
        for R, W, pos in itertools.product(*(map(int, a.split(",")) for a in (args.rows, args.window, args.positions))):
            sweep_window(R, W, pos, args.default_only)
        return
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


def sweep_window(R, W, pos, default_only=False):
    """R rows of a pass (both CFG halves) with W queries each at positions pos .. pos + W - 1 (their keys in the
    cache): the fold form's configs, best first."""
    k = torch.randn(R, H, L, HD, device="cuda", dtype=torch.bfloat16)
    k[:, :, :PAD + TEXT] = 0  # the text's keys are zero (SPEC 2.5): the text partial stands for them
    v = torch.randn_like(k)
    q = torch.randn(R, H, W, HD, device="cuda", dtype=torch.bfloat16)
    kv = torch.ones(R, L, dtype=torch.bool, device="cuda")
    kv[:, :PAD] = False
    sums = torch.empty(R, H, HD, device="cuda", dtype=torch.float32)
    counts = torch.empty(R, device="cuda", dtype=torch.float32)
    text_sums(v, kv, PAD + TEXT, sums, counts)
    seqlens = torch.full((R,), pos, device="cuda", dtype=torch.int64)
    masks = chain_masks(W, "cuda")[None].expand(R, W)
    run = lambda cfg=None, splits=None: window_attention(q, k, v, kv, seqlens, masks, text=(sums, counts, PAD + TEXT),
                                                         config=cfg, splits=splits)
    want = run().float()
    ideal = 2 * R * H * (pos + W - PAD - TEXT) * HD * 2 / 4.27e12 * 1e6
    default = window_config(q.dtype, HD, max(16, triton.next_power_of_2(W)))
    print(f"R={R} L={W} pos={pos}: ideal {ideal:.1f} us | default {default}, window_tiles' splits", flush=True)
    rows = []
    for cfg, splits in [(default, None)] if default_only else window_configs():
        try:
            f = lambda: run(cfg, splits)
            err = ((f().float() - want).norm() / want.norm()).item()
            rows.append((time_us(f), cfg, splits, err))
        except Exception as e:  # noqa: BLE001 (a tile too large for the SM's memory: the sweep goes on)
            print(f"  block {cfg[0]} warps {cfg[1]} splits {splits}: {type(e).__name__}", flush=True)
    for t, cfg, splits, err in sorted(rows, key=lambda r: r[0])[:12]:
        print(f"  block {cfg[0]:3d} warps {cfg[1]} splits {splits or 'default':>7}: {t:7.1f} us "
              f"({ideal / t:4.0%} of ideal)  rel err {err:.1e}", flush=True)
    t = next(r[0] for r in rows if r[1] == default and r[2] is None)
    print(f"  default: {t:.1f} us; worst rel err over all configs {max(r[3] for r in rows):.1e}", flush=True)


if __name__ == "__main__":
    main()
