"""Decode attention that reads only the filled part of the KV cache (split-KV, Triton).

The static cache is sized for the whole image, but at step p only keys 0..p exist. SDPA over the
static cache reads all of it every step; here each program takes one tile of BLOCK keys of one
(row, head), and a tile that starts past p reads nothing, so the bytes per step follow the filled
length. Tiles start at a row's first attendable key: a caption shorter than the text prefix is
left-padded (the padding keys are masked for every image position), so its padding is skipped too.
A program writes a partial result (max, sum, weighted values); a second kernel merges the
partials of each (row, head) and writes the output in the layout the output projection reads. A tile
past p writes a partial that weighs nothing, so the merge needs neither the position nor the padding:
it loads the partials right after its wait.
Same function as SDPA with the mask rule of model.attention_mask: query p sees key q iff q == p or
(q <= p and key_valid[q]).
With pdl (programmatic dependent launch, between the fused block's kernels) a program loads the keys and values
of earlier steps before it waits for the kernel that wrote the current one.
With fresh=(k, v, freqs) (the compiled block) q and the step's key come before RoPE: every program
rotates q, and the program whose tile holds the position rotates the key and writes it and the value
into the caches, which saves the compiled block its RoPE and cache-write kernels.
With text=(sums, counts, T) the first T keys are the text prefix's, which RoPE's zero rows make zero
vectors (SPEC 2.5): every query scores exactly 0 against each attendable one, so their values' sum and
their count (text_sums, made once after the prefill) are one more partial, of max 0, and the tiles
start at T. The text's keys and values are then not read at every step, nor the mask.
With whole (the plan's WHOLE_ROWS: enough (row, head)s to fill the GPU with one program each, and not so many that
it measured slower) that program (_whole_kernel) walks all of its keys a tile at a time with an online softmax,
starting from the text's partial, and writes the output itself; no partials, no merge kernel.
"""
import torch

from fast_inference.kernels.pdl import launch

try:
    import triton
    import triton.language as tl

    from fast_inference.kernels.pdl import pdl_trigger, pdl_wait
    from fast_inference.kernels.prefetch_triton import bump
except ImportError:  # the cudagraph/eager backends work without Triton
    triton = None

# (BLOCK, num_warps, the merge's num_warps) of the split form by row count: the first entry whose bound is >= the rows
# (docs/PERF_NOTES.md, "Tuning tables' histories": attention_triton)
CONFIGS = ((4, (128, 4, 1)), (16, (64, 2, 1)), (None, (128, 2, 1)))
LEAD = 128  # leading keys searched for the first attendable one (the t2i text prefix is 120)
EVICT_FIRST = True  # K and V are read once per step: L2's evict-first hint keeps a prefetcher's weights (#34)
WHOLE = (64, 1, 1)  # the whole form's (BLOCK, num_warps, num_stages): one program per (row, head) (#48, #54)

