"""A draft tree's pass (draft_tree.py) in fewer launches: two Triton kernels for its many small torch ops (issue 78).

  - `compact`: the kept path's keys and values to their positions' slots, every layer's keys and values in one launch
    (draft_tree.compact: an index and an index_put per layer's keys and per its values). The caches stay apart (views
    of one tensor would alias in the compiled block's inputs); the kernel reads their addresses from a table
    (cache_table), made once per runner, whose graphs are bound to these caches. In place: slot start + d takes
    start + line[d], and line[d] is d (not moved) or a branch node's slot, at or past L (draft_tree.links asserts
    it), so no slot moved from is one moved to.
  - `position_uniforms`: speculative.position_noise's uniforms, ((key >> 9) + 0.5) * 2**-23 of position_keys (the
    verify's hash, verify_triton._keys), exact in float32; torch takes their logs, so the noise is torch's bits.
"""
import torch

try:
    import triton
    import triton.language as tl

    from fast_inference.kernels.verify_triton import _keys
except ImportError:
    triton = None

NOISE_BLOCK = 1024  # tokens per program of position_uniforms: (images x L) rows alone are too few programs


if triton is not None:

    @triton.jit
    def _compact_kernel(TABLE, FIRST, START, LINE, COUNT, images, L, s_row, s_head, s_slot, H, HD,
                        HP: tl.constexpr, HDP: tl.constexpr):
        r = tl.program_id(0) // L  # cache row r (image r % images: the CFG halves after the images), slot d
        d = tl.program_id(0) % L
        b = r % images
        src = tl.load(LINE + b * L + d)
        if (d < tl.load(COUNT + b)) & (src != d):  # a kept branch node's slot; the others stay where they are
            cache = tl.load(TABLE + tl.program_id(1)).to(tl.pointer_type(FIRST.dtype.element_ty))
            h = tl.arange(0, HP)[:, None]
            e = tl.arange(0, HDP)[None, :]
            ok = (h < H) & (e < HD)
            at = cache + r.to(tl.int64) * s_row + h * s_head + e
            start = tl.load(START + r)
            tl.store(at + (start + d) * s_slot, tl.load(at + (start + src) * s_slot, mask=ok), mask=ok)

    @triton.jit
    def _uniforms_kernel(OUT, SEED, POS, V, L, BLOCK: tl.constexpr):
        r = tl.program_id(0)  # image r // L, window slot r % L
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        key = _keys(tl.load(SEED).to(tl.uint32), r // L, tl.load(POS + r), tokens)
        u = ((key >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23: exact
        tl.store(OUT + r * V + tokens, u, mask=tokens < V)


def cache_table(caches):
    """The device addresses of each layer's keys and values (2 x layers,) int64, for compact; the caches alike."""
    first = caches[0].k_cache
    tensors = [t for cache in caches for t in (cache.k_cache, cache.v_cache)]
    assert all(t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype for t in tensors)
    assert first.stride(-1) == 1
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=first.device)


def compact(caches, start, line, count, table):
    """draft_tree.compact in one launch: slot start + d of each cache row takes start + line[:, d] for d < count
    (line (images, L), count (images,); start (rows,)); table: cache_table(caches)."""
    first = caches[0].k_cache
    rows, H, _, HD = first.shape
    images, L = line.shape
    assert table.numel() == 2 * len(caches) and start.shape == (start.shape[0],) and start.shape[0] % images == 0
    assert line.is_contiguous() and count.is_contiguous() and start.is_contiguous()
    _compact_kernel[(start.shape[0] * L, table.numel())](
        table, first, start, line, count, images, L, first.stride(0), first.stride(1), first.stride(2), H, HD,
        HP=triton.next_power_of_2(H), HDP=triton.next_power_of_2(HD))


def position_uniforms(seed, positions, out):
    """position_noise's uniforms into out (images, L, V) float32: ((position_keys >> 9) + 0.5) * 2**-23, the same
    bits (seed (), positions (images, L))."""
    B, L, V = out.shape
    assert out.dtype == torch.float32 and out.is_contiguous() and positions.shape == (B, L)
    _uniforms_kernel[(B * L, triton.cdiv(V, NOISE_BLOCK))](out, seed, positions.contiguous(), V, L, BLOCK=NOISE_BLOCK)
    return out
