"""One GPT-XL block of a one-token step: the compiled block (inductor) against the fused block's
kernels (kernels/block.py, as the plan picks them for this GPU), with and without programmatic dependent launch, and a sweep of each kernel's tiling with
the others at their default: (rows per program, warps) on the GEMV path (<= 4 rows), (rows per program,
K chunk, warps, stages, split-K) on the dot path (more rows; any row count, so where the dot path stops
beating the compiled block shows), PDL as the engine launches them (a pass's rows, past the fused rows: as --pass-pdl).

    python tools/bench_block.py [--rows 2,4,16,32] [--position 700] [--quantize int8] [--pass-pdl late]

CUDA-graph timed (blocks back to back, as in the captured step), bf16, random weights; prints us per
block and the block's weight bytes over that time. block_triton.CONFIG, CONFIG_INT8 and DOT_CONFIG
come from here.
"""
import argparse
import dataclasses
import itertools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from fast_inference import plan
from fast_inference.workload import weight_bytes
from fast_inference.engine import compile_static, run_block
from fast_inference.kernels import block_triton
from fast_inference.kernels.attention_triton import decode_attention
from fast_inference.kernels.block import fused_block
from fast_inference.model import ModelArgs, Transformer
from fast_inference.quantize import MODES as QUANTIZE_MODES, quantize_int8


def time_us(f):
    f()
    return triton.testing.do_bench_cudagraph(f, return_mode="median") * 1e3


def sweep(name, base, tilings, fused, use):
    """(us, tiling) of the block with kernel `name` at each tiling (set as the kernels' table by use(table)), the
    others as in base; sorted."""
    times = []
    for tiling in tilings:
        use(dict(base, **{name: tiling}))
        try:
            times.append((time_us(fused(None)), tiling))  # PDL as the engine launches it
        except Exception as e:  # e.g. out of registers / shared memory
            print(f"  {name} {tiling}: failed ({type(e).__name__})", flush=True)
    return sorted(times)