if triton is not None:

    @triton.jit
    def _partial_kernel(Q, K, V, KEY_VALID, POS, M_OUT, L_OUT, ACC_OUT, K_NEW, V_NEW, FREQS,
                        stride_qr, stride_qh, stride_kr, stride_kh, stride_kn, stride_vr, stride_vh, stride_vn,
                        stride_valid, stride_nr, stride_nh, n_heads, n_splits, text_len, SCALE: tl.constexpr,
                        BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, LEAD: tl.constexpr, PDL: tl.constexpr,
                        EVICT: tl.constexpr, FRESH: tl.constexpr, TEXT: tl.constexpr, ROW_POS: tl.constexpr):
        rh = tl.program_id(0)
        split = tl.program_id(1)
        r = rh // n_heads
        h = rh % n_heads
        pos, FREQS = _position(POS, FREQS, r, HEAD_DIM, ROW_POS)
        if TEXT:  # the text is the merge's partial; every later key is attendable
            start = text_len + split * BLOCK
        else:
            start = _first_key(KEY_VALID + r * stride_valid, pos, LEAD) + split * BLOCK
        out = rh * n_splits + split
        if start <= pos:
            _tile(Q, K, V, KEY_VALID, M_OUT, L_OUT, ACC_OUT, K_NEW, V_NEW, FREQS, r, h, out, start, pos,
                  stride_qr, stride_qh, stride_kr, stride_kh, stride_kn, stride_vr, stride_vh, stride_vn,
                  stride_valid, stride_nr, stride_nh, SCALE, BLOCK, HEAD_DIM, PDL, EVICT, FRESH, TEXT)
        else:  # past pos: a partial that weighs nothing (written after the wait, as every write of a PDL kernel)
            pdl_wait(PDL)
            pdl_trigger(PDL)
            tl.store(M_OUT + out, float("-inf"))
            tl.store(L_OUT + out, 0.0)
            tl.store(ACC_OUT + out * HEAD_DIM + tl.arange(0, HEAD_DIM), tl.zeros((HEAD_DIM,), tl.float32))

    @triton.jit
    def _position(POS, FREQS, r, HEAD_DIM: tl.constexpr, ROW_POS: tl.constexpr):
        """Row r's position and RoPE row: the step's one for every row, or with ROW_POS each row's own (a server's
        step: POS (R,), FREQS (R, HEAD_DIM / 2, 2)). Written by the previous step, before any kernel of this one."""
        at = r if ROW_POS else 0
        return tl.load(POS + at), FREQS + at * HEAD_DIM

    @triton.jit
    def _first_key(VALID, pos, LEAD: tl.constexpr):
        """A key position no later than the first one p may attend to: no earlier key is attendable
        (searched among the first LEAD keys; pos is always attended). key_valid is set before the step."""
        offs = tl.arange(0, LEAD)
        valid = tl.load(VALID + offs, mask=offs < pos, other=0) != 0
        return tl.minimum(tl.min(tl.where(valid, offs, LEAD), 0), pos)

    @triton.jit
    def _rope(ptr, x, FREQS, offs_d, mask):
        """x (HEAD_DIM,) in float32, loaded from ptr, rotated as model.apply_rotary_emb (the pair 2j, 2j + 1 by
        FREQS row j: cos, sin) and rounded to ptr's dtype, as the model's result is."""
        other = tl.load(ptr + (offs_d ^ 1), mask=mask, other=0.0).to(tl.float32)  # the pair's other half
        cos = tl.load(FREQS + offs_d // 2 * 2)
        sin = tl.load(FREQS + offs_d // 2 * 2 + 1)
        out = tl.where(offs_d % 2 == 0, x * cos - other * sin, x * cos + other * sin)
        return out.to(ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _text_partial(TEXT_SUM, TEXT_COUNT, r, rh, offs_d, HEAD_DIM: tl.constexpr):
        """(max, sum, weighted values) of the text's keys for (row r, head rh), from text_sums: their scores are 0, so
        the max is 0, unless no key of it is attendable (count 0: -inf, a partial that weighs nothing)."""
        l = tl.load(TEXT_COUNT + r)
        return tl.where(l > 0, 0.0, float("-inf")), l, tl.load(TEXT_SUM + rh * HEAD_DIM + offs_d)

    @triton.jit
    def _read_once(ptrs, mask, EVICT: tl.constexpr):
        """Keys or values, zeros where masked; read once per step, so evicted from L2 first (EVICT_FIRST) if EVICT."""
        if EVICT:
            x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(ptrs, mask=mask, other=0.0)
        return x

    @triton.jit
    def _tile(Q, K, V, KEY_VALID, M_OUT, L_OUT, ACC_OUT, K_NEW, V_NEW, FREQS, r, h, out, start, pos,
              stride_qr, stride_qh, stride_kr, stride_kh, stride_kn, stride_vr, stride_vh, stride_vn, stride_valid,
              stride_nr, stride_nh, SCALE: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
              PDL: tl.constexpr, EVICT: tl.constexpr, FRESH: tl.constexpr, TEXT: tl.constexpr):
        """Keys start..start+BLOCK-1 of (row r, head h) -> partial (max, sum, weighted values) at `out`."""
        # Offsets within the tile, its start in the base pointers: the tile's vectors keep the same
        # compile-time form wherever it starts (a runtime start in them costs ~80 registers: spills).
        offs_n = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        k_ptrs = K + r * stride_kr + h * stride_kh + start * stride_kn + offs_n[:, None] * stride_kn + offs_d[None, :]
        v_ptrs = V + r * stride_vr + h * stride_vh + start * stride_vn + offs_n[:, None] * stride_vn + offs_d[None, :]
        # K/V are masked by the filled length only (every filled slot is finite); padding is masked in
        # the scores. They stay bf16 in registers until used: a 128 x 64 tile in fp32 spills.
        if FRESH:  # the tile holding pos writes the step's key (rotated) and value into the caches first; the
            # barrier shows them to the loads of the program's other threads (no other program reads pos)
            here = offs_d < tl.where(pos - start < BLOCK, HEAD_DIM, 0)
            new_at = r * stride_nr + h * stride_nh
            k_new = tl.load(K_NEW + new_at + offs_d, mask=here, other=0.0).to(tl.float32)
            k_new = _rope(K_NEW + new_at, k_new, FREQS, offs_d, here)
            v_new = tl.load(V_NEW + new_at + offs_d, mask=here, other=0.0)
            tl.store(K + r * stride_kr + h * stride_kh + pos * stride_kn + offs_d, k_new.to(K.dtype.element_ty),
                     mask=here)
            tl.store(V + r * stride_vr + h * stride_vh + pos * stride_vn + offs_d, v_new.to(V.dtype.element_ty),
                     mask=here)
            tl.debug_barrier()
        earlier = offs_n < pos - start
        current = offs_n == pos - start
        # With PDL the tile holds the keys of earlier steps only, loaded before the wait; the current
        # key and value (written by the kernel just before) are read after it, as vectors.
        tile = earlier if PDL else earlier | current
        k = _read_once(k_ptrs, tile[:, None], EVICT)
        v = _read_once(v_ptrs, tile[:, None], EVICT)
        if TEXT:  # the tile starts past the text
            ok = earlier
        else:
            ok = tl.load(KEY_VALID + r * stride_valid + start + offs_n, mask=earlier, other=0) != 0
        pdl_wait(PDL)
        q_at = Q + r * stride_qr + h * stride_qh
        q = tl.load(q_at + offs_d).to(tl.float32)
        if FRESH:
            q = _rope(q_at, q, FREQS, offs_d, offs_d >= 0)
        # SCALE is a constexpr so it stays fp32 (a runtime float becomes fp64 under inductor).
        q = q * SCALE
        scores = tl.sum(k.to(tl.float32) * q[None, :], 1)
        if PDL:
            here = offs_d < tl.where(pos - start < BLOCK, HEAD_DIM, 0)  # the whole row iff this tile holds pos
            k_cur = tl.load(K + r * stride_kr + h * stride_kh + pos * stride_kn + offs_d, mask=here, other=0.0)
            scores = tl.where(current, tl.sum(k_cur.to(tl.float32) * q, 0), scores)
        scores = tl.where(current | (earlier & ok), scores, float("-inf"))
        m = tl.max(scores, 0)  # -inf for a tile of padding only
        p = tl.exp(scores - tl.where(m == float("-inf"), 0.0, m))
        acc = tl.sum(p[:, None] * v.to(tl.float32), 0)
        if PDL:
            v_cur = tl.load(V + r * stride_vr + h * stride_vh + pos * stride_vn + offs_d, mask=here, other=0.0)
            acc += tl.sum(tl.where(current, p, 0.0), 0) * v_cur.to(tl.float32)
        pdl_trigger(PDL)
        tl.store(M_OUT + out, m)
        tl.store(L_OUT + out, tl.sum(p, 0))
        tl.store(ACC_OUT + out * HEAD_DIM + offs_d, acc)

    @triton.jit
    def _whole_kernel(Q, K, V, KEY_VALID, POS, OUT, K_NEW, V_NEW, FREQS, PROGRESS, TEXT_SUM, TEXT_COUNT,
                      stride_qr, stride_qh, stride_kr, stride_kh, stride_kn, stride_vr, stride_vh, stride_vn,
                      stride_valid, stride_nr, stride_nh, n_heads, text_len, SCALE: tl.constexpr, BLOCK: tl.constexpr,
                      HEAD_DIM: tl.constexpr, LEAD: tl.constexpr, PDL: tl.constexpr, EVICT: tl.constexpr,
                      FRESH: tl.constexpr, TEXT: tl.constexpr, BUMP: tl.constexpr, STAGES: tl.constexpr,
                      ROW_POS: tl.constexpr):
        """One program per (row, head) over all its keys, BLOCK at a time (an online softmax), with the text's
        partial as its start: no partials and no merge. As _partial_kernel and _merge_kernel together. STAGES > 1:
        Triton's pipeliner copies the next STAGES - 1 tiles into shared memory (cp.async) while one is scored."""
        rh = tl.program_id(0)
        r = rh // n_heads
        h = rh % n_heads
        pos, FREQS = _position(POS, FREQS, r, HEAD_DIM, ROW_POS)
        offs_n = tl.arange(0, BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        k_row = K + r * stride_kr + h * stride_kh
        v_row = V + r * stride_vr + h * stride_vh
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        if TEXT:  # the online softmax starts from the text's partial
            start = text_len
            m, l, acc = _text_partial(TEXT_SUM, TEXT_COUNT, r, rh, offs_d, HEAD_DIM)
        else:
            start = _first_key(KEY_VALID + r * stride_valid, pos, LEAD)
        pdl_wait(PDL)
        q_at = Q + r * stride_qr + h * stride_qh
        q = tl.load(q_at + offs_d).to(tl.float32)
        if FRESH:  # this program alone reads (r, h)'s keys: it writes the step's (rotated) and reads them back
            new_at = r * stride_nr + h * stride_nh
            k_new = _rope(K_NEW + new_at, tl.load(K_NEW + new_at + offs_d).to(tl.float32), FREQS, offs_d, offs_d >= 0)
            tl.store(k_row + pos * stride_kn + offs_d, k_new.to(K.dtype.element_ty))
            tl.store(v_row + pos * stride_vn + offs_d, tl.load(V_NEW + new_at + offs_d))
            tl.debug_barrier()
            q = _rope(q_at, q, FREQS, offs_d, offs_d >= 0)
        q = q * SCALE
        for first in tl.range(start, pos + 1, BLOCK, num_stages=STAGES if STAGES > 1 else None):
            keys = first + offs_n
            tile = keys <= pos
            k = _read_once(k_row + keys[:, None] * stride_kn + offs_d[None, :], tile[:, None], EVICT)
            v = _read_once(v_row + keys[:, None] * stride_vn + offs_d[None, :], tile[:, None], EVICT)
            if not TEXT:
                tile = (keys == pos) | (tl.load(KEY_VALID + r * stride_valid + keys, mask=keys < pos, other=0) != 0)
            scores = tl.where(tile, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
            top = tl.maximum(m, tl.max(scores, 0))
            top = tl.where(top == float("-inf"), 0.0, top)  # nothing attendable yet: weights of zero
            p = tl.exp(scores - top)
            w = tl.exp(m - top)
            l = l * w + tl.sum(p, 0)
            acc = acc * w + tl.sum(p[:, None] * v.to(tl.float32), 0)
            m = tl.maximum(m, tl.max(scores, 0))
        pdl_trigger(PDL)
        tl.store(OUT + rh * HEAD_DIM + offs_d, (acc / l).to(OUT.dtype.element_ty))
        bump(PROGRESS, BUMP)  # a prefetcher's count as the first program ends: the others end about then

    @triton.jit
    def _merge_kernel(M, L, ACC, OUT, PROGRESS, TEXT_SUM, TEXT_COUNT, n_splits, n_heads, SPLITS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, PDL: tl.constexpr, BUMP: tl.constexpr, TEXT: tl.constexpr):
        bump(PROGRESS, BUMP)  # a prefetcher's count: this layer's keys have streamed
        rh = tl.program_id(0)
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        if TEXT:  # made after the prefill: read before the wait
            text_m, text_l, text_acc = _text_partial(TEXT_SUM, TEXT_COUNT, rh // n_heads, rh, offs_d, HEAD_DIM)
        pdl_wait(PDL)
        ok = offs_s < n_splits
        m = tl.load(M + rh * n_splits + offs_s, mask=ok, other=float("-inf"))
        l = tl.load(L + rh * n_splits + offs_s, mask=ok, other=0.0)
        acc = tl.load(ACC + (rh * n_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        top = tl.max(m, 0)  # the tile holding the current key is never empty, so the max is finite
        if TEXT:
            top = tl.maximum(top, text_m)
        w = tl.exp(m - top)
        num = tl.sum(w[:, None] * acc, 0)
        den = tl.sum(w * l, 0)
        if TEXT:
            text_w = tl.exp(text_m - top)
            num += text_w * text_acc
            den += text_w * text_l
        out = num / den
        pdl_trigger(PDL)
        tl.store(OUT + rh * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty))

    @triton.jit
    def _text_sums_kernel(V, SUMS, COUNTS, TABLE, KEY_VALID, text_len, sv_r, sv_h, sv_t, ss_r, ss_h, skv,
                          HD: tl.constexpr, HDP: tl.constexpr, BLOCK_T: tl.constexpr):
        """Program (layer l, row r, head h): the values of its first text_len keys that key_valid[r] lets attend,
        summed in float32, at layer l's SUMS[r, h], and (h = 0) their count at its COUNTS[r]. TABLE[l]: l's
        element offsets from V, SUMS and COUNTS (text_table)."""
        l, r, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        v = V + tl.load(TABLE + 3 * l) + r * sv_r + h * sv_h
        t, d = tl.arange(0, BLOCK_T), tl.arange(0, HDP)
        acc = tl.zeros((HDP,), tl.float32)
        count = tl.zeros((BLOCK_T,), tl.float32)
        for t0 in range(0, text_len, BLOCK_T):
            ok = t0 + t < text_len
            w = tl.load(KEY_VALID + r * skv + t0 + t, mask=ok, other=0).to(tl.float32)
            x = tl.load(v + (t0 + t)[:, None] * sv_t + d[None, :], mask=ok[:, None] & (d < HD)[None, :], other=0.0)
            acc += tl.sum(x.to(tl.float32) * w[:, None], 0)
            count += w
        tl.store(SUMS + tl.load(TABLE + 3 * l + 1) + r * ss_r + h * ss_h + d, acc, mask=d < HD)
        if h == 0:
            tl.store(COUNTS + tl.load(TABLE + 3 * l + 2) + r, tl.sum(count, 0))


def decode_attention(q, k_cache, v_cache, key_valid, input_pos, config=None, pdl=False, progress=None, fresh=None,
                     text=None, merge_pdl=None, whole=False):
    """q (R,H,1,hd); caches (>= R,H,L,hd), rows past R untouched; key_valid (R,L) bool; input_pos (1,), or (R, 1)
    each row's own (a server's step; fresh's freqs then (R, 1, hd/2, 2)) -> (R,H,1,hd).
    whole: one program per (row, head), config WHOLE's form (BLOCK, warps, stages); else the split form, config
    (BLOCK, warps, merge warps), by default CONFIGS' for R. progress: a prefetcher's int32 count (prefetch_triton.py),
    bumped once per call (by the merge as it starts, or by the
    whole kernel's first program as it ends), or None. fresh: None (q is rotated, the caches hold the step's key and
    value) or (k, v, freqs): the step's key and value (R,H,1,hd) and q before RoPE, freqs the position's RoPE row
    (1,hd/2,2); the key (rotated) and value are written to the caches at input_pos. text: None or (sums, counts, T)
    from text_sums: the first T keys are zero and stand for them; key_valid is not read (every key from T on is
    attendable). merge_pdl: how the merge launches (pdl.launch's argument), if not as the partial kernel does: it
    reads only the text's partial before its wait, so it may launch with PDL after a partial kernel without it."""
    R, H, _, hd = q.shape
    L = k_cache.shape[2]
    k_new, v_new, freqs = (q, q, q) if fresh is None else fresh  # unused pointers without it
    if k_new.stride() != v_new.stride():
        raise ValueError("decode_attention: fresh keys and values need the same strides")
    text_sum, text_count, text_len = (q, q, 0) if text is None else text  # unused pointers without it
    row_pos = input_pos.numel() > 1
    if row_pos and not (input_pos.numel() == R and input_pos.is_contiguous()
                        and (fresh is None or (freqs.shape[0] == R and freqs.is_contiguous()))):
        raise ValueError("decode_attention: a position per row needs R contiguous positions (and RoPE rows)")
    # what both kernels take: the strides of q, the caches, key_valid and the step's key, and the constants
    strides = (q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], key_valid.stride(0),
               *k_new.stride()[:2])
    consts = dict(SCALE=hd**-0.5, HEAD_DIM=hd, LEAD=LEAD, EVICT=EVICT_FIRST, FRESH=fresh is not None,
                  TEXT=text is not None, ROW_POS=row_pos, **launch(pdl))
    if whole:  # one program per (row, head), no merge
        block, num_warps, stages = config or WHOLE
        out = torch.empty(R, H, 1, hd, device=q.device, dtype=q.dtype)
        _whole_kernel[(R * H,)](
            q, k_cache, v_cache, key_valid, input_pos, out, k_new, v_new, freqs, out if progress is None else progress,
            text_sum, text_count, *strides, H, text_len, BLOCK=block, BUMP=progress is not None, num_warps=num_warps,
            num_stages=stages, STAGES=stages, **consts)
        return out
    block, num_warps, merge_warps = config or config_for(R)
    n_splits = triton.cdiv(L - text_len, block)
    m = torch.empty(R, H, n_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(R, H, n_splits, hd, device=q.device, dtype=torch.float32)
    _partial_kernel[(R * H, n_splits)](q, k_cache, v_cache, key_valid, input_pos, m, l, acc, k_new, v_new, freqs,
                                       *strides, H, n_splits, text_len, BLOCK=block, num_warps=num_warps, **consts)
    out = torch.empty(R, H, 1, hd, device=q.device, dtype=q.dtype)
    _merge_kernel[(R * H,)](m, l, acc, out, m if progress is None else progress, text_sum, text_count, n_splits, H,
                            SPLITS=triton.next_power_of_2(n_splits), HEAD_DIM=hd, BUMP=progress is not None,
                            TEXT=text is not None, num_warps=merge_warps,
                            **launch(pdl if merge_pdl is None else merge_pdl))  # m: an unused pointer
    return out


def text_sums(v_cache, key_valid, text_len, sums, counts):
    """After the prefill: what the first text_len keys give every later query, whose scores against them are 0
    (their keys are zero, SPEC 2.5). sums (>= R,H,hd) float32: the values of the attendable ones summed, counts
    (>= R,) float32: how many there are, for R = key_valid's rows. As decode_attention's text, the same math as
    their tile's: exp(0 - max) is the weight of every one of them."""
    R = key_valid.shape[0]
    assert sums.dtype == counts.dtype == torch.float32 and sums[:R].is_contiguous()
    w = key_valid[:, :text_len].to(torch.float32)
    torch.sum(v_cache[:R, :, :text_len] * w[:, None, :, None], 2, out=sums[:R])
    torch.sum(w, 1, out=counts[:R])


def text_table(caches):
    """The layers' KVCaches (one shape, each with its text partial c.text = (sums, counts, T)) as layer_text_sums'
    table: per layer the element offsets of its value cache, text sums and count from the first layer's, (L, 3) int64
    on their device. Made outside any capture (a host copy)."""
    first = caches[0]
    rows = [[(t.data_ptr() - t0.data_ptr()) // t.element_size()
             for t, t0 in zip((c.v_cache, *c.text[:2]), (first.v_cache, *first.text[:2]))] for c in caches]
    assert all(c.v_cache.stride() == first.v_cache.stride() and c.text[0].stride() == first.text[0].stride()
               for c in caches)
    return torch.tensor(rows, dtype=torch.int64, device=first.v_cache.device)


def layer_text_sums(caches, key_valid, table=None):
    """text_sums of each layer's KVCache c (its v_cache and text partial c.text = (sums, counts, T)) after the
    prefill: one kernel for all layers where `table` (text_table) is given, which sums each (layer, row, head)'s
    values in its own order (float32, as text_sums), else torch's ops per layer (four kernels each: GPT-XL's 144 are
    0.3 ms of an H200's prefill graph at n = 1)."""
    if table is None:
        for c in caches:
            sums, counts, T = c.text
            text_sums(c.v_cache, key_valid, T, sums, counts)
        return
    c = caches[0]
    (sums, counts, T), R, (_, H, _, hd) = c.text, key_valid.shape[0], c.v_cache.shape
    assert sums.dtype == counts.dtype == torch.float32 and sums.stride(2) == 1
    _text_sums_kernel[(len(caches), R, H)](c.v_cache, sums, counts, table, key_valid, T, *c.v_cache.stride()[:3],
                                           *sums.stride()[:2], key_valid.stride(0), HD=hd,
                                           HDP=triton.next_power_of_2(hd), BLOCK_T=64, num_warps=2)


def config_for(rows):
    """The split form's (BLOCK, warps, merge warps) at `rows` rows (CONFIGS)."""
    return next(config for bound, config in CONFIGS if bound is None or rows <= bound)


# ---- the window form: L >= 1 queries per row, each row at its own position ---------------------------------------
# Row r holds seqlens[r] filled keys before its window (cache_seqlens, as FlashAttention's flash_attn_with_kvcache);
# its window's L keys sit at cache positions seqlens[r] .. seqlens[r] + L - 1, and query j sees the filled keys that
# key_valid lets it and window key i where bit i of masks[r, j] is set (a chain: bits 0..j; a draft tree: its
# ancestors). Each program reads its split's tiles of a row's keys for all L queries (two tensor-core dots a tile), so
# the keys are read once per pass whatever L is; a row's splits are merged by the last of them to finish (fold) or by a
# second kernel. A query must see at least one key (its own bit).
WINDOW_CONFIG = (64, 4, 4)  # (BLOCK, warps, merge warps): swept on an H100, best or near it (PERF_NOTES, "Eleventh")
MAX_WINDOW = 64  # a query's mask is one int64
WINDOW_PROGRAMS = 256  # the fold form's least programs at the full cache: two per SM of an H100/H200 (swept as above)

if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b summed in float32; IEEE: float32 inputs multiplied exactly (the tests' float32 models), not as tf32."""
        if IEEE:
            out = tl.dot(a, b, input_precision="ieee")
        else:
            out = tl.dot(a, b)
        return out

    @triton.jit
    def _online_softmax(m, l, acc, scores, v, IEEE: tl.constexpr):
        """One tile of keys added to the queries' running (max, sum, weighted values): scores (LP, BLOCK) with -inf
        where a query does not see a key, v (BLOCK, HEAD_DIM)."""
        top = tl.maximum(m, tl.max(scores, 1))  # -inf for a query that has seen nothing yet
        top = tl.where(top == float("-inf"), 0.0, top)
        p = tl.exp(scores - top[:, None])
        w = tl.exp(m - top)  # the earlier tiles' weight (0 before the first: acc and l are 0 then)
        l = l * w + tl.sum(p, 1)
        acc = acc * w[:, None] + _dot(p.to(v.dtype), v, IEEE)  # (LP, HEAD_DIM)
        return tl.maximum(m, tl.max(scores, 1)), l, acc

    @triton.jit
    def _window_partial_kernel(Q, K, V, KEY_VALID, SEQLENS, MASKS, M_OUT, L_OUT, ACC_OUT, OUT, COUNT, TEXT_SUM,
                               TEXT_COUNT, PROGRESS, stride_qr, stride_qh, stride_ql, stride_kr, stride_kh, stride_kn,
                               stride_vr, stride_vh, stride_vn, stride_valid, stride_mr, stride_or, stride_oh,
                               stride_ol, n_heads, n_splits, n_keys, text_len, window, SCALE: tl.constexpr,
                               BLOCK: tl.constexpr, TILES: tl.constexpr, HEAD_DIM: tl.constexpr, LP: tl.constexpr,
                               TEXT: tl.constexpr, IEEE: tl.constexpr, FOLD: tl.constexpr, BUMP: tl.constexpr):
        """Program (row r x head h, split s): keys text_len + s*TILES*BLOCK .. + TILES*BLOCK - 1, a tile of BLOCK at a
        time (an online softmax), against r's `window` queries -> a partial (max, sum, weighted values) per query at
        M_OUT/L_OUT/ACC_OUT[(rh * n_splits + s) * window + j]; a split past the window writes nothing (the merge reads
        the splits up to the window's last key only). FOLD: no merge kernel: a row whose keys fit one split writes its
        output at OUT itself, and of a row of several the last split to finish (COUNT[rh], zero between launches)
        merges them (_window_fold). BUMP: a prefetcher's count as the first program starts (the layer's later weights
        are fetched while the attention runs, prefetch_triton)."""
        bump(PROGRESS, BUMP)
        rh = tl.program_id(0)
        split = tl.program_id(1)
        r = rh // n_heads
        h = rh % n_heads
        start = tl.load(SEQLENS + r)  # the filled keys before the window
        end = tl.minimum(start + window, n_keys)  # one past the window's last key inside the cache
        lo = text_len + split * (TILES * BLOCK)
        out = (rh * n_splits + split) * window
        offs_l = tl.arange(0, LP)
        offs_d = tl.arange(0, HEAD_DIM)
        mine = offs_l < window  # the padding queries' partials are not stored
        if lo < end:
            q = tl.load(Q + r * stride_qr + h * stride_qh + offs_l[:, None] * stride_ql + offs_d[None, :],
                        mask=mine[:, None], other=0.0)
            bits = tl.load(MASKS + r * stride_mr + offs_l, mask=mine, other=0)  # (LP,) int64
            m = tl.full((LP,), float("-inf"), tl.float32)
            l = tl.zeros((LP,), tl.float32)
            acc = tl.zeros((LP, HEAD_DIM), tl.float32)
            hi = tl.minimum(lo + TILES * BLOCK, end)
            # tiles wholly before the window: every query sees each key, no mask (the bulk of a pass's tiles)
            whole = tl.minimum(hi, lo + tl.maximum(start - lo, 0) // BLOCK * BLOCK)
            for first in range(lo, whole, BLOCK):
                keys = first + tl.arange(0, BLOCK)
                k = tl.load(K + r * stride_kr + h * stride_kh + keys[:, None] * stride_kn + offs_d[None, :])
                v = tl.load(V + r * stride_vr + h * stride_vh + keys[:, None] * stride_vn + offs_d[None, :])
                scores = _dot(q, tl.trans(k), IEEE) * SCALE  # (LP, BLOCK)
                if not TEXT:  # with the text as a partial, every key from text_len on is attendable
                    valid = tl.load(KEY_VALID + r * stride_valid + keys) != 0
                    scores = tl.where(valid[None, :], scores, float("-inf"))
                m, l, acc = _online_softmax(m, l, acc, scores, v, IEEE)
            for first in range(whole, hi, BLOCK):  # the tiles that hold window keys: each query's mask
                keys = first + tl.arange(0, BLOCK)
                inside = keys < end
                k = tl.load(K + r * stride_kr + h * stride_kh + keys[:, None] * stride_kn + offs_d[None, :],
                            mask=inside[:, None], other=0.0)
                v = tl.load(V + r * stride_vr + h * stride_vh + keys[:, None] * stride_vn + offs_d[None, :],
                            mask=inside[:, None], other=0.0)
                # the products in the inputs' dtype, summed in float32, then scaled (a constexpr: stays float32)
                scores = _dot(q, tl.trans(k), IEEE) * SCALE  # (LP, BLOCK)
                past = keys < start
                if not TEXT:
                    past = past & (tl.load(KEY_VALID + r * stride_valid + keys, mask=past, other=0) != 0)
                i = tl.minimum(tl.maximum(keys - start, 0), 63)  # the window key's index (clamped where it is none)
                seen = ((bits[:, None] >> i[None, :].to(tl.int64)) & 1) != 0
                visible = past[None, :] | (seen & ((keys >= start) & inside)[None, :])
                scores = tl.where(visible, scores, float("-inf"))
                m, l, acc = _online_softmax(m, l, acc, scores, v, IEEE)
            used = (end - text_len + TILES * BLOCK - 1) // (TILES * BLOCK)  # the splits that hold the row's keys
            if FOLD and used == 1:  # the row's only split: its output, with the text's partial where given
                _window_out(OUT, TEXT_SUM, TEXT_COUNT, r, h, rh, m, l, acc, offs_l, offs_d, mine, stride_or, stride_oh,
                            stride_ol, HEAD_DIM, TEXT)
            else:
                tl.store(M_OUT + out + offs_l, m, mask=mine)
                tl.store(L_OUT + out + offs_l, l, mask=mine)
                tl.store(ACC_OUT + (out + offs_l)[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=mine[:, None])
                if FOLD:
                    tl.debug_barrier()  # every thread's partial stored before the count says so
                    done = tl.atomic_add(COUNT + rh, 1, sem="acq_rel", scope="gpu")
                    if done == used - 1:  # the row's last split: the others' partials are out
                        tl.store(COUNT + rh, 0)  # zero again for the next launch
                        _window_fold(M_OUT, L_OUT, ACC_OUT, OUT, TEXT_SUM, TEXT_COUNT, r, h, rh, used, n_splits,
                                     window, offs_l, offs_d, mine, stride_or, stride_oh, stride_ol, HEAD_DIM, LP,
                                     TEXT)

    @triton.jit
    def _window_out(OUT, TEXT_SUM, TEXT_COUNT, r, h, rh, m, l, acc, offs_l, offs_d, mine, stride_or, stride_oh,
                    stride_ol, HEAD_DIM: tl.constexpr, TEXT: tl.constexpr):
        """(max, sum, weighted values) per query of all the row's keys past the text, with the text's partial where
        given, -> the output at OUT[r, h, j]."""
        if TEXT:
            text_m, text_l, text_acc = _text_partial(TEXT_SUM, TEXT_COUNT, r, rh, offs_d, HEAD_DIM)
            top = tl.maximum(m, text_m)
            top = tl.where(top == float("-inf"), 0.0, top)
            w, w_text = tl.exp(m - top), tl.exp(text_m - top)
            l = l * w + text_l * w_text
            acc = acc * w[:, None] + text_acc[None, :] * w_text[:, None]
        y = acc / l[:, None]
        tl.store(OUT + r * stride_or + h * stride_oh + offs_l[:, None] * stride_ol + offs_d[None, :],
                 y.to(OUT.dtype.element_ty), mask=mine[:, None])

    @triton.jit
    def _window_fold(M, L, ACC, OUT, TEXT_SUM, TEXT_COUNT, r, h, rh, used, n_splits, window, offs_l, offs_d, mine,
                     stride_or, stride_oh, stride_ol, HEAD_DIM: tl.constexpr, LP: tl.constexpr, TEXT: tl.constexpr):
        """The row's `used` partials merged by its last split: the largest max of each query first (every split's at
        once), then each split's sum and values weighed by it, GROUP splits' loads issued together; read from L2
        (.cg: other programs wrote them)."""
        GROUP: tl.constexpr = 4
        base = rh * n_splits * window
        top = tl.full((LP,), float("-inf"), tl.float32)
        for s in range(used):
            top = tl.maximum(top, tl.load(M + base + s * window + offs_l, mask=mine, other=float("-inf"),
                                          cache_modifier=".cg"))
        top = tl.where(top == float("-inf"), 0.0, top)
        l = tl.zeros((LP,), tl.float32)
        acc = tl.zeros((LP, HEAD_DIM), tl.float32)
        for s0 in range(0, used, GROUP):
            for g in tl.static_range(GROUP):
                here = mine & (offs_l * 0 + s0 + g < used)  # a vector: the interpreter masks with no scalar
                at = base + (s0 + g) * window + offs_l
                w = tl.exp(tl.load(M + at, mask=here, other=float("-inf"), cache_modifier=".cg") - top)
                l += tl.load(L + at, mask=here, other=0.0, cache_modifier=".cg") * w
                acc += tl.load(ACC + at[:, None] * HEAD_DIM + offs_d[None, :], mask=here[:, None], other=0.0,
                               cache_modifier=".cg") * w[:, None]
        m = tl.where(l > 0, top, float("-inf"))  # as a partial: -inf where nothing was seen
        _window_out(OUT, TEXT_SUM, TEXT_COUNT, r, h, rh, m, l, acc, offs_l, offs_d, mine, stride_or, stride_oh,
                    stride_ol, HEAD_DIM, TEXT)

    @triton.jit
    def _window_merge_kernel(M, L, ACC, OUT, TEXT_SUM, TEXT_COUNT, SEQLENS, stride_or, stride_oh, stride_ol, n_heads,
                             n_splits, n_keys, text_len, window, HEAD_DIM: tl.constexpr, LP: tl.constexpr,
                             BLOCK: tl.constexpr, TEXT: tl.constexpr):
        """Program (row x head): its splits' partials merged per query (an online softmax over the splits up to the
        one holding the window's last key, from the text's partial where given), the output at OUT[r, h, j] for its
        `window` queries."""
        rh = tl.program_id(0)
        r = rh // n_heads
        h = rh % n_heads
        end = tl.minimum(tl.load(SEQLENS + r) + window, n_keys)
        used = tl.minimum(tl.maximum(end - text_len + BLOCK - 1, 0) // BLOCK, n_splits)  # the splits that wrote
        offs_l = tl.arange(0, LP)
        mine = offs_l < window
        offs_d = tl.arange(0, HEAD_DIM)
        m = tl.full((LP,), float("-inf"), tl.float32)
        l = tl.zeros((LP,), tl.float32)
        acc = tl.zeros((LP, HEAD_DIM), tl.float32)
        if TEXT:
            text_m, text_l, text_acc = _text_partial(TEXT_SUM, TEXT_COUNT, r, rh, offs_d, HEAD_DIM)
            m = tl.zeros((LP,), tl.float32) + text_m
            l = l + text_l
            acc = acc + text_acc[None, :]
        for s in range(used):
            at = (rh * n_splits + s) * window + offs_l
            ms = tl.load(M + at, mask=mine, other=float("-inf"))
            top = tl.maximum(m, ms)
            top = tl.where(top == float("-inf"), 0.0, top)
            w_old = tl.exp(m - top)
            w_new = tl.exp(ms - top)
            l = l * w_old + tl.load(L + at, mask=mine, other=0.0) * w_new
            acc = acc * w_old[:, None] + tl.load(ACC + at[:, None] * HEAD_DIM + offs_d[None, :], mask=mine[:, None],
                                                 other=0.0) * w_new[:, None]
            m = tl.maximum(m, ms)
        y = acc / l[:, None]
        tl.store(OUT + r * stride_or + h * stride_oh + offs_l[:, None] * stride_ol + offs_d[None, :],
                 y.to(OUT.dtype.element_ty), mask=mine[:, None])


def window_fits(head_dim, window):
    """window_attention takes heads of a power-of-two size >= 16 (tl.dot's least) and windows of <= MAX_WINDOW."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and 1 <= window <= MAX_WINDOW


def window_config(dtype, head_dim, lp):
    """The window form's (BLOCK, warps, merge warps): WINDOW_CONFIG, its tile halved for every doubling of the
    float32 tiles past bf16 at GPT-XL's head dim (float32 at 32 queries spilled)."""
    block, warps, merge_warps = WINDOW_CONFIG
    scale = (4 if dtype == torch.float32 else 2) * head_dim * lp // (2 * 64 * 16)
    while scale > 2 and block > 16:
        block, scale = block // 2, scale // 2
    return block, warps, merge_warps


def chain_masks(window, device=None):
    """The window mask of a chain (a Jacobi pass; a plain step at window 1): query j sees window keys 0..j, (window,)
    int64."""
    if not 1 <= window <= MAX_WINDOW:
        raise ValueError(f"a window of {window} queries: use 1 to {MAX_WINDOW}")
    return torch.tensor([(1 << j + 1) - 1 if j < 63 else -1 for j in range(window)], dtype=torch.int64, device=device)


def window_tiles(pairs, tiles):
    """The tiles each split of the fold form walks, for `pairs` (row, head)s over `tiles` tiles of the whole cache: the
    most (a power of two) that still leave WINDOW_PROGRAMS programs at the full cache, so a short row uses one split
    (no partials) and a long one few; each key is still read once, by one program."""
    per = 1
    while per < tiles and pairs * triton.cdiv(tiles, per * 2) >= WINDOW_PROGRAMS:
        per *= 2
    return per


_COUNTS = {}  # device -> the fold form's per-(row, head) counts, int32, zero between launches (each last split resets)


def fold_counts(device, n):
    """n zeroed counts on `device`, kept for the process (a graph that captured them keeps their address). One stream
    at a time may run the fold form on a device: two launches in flight at once would share the counts."""
    counts = _COUNTS.get(device)
    if counts is None or counts.numel() < n:
        counts = _COUNTS[device] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return counts


def window_attention(q, k_cache, v_cache, key_valid, seqlens, masks, text=None, config=None, fold=True, splits=None,
                     progress=None):
    """q (R,H,L,hd) rotated, the window's keys and values already in the caches (>= R,H,N,hd) at positions
    seqlens[r] .. seqlens[r] + L - 1 (those past N are none); key_valid (R, >= N) bool, which filled keys the row
    may attend; seqlens (R,) int64, the filled keys before each row's window; masks (R, L) int64 (a row stride of 0
    shares one): bit i of masks[r, j], query j sees window key i. text: None or (sums, counts, T) as
    decode_attention's: the first T keys are zero and stand for them. -> (R,H,L,hd), laid out (R,L,H,hd) in memory
    (the output projection's rows). config: (BLOCK, warps, merge warps), window_config's by default. fold: one launch,
    splits of window_tiles' tiles (or `splits` of them over the cache), a row of one split writing its output and of
    several merged by its last split; else (the plan's window_splits=merge) a split per tile and the merge kernel.
    progress: a prefetcher's int32 count (prefetch_triton.py), one per call."""
    R, H, L, hd = q.shape
    N = k_cache.shape[2]
    if L > MAX_WINDOW or masks.shape[-1] != L or masks.dtype != torch.int64 or seqlens.dtype != torch.int64:
        raise ValueError(f"window_attention: {L} queries (at most {MAX_WINDOW}), int64 seqlens and masks of L")
    assert seqlens.stride(0) == 1 and masks.stride(-1) == 1 and q.stride(3) == 1
    text_sum, text_count, text_len = (q, q, 0) if text is None else text  # unused pointers without it
    LP = max(16, triton.next_power_of_2(L))  # tl.dot's least rows
    block, num_warps, merge_warps = config or window_config(q.dtype, hd, LP)
    tiles = triton.cdiv(N - text_len, block)
    per = (window_tiles(R * H, tiles) if splits is None else triton.cdiv(tiles, splits)) if fold else 1
    n_splits = triton.cdiv(tiles, per)
    m = torch.empty(R * H, n_splits, L, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(R * H, n_splits, L, hd, device=q.device, dtype=torch.float32)
    stride_mr = masks.stride(0) if masks.dim() == 2 else 0
    out = torch.empty(R, L, H, hd, device=q.device, dtype=q.dtype).transpose(1, 2)
    counts = fold_counts(q.device, R * H) if fold else m  # m: an unused pointer
    _window_partial_kernel[(R * H, n_splits)](
        q, k_cache, v_cache, key_valid, seqlens, masks, m, l, acc, out, counts, text_sum, text_count,
        m if progress is None else progress, *q.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
        key_valid.stride(0), stride_mr, *out.stride()[:3], H, n_splits, N, text_len, L, SCALE=hd**-0.5, BLOCK=block,
        TILES=per, HEAD_DIM=hd, LP=LP, TEXT=text is not None, IEEE=q.dtype == torch.float32, FOLD=fold,
        BUMP=progress is not None, num_warps=num_warps)  # m: an unused pointer without a count
    if not fold:
        _window_merge_kernel[(R * H,)](m, l, acc, out, text_sum, text_count, seqlens, *out.stride()[:3], H, n_splits,
                                       N, text_len, L, HEAD_DIM=hd, LP=LP, BLOCK=block, TEXT=text is not None,
                                       num_warps=merge_warps)
    return out
