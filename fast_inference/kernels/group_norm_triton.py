"""The VQ decoder's GroupNorm (with the SiLU after it, and the bias of the convolution before it), its residual adds
and its nearest upsampling in Triton, for channels-last float32 activations on CUDA: the "group norm" operation.

In eager PyTorch a decoder norm is var_mean over a strided (B, G, C/G, H, W) view, a few ops for the per-channel
scale and shift, addcmul and then SiLU, and every convolution adds its bias in a pass of its own (cuDNN's output,
then a broadcast add that PyTorch does not vectorise in channels-last): 4.5 of a 512 px decode's 9.4 ms on an
H200, where their bytes take about 1 ms. Here a norm is three kernels: each program of the first sums a run of
pixels (every channel, contiguous in channels-last) into per-group partials, shifted by its first tile's mean so
that a large mean costs no precision; the second folds a group's partials (Chan's parallel formula) into its
channels' scale a and shift b; the third writes y = a x + b (and SiLU), as the eager path computes it. The bias
of the convolution before is added to x where it is loaded (the same float32 add as PyTorch's), and a residual
block's last convolution's bias in the residual add's kernel. tests/test_group_norm_triton.py compares them with
torch. vq.py takes them where the plan says (VQModel.use_kernels).
"""
import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _partials_kernel(X, XBIAS, PARTS, HW, per_prog, n_parts, C: tl.constexpr, G: tl.constexpr,
                         BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Program (b, p): pixels [p * per_prog, (p + 1) * per_prog) of image b (plus XBIAS per channel) -> per
        group its count, mean and sum of squared deviations, at PARTS[b, group, 0:3, p]."""
        b, p = tl.program_id(0), tl.program_id(1)
        CG: tl.constexpr = C // G
        chans = tl.arange(0, C)
        start = p * per_prog
        end = tl.minimum(start + per_prog, HW)
        base = X + b.to(tl.int64) * HW * C
        xbias = tl.load(XBIAS + chans) if HAS_BIAS else tl.zeros((C,), tl.float32)
        pix = start + tl.arange(0, BLOCK_P)
        ok = (pix < end)[:, None]
        first = tl.load(base + pix[:, None] * C + chans[None, :], mask=ok, other=0.0)
        if HAS_BIAS:
            first = tl.where(ok, first + xbias[None, :], 0.0)
        n0 = tl.minimum(end - start, BLOCK_P).to(tl.float32)
        # the shift: the first tile's mean per group (padded pixels are zeros, divided by the real count)
        shift = tl.sum(tl.reshape(tl.sum(first, 0), (G, CG)), 1) / (n0 * CG)
        shift_c = tl.reshape(tl.broadcast_to(shift[:, None], (G, CG)), (C,))
        d = tl.where(ok, first - shift_c[None, :], 0.0)
        s1 = tl.sum(d, 0)
        s2 = tl.sum(d * d, 0)
        for off in range(start + BLOCK_P, end, BLOCK_P):  # the tiles after the first, already in registers
            pix = off + tl.arange(0, BLOCK_P)
            ok = (pix < end)[:, None]
            x = tl.load(base + pix[:, None] * C + chans[None, :], mask=ok, other=0.0)
            if HAS_BIAS:
                x = x + xbias[None, :]
            d = tl.where(ok, x - shift_c[None, :], 0.0)
            s1 += tl.sum(d, 0)
            s2 += tl.sum(d * d, 0)
        n = (end - start).to(tl.float32) * CG
        g1 = tl.sum(tl.reshape(s1, (G, CG)), 1)
        g2 = tl.sum(tl.reshape(s2, (G, CG)), 1)
        out = PARTS + (b * G + tl.arange(0, G)) * 3 * n_parts + p
        tl.store(out, tl.zeros((G,), tl.float32) + n)
        tl.store(out + n_parts, shift + g1 / n)
        tl.store(out + 2 * n_parts, g2 - g1 * g1 / n)

    @triton.jit
    def _scale_shift_kernel(PARTS, W, BIAS, AB, n_parts, eps, C: tl.constexpr, G: tl.constexpr,
                            P: tl.constexpr):
        """Program (b, g): group g's n_parts <= P partials of image b -> a = rsqrt(var + eps) * weight and
        b = bias - mean * a for its channels."""
        b, g = tl.program_id(0), tl.program_id(1)
        CG: tl.constexpr = C // G
        first = PARTS + (b * G + g) * 3 * n_parts
        parts = tl.arange(0, P)
        ok = parts < n_parts
        n = tl.load(first + parts, mask=ok, other=0.0)
        m = tl.load(first + n_parts + parts, mask=ok, other=0.0)
        total = tl.sum(n, 0)
        mean = tl.sum(n * m, 0) / total
        m2 = tl.sum(tl.load(first + 2 * n_parts + parts, mask=ok, other=0.0) + n * (m - mean) * (m - mean), 0)
        rstd = 1.0 / tl.sqrt(m2 / total + eps)
        chans = g * CG + tl.arange(0, CG)
        a = rstd * tl.load(W + chans)
        tl.store(AB + b * 2 * C + chans, a)
        tl.store(AB + b * 2 * C + C + chans, tl.load(BIAS + chans) - mean * a)

    @triton.jit
    def _apply_kernel(X, XBIAS, AB, Y, HW, C: tl.constexpr, BLOCK_P: tl.constexpr, SILU: tl.constexpr,
                      HAS_BIAS: tl.constexpr):
        b, p = tl.program_id(0), tl.program_id(1)
        chans = tl.arange(0, C)
        a = tl.load(AB + b * 2 * C + chans)
        s = tl.load(AB + b * 2 * C + C + chans)
        pix = p * BLOCK_P + tl.arange(0, BLOCK_P)
        at = b.to(tl.int64) * HW * C + pix[:, None] * C + chans[None, :]
        ok = (pix < HW)[:, None]
        x = tl.load(X + at, mask=ok)
        if HAS_BIAS:
            x = x + tl.load(XBIAS + chans)[None, :]
        y = x * a[None, :] + s[None, :]
        if SILU:
            y = y / (1.0 + tl.exp(-y))
        tl.store(Y + at, y, mask=ok)

    @triton.jit
    def _upsample_kernel(X, Y, n_pix, W, C: tl.constexpr, BLOCK_P: tl.constexpr):
        """Nearest 2x upsampling, channels-last: input pixel (b, i, j) of a (B, H, W) grid, flat p = (b H + i) W + j,
        to output pixels (b, 2 i + di, 2 j + dj), whose flat index is (2 (b H + i) + di) 2 W + 2 j + dj."""
        p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        ok = (p < n_pix)[:, None]
        chans = tl.arange(0, C)[None, :]
        x = tl.load(X + p[:, None].to(tl.int64) * C + chans, mask=ok)
        first = (2 * (p // W)) * (2 * W) + 2 * (p % W)
        for di in tl.static_range(2):
            for dj in tl.static_range(2):
                tl.store(Y + (first + di * 2 * W + dj)[:, None].to(tl.int64) * C + chans, x, mask=ok)

    @triton.jit
    def _residual_kernel(X, H, HBIAS, Y, n, C: tl.constexpr, BLOCK: tl.constexpr):
        """Y = X + (H + HBIAS per channel), channels-last (the channel is the index modulo C)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        h = tl.load(H + offs, mask=ok) + tl.load(HBIAS + offs % C, mask=ok)
        tl.store(Y + offs, tl.load(X + offs, mask=ok) + h, mask=ok)


MAX_PARTS = 512  # partials per image and group, all folded at once by _scale_shift_kernel


def supported(x, num_groups=1):
    """The layouts these kernels take: channels-last float32 on CUDA, C a power of two <= 1024 (the plan chose Triton
    for the VQ decoder; a tensor it cannot take goes through torch's ops)."""
    C = x.shape[1]
    return (triton is not None and x.is_cuda and x.dtype == torch.float32 and x.dim() == 4
            and x.is_contiguous(memory_format=torch.channels_last) and C % num_groups == 0
            and C & (C - 1) == 0 and num_groups & (num_groups - 1) == 0 and C <= 1024)


def group_norm(x, num_groups, weight, bias, eps, silu=False, x_bias=None):
    """GroupNorm of x + x_bias (per channel, if given) for x (B, C, H, W) channels-last float32 on CUDA
    (`supported`), then SiLU if silu."""
    B, C, H, W = x.shape
    HW = H * W
    block_p = max(1, 4096 // C)  # a tile of 4,096 values
    # up to MAX_PARTS programs per image: a few per SM keep enough loads in flight to stream at the memory's rate
    per_prog = max(block_p, triton.cdiv(triton.cdiv(HW, MAX_PARTS), block_p) * block_p)
    n_parts = triton.cdiv(HW, per_prog)
    has_bias = x_bias is not None
    x_bias = x_bias if has_bias else weight  # not read
    parts = torch.empty(B, num_groups, 3, n_parts, device=x.device, dtype=torch.float32)
    _partials_kernel[(B, n_parts)](x, x_bias, parts, HW, per_prog, n_parts, C=C, G=num_groups, BLOCK_P=block_p,
                                   HAS_BIAS=has_bias)
    ab = torch.empty(B, 2, C, device=x.device, dtype=torch.float32)
    _scale_shift_kernel[(B, num_groups)](parts, weight, bias, ab, n_parts, eps, C=C, G=num_groups,
                                         P=triton.next_power_of_2(n_parts))
    y = torch.empty_like(x)  # channels-last, as x
    _apply_kernel[(B, triton.cdiv(HW, block_p))](x, x_bias, ab, y, HW, C=C, BLOCK_P=block_p, SILU=silu,
                                                 HAS_BIAS=has_bias)
    return y


def residual(x, h, h_bias):
    """x + (h + h_bias per channel): a residual block's output, h its last convolution's output without the bias."""
    if not (supported(x) and supported(h) and x.shape == h.shape):
        return x + (h + h_bias.view(1, -1, 1, 1))
    y = torch.empty_like(x)
    block = 4096
    _residual_kernel[(triton.cdiv(x.numel(), block),)](x, h, h_bias, y, x.numel(), C=x.shape[1], BLOCK=block)
    return y


def upsample(x):
    """F.interpolate(x, scale_factor=2, mode="nearest"), the same values: PyTorch's channels-last kernel took ~0.36 ms of
    a 512 px decode on an H200 for ~0.08 ms of bytes."""
    if not supported(x):
        return F.interpolate(x, scale_factor=2.0, mode="nearest")
    B, C, H, W = x.shape
    y = torch.empty(B, C, 2 * H, 2 * W, device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    block_p = max(1, 4096 // C)
    _upsample_kernel[(triton.cdiv(B * H * W, block_p),)](x, y, B * H * W, W, C=C, BLOCK_P=block_p)
    return y

