"""Weights and cached keys pulled into L2 just ahead of the decode kernels that read them, by a kernel beside
the step.

At up to 16 rows a block's kernels are bound by their chains, not by the bus: at n = 1 a block takes
~26 us for ~11 us of bytes, and the dot path (5-16 rows) walks its weights only after its PDL wait. A
small kernel on a second stream of the captured step pulls each projection's weight into L2 (Hopper's
bulk prefetch, one instruction per 16 KB) as the projection before it starts, so the projection finds
them there. It paces itself by a count that each projection kernel's first program bumps as it starts
(block_triton, `bump`): segment j, the weight of the step's j-th projection (qkv, wo, gate/up, w2 per
block), is fetched once projection j - AHEAD has started. It writes nothing the step reads, resets the
count once every projection has counted, and the step waits for it at its end.

The compiled block (n > 8: inductor's GEMMs are cuBLAS's, which cannot count) is paced by its decode
attention instead, whose merge counts each layer: a layer's wo, gate/up and w2 and the next layer's qkv
are fetched once its keys have streamed (schedule). A speculative pass's window attention counts the same way,
as it starts (the plan's pass_prefetch): its 16 us a layer leave the bus mostly idle. K and V carry L2's
evict-first hint and the weights' prefetches an evict-last policy, so that ~230 MB of keys per layer at
n = 32 do not push the weights out.

The keys and values the next attention reads first go the same way (KV_BYTES per layer, by row count): the decode
attention streams them at the bus's rate, while the projections' chain before it leaves the bus mostly idle,
so bytes fetched during the chain are bytes the attention does not wait for. They are fetched with the next
layer's qkv weight on the fused path, and once the down projection starts in the compiled block (it counts
too where it serves, block_triton.down): the gate/up weight, the largest, is read by then.

It only runs inside the step's CUDA graph: run as it comes, it would spin while the host loads a module
or allocates memory, which may wait for all running kernels (a deadlock). After a step run outside a
capture (the warm-up) the count is put back to zero.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# (docs/PERF_NOTES.md, "Tuning tables' histories": prefetch_triton, "The L2 prefetcher", #34, #35, #46, #54)
PROGRAMS = 12  # prefetching programs, one warp each
CHUNK = 16384  # bytes per bulk prefetch
AHEAD = 1  # segment j is fetched once projection j - AHEAD has started
# Per layer, by row count (the first entry whose bound is >= the rows): the first keys and values of each (row, head)
# after the text, at most (0: none).
KV_BYTES = ((32, 12 << 20), (None, 24 << 20))
KV_AHEAD = 0  # counts earlier than the default for the keys and values (the fused path: projections)
EVICT_LAST = True  # the prefetches with L2's evict-last policy (attention_triton.EVICT_FIRST: K and V go first)
KV_EVICT_LAST = False  # the keys' and values' prefetches with the normal policy: the attention reads them once


def segments(model):
    """The projection weights in the order the fused step's kernels start: qkv, wo, gate/up, w2 per block."""
    return [w for layer in model.layers for w in (layer.attention.wqkv.weight, layer.attention.wo.weight,
                                                  layer.feed_forward.w13, layer.feed_forward.w2.weight)]


