"""The eager model's RoPE + cache write and SwiGLU as one Triton kernel each, on CUDA, bit for bit torch's ops: the
"eager ops" operation's Triton implementation (eager_ops_cuda.py is the other).

Eagerly a block rotates q and k in three kernels (the broadcast products, their sum, the cast), writes the cache in
two more (index_copy_ of k and of v) and gates its feed-forward in two (SiLU, then the product). The fast engine
captures the eager prefill in a CUDA graph, where GPT-XL's 36 blocks make ~850 small kernels that each cost more to
start than to run. Here those seven are two, computing the same roundings: each rotated element is
fl(fl(x0 c) + fl(x1 (-s))) in float32 with fused multiply-adds off, as the eager rotation rounds; SiLU is
x / (1 + exp(-x)) with CUDA's expf (libdevice) and an IEEE division, as PyTorch's kernel, rounded to the model's dtype
before the product. Not where a compiler traces the model (inductor fuses these itself: the plan passes none there).
tests/test_eager_ops_triton.py and tests/test_eager_ops_cuda.py check them against the eager ops.
"""
import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _rotate(x, c, s, HP: tl.constexpr, HALF: tl.constexpr):
        """Adjacent pairs of x (HP, 2 HALF) rotated by (c, s) (HALF,): (x0 c + x1 (-s), x0 s + x1 c) in float32."""
        x0, x1 = tl.split(tl.reshape(x.to(tl.float32), (HP, HALF, 2)))  # (the products rounded: no FMA at launch)
        return tl.interleave(x0 * c[None, :] + x1 * (-s[None, :]), x0 * s[None, :] + x1 * c[None, :])

    @triton.jit
    def _rope_cache_kernel(Q, K, V, FREQS, POS, QOUT, KC, VC, S, sq_b, sq_s, sk_b, sk_s, sv_b, sv_s, sc_b, sc_h,
                           sc_s, H: tl.constexpr, HP: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr):
        """Program (b, s): token s of row b, every head. QOUT[b, s] = q rotated; KC[b, :, POS[s]] = k rotated,
        VC[b, :, POS[s]] = v. FREQS (S, HD/2, 2): the token's (cos, sin) pairs. HP, HDP: H and HD to powers of 2."""
        b, s = tl.program_id(0), tl.program_id(1)
        HALF: tl.constexpr = HDP // 2
        h = tl.arange(0, HP)[:, None]
        d = tl.arange(0, HDP)[None, :]
        ok = (h < H) & (d < HD)
        f = tl.arange(0, HDP)
        c, sn = tl.split(tl.reshape(tl.load(FREQS + s * HD + f, mask=f < HD), (HALF, 2)))
        pos = tl.load(POS + s)
        q = tl.load(Q + b * sq_b + s * sq_s + h * HD + d, mask=ok)
        tl.store(QOUT + ((b * S + s) * H + h) * HD + d, _rotate(q, c, sn, HP, HALF).to(q.dtype), mask=ok)
        k = tl.load(K + b * sk_b + s * sk_s + h * HD + d, mask=ok)
        cache = b * sc_b + h * sc_h + pos * sc_s + d
        tl.store(KC + cache, _rotate(k, c, sn, HP, HALF).to(k.dtype), mask=ok)
        tl.store(VC + cache, tl.load(V + b * sv_b + s * sv_s + h * HD + d, mask=ok), mask=ok)

    @triton.jit
    def _silu_mul_kernel(X, OUT, F, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        """Row m of X (M, 2F) as [gate | up] -> OUT[m] = SiLU(gate) (rounded to the dtype) * up."""
        m, f = tl.program_id(0), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = f < F
        row = X + m.to(tl.int64) * 2 * F
        g = tl.load(row + f, mask=ok).to(tl.float32)
        up = tl.load(row + F + f, mask=ok)
        e = libdevice.exp(-g) if EXACT else tl.exp(-g)
        silu = tl.math.div_rn(g, 1.0 + e).to(up.dtype)
        tl.store(OUT + m.to(tl.int64) * F + f, (silu.to(tl.float32) * up.to(tl.float32)).to(up.dtype), mask=ok)


def rope_and_cache(q, k, v, freqs, cache, input_pos):
    """model.rope_and_cache in one kernel: q, k, v (B,S,H,hd) with each token's heads contiguous (the QKV
    projection's split), freqs (S, hd/2, 2) float32 -> q rotated (B,H,S,hd) and the cache's first B rows of keys and
    values, k rotated and v written at input_pos."""
    B, S, H, hd = q.shape
    assert all(t.stride()[2:] == (hd, 1) for t in (q, k, v)) and freqs.is_contiguous() and hd % 2 == 0
    k_cache, v_cache = cache.k_cache[:B], cache.v_cache[:B]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    q_out = torch.empty(B, S, H, hd, dtype=q.dtype, device=q.device)
    _rope_cache_kernel[(B, S)](q, k, v, freqs, input_pos, q_out, k_cache, v_cache, S, q.stride(0), q.stride(1),
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3], H=H,
                               HP=triton.next_power_of_2(H), HD=hd, HDP=triton.next_power_of_2(hd), num_warps=4,
                               enable_fp_fusion=False)
    return q_out.transpose(1, 2), k_cache, v_cache


def silu_mul(x):
    """F.silu(gate) * up of x (..., 2F) = [gate | up], contiguous, in one kernel. Triton's interpreter (CPU tensors)
    has no libdevice: there the kernel takes tl.exp (numpy's), which the CPU tests compare."""
    assert x.is_contiguous()
    F2 = x.shape[-1]
    out = torch.empty(*x.shape[:-1], F2 // 2, dtype=x.dtype, device=x.device)
    M, block = x.numel() // F2, 1024
    _silu_mul_kernel[(M, triton.cdiv(F2 // 2, block))](x, out, F2 // 2, BLOCK=block, EXACT=x.is_cuda,
                                                         num_warps=4)
    return out
