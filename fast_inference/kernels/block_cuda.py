"""The fused block's GEMV projections (one token, <= 4 rows, bf16 weights, sm_90 and later) as CUDA C++ kernels whose
weights are staged in shared memory before the PDL wait (block.cu): the "block" operation's other implementation
beside block_triton's.

Triton holds a GEMV's weights in registers, so only as many programs as the register file holds can load theirs
before the kernel before them has finished; shared memory holds more, and bulk copies fill it without registers.
Built by NVRTC and launched through the driver (nvrtc.py), so that a CUDA graph captures them as it does Triton's.
They compute block_triton's roundings. The plan says which projections run here (plan.py: gate/up beside Triton's
kernels; all four on the cudagraph backend, which has no Triton) and how they launch; `fits` and `builds` are what it
asks first.
"""
import ctypes

import torch

from fast_inference.kernels import nvrtc

# (warps, output columns per warp) per kernel (docs/PERF_NOTES.md #67, #74, #75)
CONFIG = dict(qkv=(4, 4), wo=(2, 2), gate_up=(8, 4), w2=(4, 1))
MAX_ROWS = 4  # rows of x held per program
KINDS = dict(linear=0, linear_add=1, gate_up=2, qkv=3)  # block.cu's EPI


class Args(ctypes.Structure):  # block.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("w", "x", "norm", "res", "add", "out", "freqs", "pos", "kc", "vc", "progress")] + \
               [("sr", ctypes.c_longlong), ("sh", ctypes.c_longlong), ("sn", ctypes.c_longlong), ("n", ctypes.c_int),
                ("hd", ctypes.c_int), ("eps", ctypes.c_float)]


def source(names):
    """block.cu with an entry point per (name, (kind, K, warps, columns per warp, rows, pdl)) in `names`."""
    return nvrtc.cuda_source("block.cu") + "".join(
        f'extern "C" __global__ void __launch_bounds__({nw * 32}) {name}(const Args a) '
        f"{{ project<{kind}, {k}, {nw}, {rpw}, {xr}, {pdl}>(a); }}\n" for name, (kind, k, nw, rpw, xr, pdl) in names)


def entry(name, k, rows, pdl, add=False):
    """The instantiation of projection `name` (CONFIG's tiling) over K = k at `rows` rows, launched in PDL mode pdl
    (0: none): (kind, K, warps, columns per warp, rows, pdl). add: w2 with the control rows added (linear_add)."""
    kind = name if name in ("qkv", "gate_up") else "linear_add" if add else "linear"
    return (KINDS[kind], k, *CONFIG[name], rows, int(pdl))


def smem(e):
    kind, k, nw, rpw, xr, _ = e
    return 128 + nw * rpw * (2 if kind == KINDS["gate_up"] else 1) * k * 2 + xr * k * 2


def fits(name, rows, k, columns):
    """Whether projection `name` tiles x (rows, k) into `columns` output columns: at most MAX_ROWS rows, K a multiple
    of 256, the columns a whole number of programs, and the weights and x within a program's shared memory (GPT-1B's
    gate/up, K = 2,048, would ask for 264 KB, which the driver refuses)."""
    nw, rpw = CONFIG[name]
    return (rows <= MAX_ROWS and k % 256 == 0 and columns % (nw * rpw) == 0
            and smem(entry(name, k, rows, 0)) <= nvrtc.MAX_SMEM)


def fits_heads(head_dim):
    """The QKV kernel writes whole heads: the head dim a multiple of its columns per warp."""
    return head_dim % CONFIG["qkv"][1] == 0


def _kernel(device, e):
    name = "block_cuda_" + "_".join(map(str, e))
    return nvrtc.compiled(device, name, lambda: source([(name, e)]), smem(e), "block.cu")


def builds(device, e):
    """Whether instantiation e builds on device (NVRTC, the driver): built now, before any capture."""
    return nvrtc.available(device) and _kernel(device, e) is not None


def _launch(e, columns, args, device):
    _, _, nw, rpw, _, pdl = e
    nvrtc.launch(_kernel(device, e), (columns // (nw * rpw),), nw * 32, smem(e), args, pdl, device)


def linear(x, weight, residual, name, pdl, then=None, progress=None):
    """residual + x @ weight.T (+ then), as block_triton.linear, for x (R, K) bf16 contiguous; pdl: the launch mode."""
    R, K = x.shape
    N = weight.shape[0]
    out = torch.empty(R, N, device=x.device, dtype=x.dtype)
    ptr = nvrtc.ptr
    args = Args(w=ptr(weight), x=ptr(x), res=ptr(residual), add=ptr(then), out=ptr(out), progress=ptr(progress), n=N)
    _launch(entry(name, K, R, pdl, add=then is not None), N, args, x.device)
    return out


def gate_up(x, norm, w13, pdl, progress=None):
    """SiLU(g) * u for [g | u] = RMSNorm(x) @ w13.T, as block_triton.gate_up."""
    R, K = x.shape
    F = w13.shape[0] // 2
    out = torch.empty(R, F, device=x.device, dtype=x.dtype)
    ptr = nvrtc.ptr
    args = Args(w=ptr(w13), x=ptr(x), norm=ptr(norm.weight), out=ptr(out), progress=ptr(progress), n=F,
                eps=norm.eps)
    _launch(entry("gate_up", K, R, pdl), F, args, x.device)
    return out


def qkv_rope(x, norm, weight, freqs, input_pos, k_cache, v_cache, n_head, pdl, progress=None):
    """q (R, H, 1, hd), k and v written into the caches at input_pos, as block_triton.qkv_rope (the RoPE row float32,
    input_pos int64)."""
    R, D = x.shape
    hd = D // n_head
    assert freqs.dtype == torch.float32 and input_pos.dtype == torch.int64
    q = torch.empty(R, n_head, 1, hd, device=x.device, dtype=x.dtype)
    ptr = nvrtc.ptr
    args = Args(w=ptr(weight), x=ptr(x), norm=ptr(norm.weight), out=ptr(q), freqs=ptr(freqs),
                pos=ptr(input_pos), kc=ptr(k_cache), vc=ptr(v_cache), progress=ptr(progress),
                sr=k_cache.stride(0), sh=k_cache.stride(1), sn=k_cache.stride(2), n=3 * D, hd=hd, eps=norm.eps)
    _launch(entry("qkv", D, R, pdl), 3 * D, args, x.device)
    return q
