"""Weights pulled into L2 just ahead of the decode kernels that read them, by a kernel beside the step.

At up to 16 rows a block's kernels are bound by their chains, not by the bus: at n = 1 a block takes
~26 us for ~11 us of bytes, and the dot path (5-16 rows) walks its weights only after its PDL wait. A
small kernel on a second stream of the captured step pulls each projection's weight into L2 (Hopper's
bulk prefetch, one instruction per 16 KB) as the projection before it starts, so the projection finds
them there. It paces itself by a count that each projection kernel's first program bumps as it starts
(decode_block, `bump`): segment j, the weight of the step's j-th projection (qkv, wo, gate/up, w2 per
block), is fetched once projection j - AHEAD has started. It writes nothing the step reads, resets the
count once every projection has counted, and the step waits for it at its end.

The compiled block (n > 8: inductor's GEMMs are cuBLAS's, which cannot count) is paced by its decode
attention instead, whose merge counts each layer: a layer's wo, gate/up and w2 and the next layer's qkv
are fetched once its keys have streamed (schedule). K and V carry L2's evict-first hint and the
prefetches an evict-last policy, so that ~230 MB of keys per layer at n = 32 do not push the weights out.

It only runs inside the step's CUDA graph: run as it comes, it would spin while the host loads a module
or allocates memory, which may wait for all running kernels (a deadlock). After a step run outside a
capture (the warm-up) the count is put back to zero.
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


EVICT_LAST = True  # the prefetches with L2's evict-last policy (decode_attention.EVICT_FIRST: K and V go first)


def segments(model):
    """The projection weights in the order the fused step's kernels start: qkv, wo, gate/up, w2 per block."""
    return [w for layer in model.layers for w in (layer.attention.wqkv.weight, layer.attention.wo.weight,
                                                  layer.feed_forward.w13, layer.feed_forward.w2.weight)]


def schedule(model, compiled):
    """(weight, count it waits for) in fetch order. The fused block counts each projection as it starts:
    weight j once projection j - AHEAD has. The compiled block counts each layer's decode attention
    (its merge): the first qkv at once, then a layer's wo, gate/up and w2 and the next layer's qkv once its
    attention has counted."""
    if not compiled:
        return [(w, max(0, j - AHEAD + 1)) for j, w in enumerate(segments(model))]
    layers = model.layers
    plan = [(layers[0].attention.wqkv.weight, 0)]
    for i, layer in enumerate(layers):
        ff = layer.feed_forward
        plan += [(w, i + 1) for w in (layer.attention.wo.weight, ff.w13, ff.w2.weight)]
        if i + 1 < len(layers):
            plan.append((layers[i + 1].attention.wqkv.weight, i + 1))
    return plan


if triton is not None:

    @triton.jit
    def _l2_prefetch(addr, size, EVICT_LAST: tl.constexpr):
        """A bulk prefetch into L2 of `size` bytes (a multiple of 16) at addr, per element; none where size is 0."""
        if EVICT_LAST:
            return tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 pol; setp.ne.s32 p, $2, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
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
    def _prefetch_kernel(SEGS, PROGRESS, n_segs, total, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
        """SEGS (n_segs, 3) int64: each weight's address, bytes and the count it waits for, in fetch order.
        PROGRESS[0]: kernels counted (total per step); PROGRESS[1]: prefetching programs done (both left at zero)."""
        lane = tl.arange(0, 32).to(tl.int64)
        pid, programs = tl.program_id(0), tl.num_programs(0)
        for j in range(n_segs):
            base = tl.load(SEGS + 3 * j)
            nbytes = tl.load(SEGS + 3 * j + 1)
            wait = tl.load(SEGS + 3 * j + 2).to(tl.int32)
            while tl.load(PROGRESS, volatile=True) < wait:
                pass
            for c0 in range(pid * 32 * CHUNK, nbytes, programs * 32 * CHUNK):  # a chunk per lane
                off = c0 + lane * CHUNK
                size = tl.maximum(tl.minimum(nbytes - off, CHUNK), 0) // 16 * 16
                _l2_prefetch(base + off, size.to(tl.int32), EVICT_LAST)
        if tl.atomic_add(PROGRESS + 1, 1, sem="acq_rel", scope="gpu") == programs - 1:
            while tl.load(PROGRESS, volatile=True) < total:  # every kernel counted: none lands after the reset
                pass
            tl.store(PROGRESS, 0)
            tl.store(PROGRESS + 1, 0)


class Prefetcher:
    """The L2 prefetch of one model's projection weights beside its captured decode steps; compiled: paced by
    the compiled block's decode attention, else by the fused block's projections."""

    def __init__(self, model, compiled=False):
        device = model.output.weight.device
        plan = schedule(model, compiled)
        self.segs = torch.tensor([[w.data_ptr(), w.numel() * w.element_size(), wait] for w, wait in plan],
                                 dtype=torch.int64, device=device)
        self.total = len(model.layers) * (1 if compiled else 4)  # counts per step
        self.progress = torch.zeros(2, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device)
        # Loaded now, with nothing to wait for, rather than first launched inside a capture
        _prefetch_kernel[(1,)](self.segs, self.progress, 0, 0, CHUNK=CHUNK, EVICT_LAST=EVICT_LAST, num_warps=1)
        torch.cuda.synchronize(device)

    def start(self):
        """Inside a capture: launch the prefetcher on its stream, after what the current stream has queued, and
        return True (then `join` it at the step's end). Outside one: nothing, False (then `reset`)."""
        if not torch.cuda.is_current_stream_capturing():
            return False
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            _prefetch_kernel[(PROGRAMS,)](self.segs, self.progress, self.segs.shape[0], self.total, CHUNK=CHUNK,
                                          EVICT_LAST=EVICT_LAST, num_warps=1)
        return True

    def join(self):
        """The current stream waits for the prefetcher."""
        torch.cuda.current_stream().wait_stream(self.stream)

    def reset(self):
        """The count back to zero after a step run without the prefetcher (the capture's warm-up)."""
        self.progress.zero_()