def block_cuda_builds(kernel, *key):
    from fast_inference.engine import Engine

    return Engine.builds_on(torch.device("cuda", torch.cuda.current_device()), kernel, *key)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="2,4")
    ap.add_argument("--position", type=int, default=700)
    ap.add_argument("--tilings", default="1,2,4,8", help="GEMV path: rows per program to try")
    ap.add_argument("--dot-tilings", default="16x128,16x256,32x128,32x256",
                    help="dot path: rows per program x K chunk to try (4 warps, 3 stages; then warps and stages); "
                         "empty: start from the defaults")
    ap.add_argument("--dot-stages", default="4,6", help="dot path: pipeline stages tried at the best rows and chunk")
    ap.add_argument("--dot-splits", default="2,3,4,5,7",
                    help="dot path: split-K tried last, at the best tiling and at 128-wide K chunks")
    ap.add_argument("--pass-pdl", choices=("off", "late", "first"), default="off", help="past the fused rows, the "
                    "pass's dot projections' PDL mode (the plan override window_block_pdl)")
    ap.add_argument("--quantize", choices=list(QUANTIZE_MODES), default="none", help="int8: the block's weights as int8")
    ap.add_argument("--json", default=None, help="write each row count's best tiling and times here (pass_ab.py "
                    "--dot-tilings reads it)")
    args = ap.parse_args()
    found = {}
    args_xl = ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed", n_layer=1)
    with torch.device("cuda"):
        model = Transformer(args_xl).to(torch.bfloat16).eval().requires_grad_(False)
    model.fuse_projections()
    if args.quantize == "int8":
        quantize_int8(model)
    layer, D = model.layers[0], args_xl.dim
    block_triton.tile_counts(torch.device("cuda", torch.cuda.current_device()))  # as the engine, before tracing
    compiled = compile_static(run_block)
    mb = weight_bytes(layer) / 1e6
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
            plain = lambda q, k, v, freqs, cache: decode_attention(  # as the model's attend for the compiled block
                q.transpose(1, 2), cache.k_cache, cache.v_cache, key_valid, pos,
                fresh=(k.transpose(1, 2), v.transpose(1, 2), freqs))
            want = compiled(layer, x, freqs, plain, pos).float()
            t = compiled_us = time_us(lambda: compiled(layer, x, freqs, plain, pos))
            print(f"rows {R}, position {args.position}: compiled block {t:.1f} us ({mb / t:.2f} TB/s)", flush=True)

            situation = plan.Situation(
                backend="inductor", device="cuda", capability=torch.cuda.get_device_capability(), cfg=False, batch=R,
                dtype=torch.bfloat16, int8=args.quantize == "int8", dim=D, n_head=args_xl.n_head,
                ffn_hidden=args_xl.ffn_hidden, max_seq=model.max_seq,
                builds=lambda kernel, *key: block_cuda_builds(kernel, *key))
            # past the fused rows the steps run the compiled block: time the fused kernels as a pass runs them
            pass_pdl = dict(off=plan.NONE, late=plan.LATE, first=plan.FIRST)[args.pass_pdl]
            planned = plan.make(situation).guided if R <= plan.FUSED_ROWS else plan.pass_rows(R, pass_pdl)

            def fused(pdl):
                """The block with PDL as the plan launches it at R rows (pdl True or None) or without."""
                rows = planned if pdl is not False else dataclasses.replace(
                    planned, attention_pdl=0, projections=tuple((n, dataclasses.replace(p, pdl=0))
                                                                for n, p in planned.projections))
                attend = lambda q, k, v, freqs, cache: decode_attention(
                    q.transpose(1, 2), cache.k_cache, cache.v_cache, key_valid, pos, config=rows.attention_config,
                    pdl=rows.attention_pdl)
                return lambda: fused_block(layer, x, freqs, attend, pos, rows)

            dot = R > plan.GEMV_ROWS
            int8 = args.quantize == "int8"
            table = ("DOT_CONFIG_INT8" if int8 else "DOT_CONFIG") if dot else "CONFIG_INT8" if int8 else "CONFIG"
            key = triton.next_power_of_2(R)
            by_rows = dot and not int8 and R > plan.FUSED_ROWS  # block_triton.DOT_CONFIG_ROWS: these rows' own tilings
            default = dict(block_triton.DOT_CONFIG_ROWS.get(key, block_triton.DOT_CONFIG) if by_rows
                           else getattr(block_triton, table))
            saved = dict(block_triton.DOT_CONFIG_ROWS)

            def use(t):
                if by_rows:
                    block_triton.DOT_CONFIG_ROWS = {**saved, key: t}
                else:
                    setattr(block_triton, table, t)
            for pdl in (False, True):
                err = ((fused(pdl)().float() - want).norm() / want.norm()).item()
                t = time_us(fused(pdl))
                print(f"  fused, pdl={pdl}, default {default}: {t:.1f} us ({mb / t:.2f} TB/s), rel err vs compiled "
                      f"{err:.1e}", flush=True)
            best = dict(default)
            for name in (n for n in default if n != "output"):  # the head is not part of the block
                if dot:
                    first = [(int(a), int(b), 4, 3, 1) for a, b in (c.split("x") for c in args.dot_tilings.split(",")
                                                                     if c)] or [best[name]]
                else:
                    first = list(itertools.product(map(int, args.tilings.split(",")), (4, 8)))
                times = sweep(name, best, first, fused, use)
                if dot and args.dot_tilings:  # then warps and stages around the best rows and chunk
                    bn, bk = times[0][1][:2]
                    more = [(bn, bk, 8, 3, 1)] + [(bn, bk, 4, int(st), 1) for st in args.dot_stages.split(",")]
                    times = sorted(times + sweep(name, best, more, fused, use))
                if dot and args.dot_splits:  # then split-K
                    bn, bk, warps, stages, _ = times[0][1]
                    splits = [(bn, c, warps, stages, int(k)) for k in args.dot_splits.split(",") for c in {bk, 128}]
                    times = sorted(times + sweep(name, best, splits, fused, use))
                best[name] = times[0][1]
                print(f"  {name:8s}: " + ", ".join(f"{c} {t:.1f}" for t, c in times[:5]), flush=True)
            use(best)
            t = time_us(fused(None))
            print(f"  fused, best {best}: {t:.1f} us ({mb / t:.2f} TB/s)", flush=True)
            if by_rows:
                found[key] = dict(best=best, pass_pdl=args.pass_pdl, us=t, compiled_us=compiled_us)
            use(default)
            if args.json:  # after each row count, so that a cut run keeps what it found
                with open(args.json, "w") as f:
                    json.dump({r: dict(v, best={n: list(c) for n, c in v["best"].items()}) for r, v in found.items()},
                              f, indent=1)
        # top-k 2000 of one row: PyTorch picks its single-block or multi-block radix select by width.
        for width in (16384, 20000, 20480, 32768):
            logits = torch.randn(1, width, device="cuda")
            t = time_us(lambda: torch.topk(logits, 2000, dim=-1, sorted=False))
            print(f"top-k 2000 of 1 x {width}: {t:.1f} us", flush=True)


if __name__ == "__main__":
    main()
