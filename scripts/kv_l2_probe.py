"""What keys already in L2 save the decode attention (docs/PERF_NOTES.md, "The next attention's keys in L2").

    python scripts/kv_l2_probe.py [--rows 16,64] [--position 700] [--keys 0,16,32,64,128,256]

The attention alone at GPT-XL shapes (the text as its partial, as the engine runs it), timed with CUDA events after
L2 is flushed (a 256 MB buffer rewritten) and the first KEYS keys and values of each (row, head) after the text
pulled into L2 by the prefetcher's kernel, a GPU sleep between them so that every prefetch has landed. Prints the
median of REPS per arm, the bytes prefetched and what they saved against none, as a rate: the bus's (~4.5 TB/s)
if the attention's time follows its DRAM bytes.
"""
import argparse
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference import decode_attention as da
from fast_inference import prefetch

H, L, HD, T = 20, 1144, 64, 120  # GPT-XL heads, cache length, head size, text prefix
REPS = 25


def timed(attend, table, flush, pos):
    """One run of attend after the flush and the prefetch of `table` (None: nothing), in microseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush.add_(1)
    if table is not None:
        progress = torch.zeros(2, dtype=torch.int32, device="cuda")
        prefetch._prefetch_kernel[(prefetch.PROGRAMS,)](table, progress, pos, table.shape[0], 0, CHUNK=prefetch.CHUNK,
                                                         EVICT_LAST=True, KV_EVICT_LAST=False, num_warps=1)
    torch.cuda._sleep(400_000)  # ~0.2 ms: the prefetches land, and the host queues what follows meanwhile
    start.record()
    attend()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--position", type=int, default=700)
    ap.add_argument("--keys", default="0,16,32,64,128,256")
    args = ap.parse_args()
    flush = torch.zeros(256 << 20, dtype=torch.uint8, device="cuda")
    pos = torch.tensor([args.position], device="cuda")
    for R in map(int, args.rows.split(",")):
        q = torch.randn(R, H, 1, HD, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(R, H, L, HD, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k[:, :, :T] = 0  # RoPE's zero rows (SPEC 2.5)
        valid = torch.ones(R, L, dtype=torch.bool, device="cuda")
        sums, counts = torch.empty(R, H, HD, device="cuda"), torch.empty(R, device="cuda")
        da.text_sums(v, valid, T, sums, counts)
        attend = lambda: da.decode_attention(q, k, v, valid, pos, text=(sums, counts, T))
        want = attend()
        base = None
        cache = types.SimpleNamespace(k_cache=k, v_cache=v, text_len=T)
        key = HD * k.element_size()
        for keys in map(int, args.keys.split(",")):
            prefetch.KV_BYTES = ((None, 2 * R * H * key * keys),)  # keys per (row, head), for K and V
            table = None if keys == 0 else torch.tensor(prefetch.table([(cache, 0)], R), dtype=torch.int64,
                                                        device="cuda")
            us = sorted(timed(attend, table, flush, pos) for _ in range(REPS))[REPS // 2]
            nbytes = 2 * R * H * min(keys, args.position - T) * key
            base = us if base is None else base
            saved = f"{nbytes / max(base - us, 1e-3) / 1e6:.2f} TB/s" if keys else "-"
            print(f"rows {R} position {args.position}: {keys:4d} keys per (row, head) in L2 ({nbytes / 1e6:6.1f} MB): "
                  f"{us:6.1f} us; saved {base - us:5.1f} us, as if at {saved}", flush=True)
        assert torch.equal(attend(), want)


if __name__ == "__main__":
    main()
