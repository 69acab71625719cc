"""Decode attention that reads only the filled part of the KV cache (split-KV, Triton).

The static cache is sized for the whole image, but at step p only keys 0..p exist. SDPA over the
static cache reads all of it every step; this kernel reads key block s only if it starts at or
before p (masked loads touch no memory), so the bytes per step follow the filled length. Each
program scores one block of keys for one (row, head) and writes a partial softmax (max, sum,
weighted values); the partials are merged with a few tensor ops that inductor fuses.
Same function as SDPA with the mask rule of model.attention_mask: query p sees key q iff q == p or
(q <= p and key_valid[q]).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the cudagraph/eager backends work without Triton
    triton = None

# Keys per program. Standalone on the H200 (CUDA-graph timed, 64 rows, position 700): 128 -> 96 us,
# 64 -> 120 us, SDPA over the whole cache 110 us (scripts/bench_decode_attention.py).
BLOCK_N = 128


if triton is not None:

    @triton.jit
    def _partial_kernel(Q, K, V, KEY_VALID, POS, M_OUT, L_OUT, ACC_OUT,
                        stride_qr, stride_qh, stride_kr, stride_kh, stride_kn, stride_vr, stride_vh, stride_vn,
                        stride_valid, n_heads, n_blocks,
                        SCALE: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr):
        rh = tl.program_id(0)
        blk = tl.program_id(1)
        r = rh // n_heads
        h = rh % n_heads
        pos = tl.load(POS)
        offs_n = blk * BLOCK + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, HEAD_DIM)
        filled = offs_n <= pos
        ok = tl.load(KEY_VALID + r * stride_valid + offs_n, mask=filled, other=0) != 0
        visible = filled & (ok | (offs_n == pos))
        # SCALE is a constexpr so it stays fp32 (a runtime float becomes fp64 under inductor).
        q = tl.load(Q + r * stride_qr + h * stride_qh + offs_d).to(tl.float32) * SCALE
        k = tl.load(K + r * stride_kr + h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :],
                    mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.where(visible, tl.sum(k * q[None, :], 1), float("-inf"))
        m = tl.max(scores, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # an empty block must not produce NaN
        p = tl.exp(scores - m_safe)
        v = tl.load(V + r * stride_vr + h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :],
                    mask=visible[:, None], other=0.0).to(tl.float32)
        out = rh * n_blocks + blk
        tl.store(M_OUT + out, m)
        tl.store(L_OUT + out, tl.sum(p, 0))
        tl.store(ACC_OUT + out * HEAD_DIM + offs_d, tl.sum(p[:, None] * v, 0))


def decode_attention(q, k_cache, v_cache, key_valid, input_pos, block=BLOCK_N):
    """q (R,H,1,hd); caches (R,H,L,hd); key_valid (R,L) bool; input_pos (1,) -> (R,H,1,hd)."""
    R, H, _, hd = q.shape
    L = k_cache.shape[2]
    n_blocks = triton.cdiv(L, block)
    m = torch.empty(R, H, n_blocks, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    acc = torch.empty(R, H, n_blocks, hd, device=q.device, dtype=torch.float32)
    _partial_kernel[(R * H, n_blocks)](
        q, k_cache, v_cache, key_valid, input_pos, m, l, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), key_valid.stride(0), H, n_blocks,
        SCALE=hd**-0.5, BLOCK=block, HEAD_DIM=hd,
    )
    w = torch.exp(m - m.amax(-1, keepdim=True))  # blocks past the position have m = -inf -> weight 0
    out = (w[..., None] * acc).sum(2) / (w * l).sum(2)[..., None]
    return out[:, :, None, :].to(q.dtype)


def available(device):
    return triton is not None and torch.device(device).type == "cuda"