def schedule(model, compiled, down=False, kv=False):
    """(segment, count it waits for) in fetch order, a segment being a weight or a layer's KVCache (kv: its first
    keys and values, for the attention that reads them next). The fused block counts each projection as it
    starts: weight j once projection j - AHEAD has, a layer's keys with its qkv. The compiled block counts each
    layer's decode attention (its merge), and with `down` the down projection too: the first qkv at once, then a
    layer's wo, gate/up and w2 and the next layer's qkv once its attention has counted, the next layer's keys once
    its down projection has (without it, none)."""
    layers = model.layers
    if not compiled:
        plan = []
        for j, w in enumerate(segments(model)):
            plan.append((w, max(0, j - AHEAD + 1)))
            if kv and j % 4 == 0:  # a layer's qkv: its keys with it
                plan.append((layers[j // 4].attention.kv_cache, max(0, j - AHEAD + 1 - KV_AHEAD)))
        return plan
    per = counts_per_layer(compiled, down)
    plan = [(layers[0].attention.wqkv.weight, 0)] + ([(layers[0].attention.kv_cache, 0)] if kv and down else [])
    for i, layer in enumerate(layers):
        ff = layer.feed_forward
        merged = per * i + 1
        plan += [(w, merged) for w in (layer.attention.wo.weight, ff.w13, ff.w2.weight)]
        if i + 1 < len(layers):
            plan.append((layers[i + 1].attention.wqkv.weight, merged))
            if kv and down:
                plan.append((layers[i + 1].attention.kv_cache, max(merged, per * i + 2 - KV_AHEAD)))
    return plan


def counts_per_layer(compiled, down):
    """The counts a layer's kernels make: the fused block's 4 projections; the compiled block's attention (its
    merge), and its down projection where `down` serves."""
    return 2 if compiled and down else 1 if compiled else 4


def table(plan, rows):
    """A plan (schedule) as the prefetching kernel's SEGS rows for steps over `rows` rows: address, bytes, the count
    it waits for, stride, ranges, bytes per key, first key; a cache's keys from its text's end on (kv_rows)."""
    out = []
    for seg, wait in plan:
        if isinstance(seg, torch.Tensor):
            out.append([seg.data_ptr(), seg.numel() * seg.element_size(), wait, 0, 1, 0, 0])
        else:
            out += [[base, size, wait, stride, ranges, key, first]
                    for base, size, stride, ranges, key, first in kv_rows(seg, rows, seg.text[2] if seg.text else 0)]
    return out


def kv_bytes(rows):
    """KV_BYTES' budget for steps over `rows` rows."""
    return next(nbytes for bound, nbytes in KV_BYTES if bound is None or rows <= bound)


def kv_rows(cache, rows, first):
    """The prefetcher's table rows of a cache's keys and values for steps over `rows` rows: (address, most bytes,
    stride, ranges, bytes per key, first key) for K and for V, each (row, head)'s keys from `first` on a range of
    its own, the same number of keys in each (kv_bytes(rows) over them all); none if that is no key."""
    k, v = cache.k_cache, cache.v_cache
    R, H, L, hd = k.shape
    key = hd * k.element_size()
    assert k.stride(0) == H * k.stride(1) and k.stride(2) == hd and v.stride() == k.stride()
    keys = min(kv_bytes(rows) // (2 * rows * H * key), L - first)
    if keys <= 0:
        return []
    return [(t.data_ptr() + first * key, keys * key, t.stride(1) * t.element_size(), rows * H, key, first)
            for t in (k, v)]


def run_beside(prefetcher, rows, fn):
    """fn() with a prefetcher (or None) of steps over `rows` rows beside it: started before and joined after inside a
    capture; after a run outside one (a warm-up) its count is put back, as the counting kernels count either way."""
    fetching = prefetcher is not None and prefetcher.start(rows)
    fn()
    if fetching:
        prefetcher.join()
    elif prefetcher is not None:
        prefetcher.reset()


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
    def _fetch(base, nbytes, stride, ranges, lane, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr):
        """Ranges base + i * stride, i < ranges, of nbytes each, in CHUNK pieces: this program's lanes take a
        piece each, the programs in turn."""
        pieces = (nbytes + CHUNK - 1) // CHUNK
        per = tl.maximum(pieces, 1)  # (no piece at all: the loop does not run)
        for i0 in range(tl.program_id(0).to(tl.int64) * 32, ranges * pieces, tl.num_programs(0) * 32):
            i = i0 + lane
            off = i % per * CHUNK
            size = tl.where(i < ranges * pieces, tl.minimum(nbytes - off, CHUNK), 0) // 16 * 16
            _l2_prefetch(base + i // per * stride + off, size.to(tl.int32), EVICT_LAST)

    @triton.jit
    def _prefetch_kernel(SEGS, PROGRESS, POS, n_segs, total, CHUNK: tl.constexpr, EVICT_LAST: tl.constexpr,
                         KV_EVICT_LAST: tl.constexpr):
        """SEGS (n_segs, 7) int64, in fetch order: address, bytes, the count it waits for, stride, ranges (a weight:
        0 and 1), bytes per key (0: a weight), first key. A cache's ranges stop at the step's position
        POS (keys past it are not written yet). PROGRESS[0]: kernels counted (total per step); PROGRESS[1]:
        prefetching programs done (both left at zero)."""
        lane = tl.arange(0, 32).to(tl.int64)
        pos = tl.load(POS)  # the step's: the previous step's draw advanced it before this one began
        for j in range(n_segs):
            base = tl.load(SEGS + 7 * j)
            nbytes = tl.load(SEGS + 7 * j + 1)
            wait = tl.load(SEGS + 7 * j + 2).to(tl.int32)
            stride = tl.load(SEGS + 7 * j + 3)
            ranges = tl.load(SEGS + 7 * j + 4)
            key = tl.load(SEGS + 7 * j + 5)
            first = tl.load(SEGS + 7 * j + 6)
            while tl.load(PROGRESS, volatile=True) < wait:
                pass
            if key > 0:
                _fetch(base, tl.minimum(nbytes, tl.maximum(pos - first, 0) * key), stride, ranges, lane, CHUNK,
                       KV_EVICT_LAST)
            else:
                _fetch(base, nbytes, stride, ranges, lane, CHUNK, EVICT_LAST)
        if tl.atomic_add(PROGRESS + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            while tl.load(PROGRESS, volatile=True) < total:  # every kernel counted: none lands after the reset
                pass
            tl.store(PROGRESS, 0)
            tl.store(PROGRESS + 1, 0)


class Prefetcher:
    """The L2 prefetch of one model's projection weights and cached keys beside its captured decode steps;
    compiled: paced by the compiled block's decode attention (and down projection), else by the fused block's
    projections. `prepare` makes the plan of each row count the steps run at, once the caches exist."""

    def __init__(self, model, compiled=False):
        self.model, self.compiled = model, compiled
        device = model.output.weight.device
        self.plans = {}  # rows -> (SEGS, counts per step)
        self.progress = torch.zeros(2, dtype=torch.int32, device=device)
        self.stream = torch.cuda.Stream(device)
        # Loaded now, with nothing to wait for, rather than first launched inside a capture
        segs = torch.zeros(1, 7, dtype=torch.int64, device=device)
        _prefetch_kernel[(1,)](segs, self.progress, segs, 0, 0, CHUNK=CHUNK, EVICT_LAST=EVICT_LAST,
                               KV_EVICT_LAST=KV_EVICT_LAST, num_warps=1)
        torch.cuda.synchronize(device)

    def prepare(self, rows, input_pos, down=False):
        """The plan of steps over `rows` rows at input_pos (the caches set up); down: the compiled block's down
        projection counts at these rows (block_triton.down). Before the steps' capture (a host copy)."""
        self.pos = input_pos
        segs = table(schedule(self.model, self.compiled, down, kv=kv_bytes(rows) > 0), rows)
        total = counts_per_layer(self.compiled, down) * len(self.model.layers)
        self.plans[rows] = torch.tensor(segs, dtype=torch.int64, device=input_pos.device), total

    def start(self, rows):
        """Inside a capture: launch the prefetcher of steps over `rows` rows on its stream, after what the current
        stream has queued, and return True (then `join` it at the step's end). Outside one: nothing, False (then
        `reset`)."""
        if not torch.cuda.is_current_stream_capturing():
            return False
        segs, total = self.plans[rows]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            _prefetch_kernel[(PROGRAMS,)](segs, self.progress, self.pos, segs.shape[0], total, CHUNK=CHUNK,
                                          EVICT_LAST=EVICT_LAST, KV_EVICT_LAST=KV_EVICT_LAST, num_warps=1)
        return True

    def join(self):
        """The current stream waits for the prefetcher."""
        torch.cuda.current_stream().wait_stream(self.stream)

    def reset(self):
        """The count back to zero after a step run outside a capture (the capture's warm-up)."""
        self.progress.zero_()
