"""The decode attention's config tables against each other in the model: one process, the tables
alternating twice, decode ms/step of the second of two 1,024-token images each time (GPT-XL bf16, random
weights, default engine, cfg 4, top-k 2000, the same seed), and whether the tokens equal the first arm's.

    python scripts/attention_ab.py --batch-sizes 8,32 "all=128x4x4" "4=128x4x4,16=64x2x1,all=128x2x1"

A table is `bound=BLOCKxWARPSxMERGE_WARPS,...` (rows <= bound; `all` for the rest), as CONFIGS in
fast_inference/decode_attention.py; with none given, 4 / 1 merge warps past 4 rows against the
current table. Arms in one process see the same CUDA-graph history (PERF_NOTES, "Inductor's PDL and a
second capture"); bench.py gives the figures to quote. One CUDA GPU.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference import decode_attention as da
from fast_inference.bench import inputs
from fast_inference.engine import Engine
from fast_inference.model import ModelArgs, Transformer


def parse_table(text):
    """'4=128x4x4,all=128x2x1' -> ((4, (128, 4, 4)), (None, (128, 2, 1)))."""
    want = f"{text!r}: want bound=BLOCKxWARPSxMERGE_WARPS entries, the last one all=..."
    try:
        table = []
        for entry in text.split(","):
            bound, config = entry.split("=")
            table.append((None if bound == "all" else int(bound), tuple(int(v) for v in config.split("x"))))
    except ValueError:
        raise ValueError(want) from None
    if table[-1][0] is not None or any(len(config) != 3 for _, config in table):
        raise ValueError(want)
    return tuple(table)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="*", help="config tables to compare (default: the merge with 4 warps, the current)")
    ap.add_argument("--batch-sizes", default="8,32")
    args = ap.parse_args()
    try:
        tables = [parse_table(t) for t in args.tables] or [
            tuple((bound, (block, warps, 4)) for bound, (block, warps, _) in da.CONFIGS), da.CONFIGS]
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("attention_ab.py needs a CUDA GPU (the decode attention is a Triton kernel)")
    with torch.device("cuda"):
        model = Transformer(ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed"))
    model = model.to(torch.bfloat16).eval().requires_grad_(False)
    with torch.no_grad():
        for B in map(int, args.batch_sizes.split(",")):
            cond, mask, condition = inputs(model, B, 512, "cuda")
            first = None
            for table in tables * 2:
                da.CONFIGS = table
                torch._dynamo.reset()  # the compiled block read the table when it was traced
                model.clear_caches()
                engine = Engine(model)
                for _ in range(2):
                    torch.manual_seed(0)
                    tokens = engine.generate(cond, 1024, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=2000)
                first = tokens if first is None else first
                ms = engine.last_timings["decode"] / 1023 * 1e3
                print(f"n = {B}, {table}: decode {ms:.3f} ms/step ({B * 1000 / ms:,.0f} tok/s), tokens as the first "
                      f"arm's: {bool(first.equal(tokens))}", flush=True)


if __name__ == "__main__":
    main()
