"""Weights pulled into L2 just ahead of the fused decode kernels that read them, by a kernel beside the step.

At up to 16 rows a block's kernels are bound by their chains, not by the bus: at n = 1 a block takes
~26 us for ~11 us of bytes, and the dot path (5-16 rows) walks its weights only after its PDL wait. A
small kernel on a second stream of the captured step pulls each projection's weight into L2 (Hopper's
bulk prefetch, one instruction per 16 KB) as the projection before it starts, so the projection finds
them there. It paces itself by a count that each projection kernel's first program bumps as it starts
(decode_block, `bump`): segment j, the weight of the step's j-th projection (qkv, wo, gate/up, w2 per
block), is fetched once projection j - AHEAD has started. It writes nothing the step reads, resets the
count once every projection has counted, and the step waits for it at its end.

It only runs inside the step's CUDA graph: run as it comes, it would spin while the host loads a module
or allocates memory, which may wait for all running kernels (a deadlock). Steps run outside a capture
(the warm-up) count into a scratch count instead.
"""
import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# H200, GPT-XL, `python scripts/engine_ab.py --batch-sizes 1,8`, ms/step at n = 1 / 8 (docs/PERF_NOTES.md, "The
# L2 prefetcher"): none 1.044 / 1.689; 12 programs 1.027 / 1.604 (8: 1.09 / 1.637, 16: 1.032 / 1.648, 24: 1.047 at
# n = 1, 32: 1.06 / 1.88); AHEAD 0, 2 and 4 lost (further ahead, the prefetches compete with the running kernels);
# 8 KB chunks no better, 64 KB slower; fetching the head's weight too gained nothing.
PROGRAMS = 12  # prefetching programs, one warp each
CHUNK = 16384  # bytes per bulk prefetch
AHEAD = 1  # segment j is fetched once projection j - AHEAD has started


@functools.lru_cache
def available(device):
    """Bulk L2 prefetch exists from sm_90 on; not in Triton's interpreter."""
    return (triton is not None and torch.device(device).type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def segments(model):
    """The projection weights in the order the fused step's kernels start: qkv, wo, gate/up, w2 per block."""
    return [w for layer in model.layers for w in (layer.attention.wqkv.weight, layer.attention.wo.weight,
                                                  layer.feed_forward.w13, layer.feed_forward.w2.weight)]


if triton is not None:

    @triton.jit
    def _l2_prefetch(addr, size):
        """A bulk prefetch into L2 of `size` bytes (a multiple of 16) at addr, per element; none where size is 0."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def bump(PROGRESS, BUMP: tl.constexpr):
        """A kernel's start, counted by its first program (relaxed: the prefetcher only paces itself by it)."""
        if BUMP:
            if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
                tl.atomic_add(PROGRESS, 1, sem="relaxed", scope="gpu")

    @triton.jit
    def _prefetch_kernel(SEGS, PROGRESS, n_segs, CHUNK: tl.constexpr, AHEAD: tl.constexpr):
        """SEGS (n_segs, 2) int64: each weight's address and bytes, in the step's order. PROGRESS[0]: kernels
        started; PROGRESS[1]: prefetching programs done (both left at zero)."""
        lane = tl.arange(0, 32).to(tl.int64)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        for j in range(n_segs):
            while tl.load(PROGRESS, volatile=True) <= j - AHEAD:
                pass
            base = tl.load(SEGS + 2 * j)
            nbytes = tl.load(SEGS + 2 * j + 1)
            for c0 in range(pid * 32 * CHUNK, nbytes, programs * 32 * CHUNK):  # a chunk per lane
                off = c0 + lane * CHUNK
                size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0) // 16 * 16
                _l2_prefetch(base + off, size.to(tl.int32))
        if tl.atomic_add(PROGRESS + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
            while tl.load(PROGRESS, volatile=True) < n_segs:  # every kernel counted: none lands after the reset
                pass
            tl.store(PROGRESS, 0)
            tl.store(PROGRESS + 1, 0)


class Prefetcher:
    """The L2 prefetch of one model's projection weights beside its captured decode steps."""

    def __init__(self, model):
        device = model.output.weight.device
        self.segs = torch.tensor([[w.data_ptr(), w.numel() * w.element_size()] for w in segments(model)],
                                 dtype=torch.int64, device=device)
        self.progress = torch.zeros(2, dtype=torch.int32, device=device)
        self.scratch = torch.zeros(1, dtype=torch.int32, device=device)  # counted outside a capture, never read
        self.stream = torch.cuda.Stream(device)
        # Loaded now, with nothing to wait for, rather than first launched inside a capture
        _prefetch_kernel[(1,)](self.segs, self.progress, 0, CHUNK=CHUNK, AHEAD=AHEAD, num_warps=1)
        torch.cuda.synchronize(device)

    def count(self):
        """The count the step's projection kernels bump: the prefetcher's inside a capture, else the scratch one."""
        return self.progress if torch.cuda.is_current_stream_capturing() else self.scratch

    def start(self):
        """Inside a capture: launch the prefetcher on its stream, after what the current stream has queued, and
        return True (then `join` it at the step's end). Outside one: nothing, False."""
        if not torch.cuda.is_current_stream_capturing():
            return False
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            _prefetch_kernel[(PROGRAMS,)](self.segs, self.progress, self.segs.shape[0], CHUNK=CHUNK, AHEAD=AHEAD,
                                          num_warps=1)
        return True

    def join(self):
        """The current stream waits for the prefetcher."""
        torch.cuda.current_stream().wait_stream(self.stream)
