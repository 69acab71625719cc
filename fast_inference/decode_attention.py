"""Decode attention that reads only the filled part of the KV cache (split-KV, Triton).

The static cache is sized for the whole image, but at step p only keys 0..p exist. SDPA over the
static cache reads all of it every step; this kernel stops each program's loop at p, so the bytes
per step follow the filled length. Each program walks one span of SPLIT keys of one (row, head) in
tiles of BLOCK keys with an online softmax and writes a partial result (max, sum, weighted values);
a second kernel merges the partials of each (row, head) and writes the output in the layout the
output projection reads.
Same function as SDPA with the mask rule of model.attention_mask: query p sees key q iff q == p or
(q <= p and key_valid[q]).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the cudagraph/eager backends work without Triton
    triton = None

# (SPLIT, BLOCK, num_warps). scripts/bench_decode_attention.py on the H200 (GPT-XL, CUDA-graph timed):
# one tile of 128 keys per program was best at 64 rows at positions 700 and 1100 (84 / 116 us vs SDPA
# 111 us), 18% behind the best at position 200 (42 vs 36 us: longer spans win early in the image),
# best at 2 rows and within 2% of the best at 16 rows.
CONFIG = (128, 128, 4)


if triton is not None:

    @triton.jit
    def _partial_kernel(Q, K, V, KEY_VALID, POS, M_OUT, L_OUT, ACC_OUT,
                        stride_qr, stride_qh, stride_kr, stride_kh, stride_kn, stride_vr, stride_vh, stride_vn,
                        stride_valid, n_heads, n_splits,
                        SCALE: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
        rh = tl.program_id(0)
        split = tl.program_id(1)
        r = rh // n_heads
        h = rh % n_heads
        pos = tl.load(POS)
        start = split * SPLIT
        end = tl.minimum(start + SPLIT, pos + 1)  # keys start..end-1; an empty span writes m = -inf
        offs_d = tl.arange(0, HEAD_DIM)
        # SCALE is a constexpr so it stays fp32 (a runtime float becomes fp64 under inductor).
        q = tl.load(Q + r * stride_qr + h * stride_qh + offs_d).to(tl.float32) * SCALE
        k_ptrs = K + r * stride_kr + h * stride_kh + offs_d[None, :]
        v_ptrs = V + r * stride_vr + h * stride_vh + offs_d[None, :]
        m_i = tl.full((), float("-inf"), tl.float32)
        l_i = tl.zeros((), tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        for n0 in range(start, end, BLOCK):
            offs_n = n0 + tl.arange(0, BLOCK)
            filled = offs_n < end
            # K/V are masked by `filled` only (every filled slot holds finite values), so their loads
            # do not wait for the key_valid load; padding is masked in the scores.
            ok = tl.load(KEY_VALID + r * stride_valid + offs_n, mask=filled, other=0) != 0
            k = tl.load(k_ptrs + offs_n[:, None] * stride_kn, mask=filled[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_ptrs + offs_n[:, None] * stride_vn, mask=filled[:, None], other=0.0).to(tl.float32)
            visible = filled & (ok | (offs_n == pos))
            scores = tl.where(visible, tl.sum(k * q[None, :], 1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all padding so far: no NaN
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe)
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = acc * alpha + tl.sum(p[:, None] * v, 0)
            m_i = m_new
        out = rh * n_splits + split
        tl.store(M_OUT + out, m_i)
        tl.store(L_OUT + out, l_i)
        tl.store(ACC_OUT + out * HEAD_DIM + offs_d, acc)

    @triton.jit
    def _merge_kernel(M, L, ACC, OUT, n_splits, SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr):
        rh = tl.program_id(0)
        offs_s = tl.arange(0, SPLITS)
        offs_d = tl.arange(0, HEAD_DIM)
        ok = offs_s < n_splits
        m = tl.load(M + rh * n_splits + offs_s, mask=ok, other=float("-inf"))
        l = tl.load(L + rh * n_splits + offs_s, mask=ok, other=0.0)
        acc = tl.load(ACC + (rh * n_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        w = tl.exp(m - tl.max(m, 0))  # span 0 always holds the current key, so the max is finite
        out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
        tl.store(OUT + rh * HEAD_DIM + offs_d, out.to(OUT.dtype.element_ty))


def decode_attention(q, k_cache, v_cache, key_valid, input_pos, config=None):
    """q (R,H,1,hd); caches (R,H,L,hd); key_valid (R,L) bool; input_pos (1,) -> (R,H,1,hd)."""
    R, H, _, hd = q.shape
    L = k_cache.shape[2]
    split, block, num_warps = config or CONFIG
    n_splits = triton.cdiv(L, split)
    m = torch.empty(R, H, n_splits, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(R, H, n_splits, hd, device=q.device, dtype=torch.float32)
    _partial_kernel[(R * H, n_splits)](
        q, k_cache, v_cache, key_valid, input_pos, m, l, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), key_valid.stride(0), H, n_splits,
        SCALE=hd**-0.5, SPLIT=split, BLOCK=block, HEAD_DIM=hd, num_warps=num_warps,
    )
    out = torch.empty(R, H, 1, hd, device=q.device, dtype=q.dtype)
    _merge_kernel[(R * H,)](m, l, acc, out, n_splits, SPLITS=triton.next_power_of_2(n_splits), HEAD_DIM=hd)
    return out


def available(device):
    return triton is not None and torch.device(device).type == "cuda"
