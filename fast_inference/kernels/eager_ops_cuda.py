"""The eager model's RoPE with the cache write, SiLU x up and RMSNorm as CUDA C++ kernels (eager_ops.cu), no Triton: the
"eager ops" operation's other implementation beside eager_ops_triton's, for the cudagraph backend.

Eagerly a block rotates q and k in three kernels, writes the cache in two, gates its feed-forward in two and makes
each of its norms in three (the residual add, F.rms_norm and the weight's product), each costing more to start than
to run. Here they are one kernel each, with the eager ops' roundings (bit for bit), but for RMSNorm's sum of squares,
added in an order of its own (within a rounding of torch's). Built by NVRTC and launched through the driver
(nvrtc.py); the plan asks `builds` (bf16 or float32, sm_90+) first.
"""
import ctypes

import torch

from fast_inference.kernels import nvrtc

THREADS = 256
DTYPES = {torch.bfloat16: 0, torch.float32: 1}


class RopeArgs(ctypes.Structure):  # eager_ops.cu's RopeArgs
    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "k", "v", "freqs", "pos", "q_out", "kc", "vc")] + \
               [(name, ctypes.c_longlong) for name in
                ("sq_b", "sq_s", "sk_b", "sk_s", "sv_b", "sv_s", "sc_b", "sc_h", "sc_s")] + \
               [(name, ctypes.c_int) for name in ("S", "H", "HD")]


class SiluArgs(ctypes.Structure):  # eager_ops.cu's SiluArgs
    _fields_ = [("x", ctypes.c_void_p), ("out", ctypes.c_void_p), ("F", ctypes.c_int)]


class NormArgs(ctypes.Structure):  # eager_ops.cu's NormArgs
    _fields_ = [(name, ctypes.c_void_p) for name in ("x", "delta", "w", "h", "y")] + \
               [("D", ctypes.c_int), ("eps", ctypes.c_float)]


NORM_PER_THREAD = 16  # a row's elements per thread, in registers: rows of up to MAX_D
MAX_D = THREADS * NORM_PER_THREAD
# op -> (the kernel's template, its dtype's argument left open; its Args)
KERNELS = dict(rope=("rope_cache<{}>", RopeArgs), silu=("silu_mul<{}>", SiluArgs),
               norm=(f"rms_norm<{{}}, {THREADS}, {NORM_PER_THREAD}>", NormArgs))


def source(names):
    """eager_ops.cu with an entry point per (name, (kernel, float32)) in `names` (kernel: KERNELS' key)."""
    return nvrtc.cuda_source("eager_ops.cu") + "".join(
        f'extern "C" __global__ void __launch_bounds__({THREADS}) {name}(const {KERNELS[op][1].__name__} a) '
        f"{{ {KERNELS[op][0].format(f32)}(a); }}\n" for name, (op, f32) in names)


def _kernel(device, op, dtype):
    entry = (op, DTYPES[dtype])
    name = "eager_ops_cuda_{}_{}".format(*entry)
    return nvrtc.compiled(device, name, lambda: source([(name, entry)]), 0, "eager_ops.cu")


def builds(device, dtype):
    """Whether every kernel builds for tensors of dtype (bf16 or float32) on device, now (an eager prefill comes
    before any capture)."""
    device = nvrtc.cuda_device(device)
    return (dtype in DTYPES and nvrtc.available(device)
            and all(_kernel(device, op, dtype) is not None for op in KERNELS))


def rope_and_cache(q, k, v, freqs, cache, input_pos):
    """model.rope_and_cache in one kernel: q, k, v (B,S,H,hd) with each token's heads contiguous, freqs (S, hd/2, 2)
    float32 -> q rotated (B,H,S,hd) and the cache's first B rows of keys and values, k rotated and v written at input_pos."""
    B, S, H, hd = q.shape
    assert all(t.stride()[2:] == (hd, 1) for t in (q, k, v)) and freqs.is_contiguous() and hd % 2 == 0
    assert freqs.dtype == torch.float32 and input_pos.dtype == torch.int64 and input_pos.is_contiguous()
    k_cache, v_cache = cache.k_cache[:B], cache.v_cache[:B]
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and k_cache.dtype == q.dtype
    q_out = torch.empty(B, S, H, hd, dtype=q.dtype, device=q.device)
    ptr = nvrtc.ptr
    args = RopeArgs(q=ptr(q), k=ptr(k), v=ptr(v), freqs=ptr(freqs), pos=ptr(input_pos), q_out=ptr(q_out),
                    kc=ptr(k_cache), vc=ptr(v_cache), sq_b=q.stride(0), sq_s=q.stride(1), sk_b=k.stride(0),
                    sk_s=k.stride(1), sv_b=v.stride(0), sv_s=v.stride(1), sc_b=k_cache.stride(0),
                    sc_h=k_cache.stride(1), sc_s=k_cache.stride(2), S=S, H=H, HD=hd)
    nvrtc.launch(_kernel(q.device, "rope", q.dtype), (S, B), THREADS, 0, args, False, q.device)
    return q_out.transpose(1, 2), k_cache, v_cache


def silu_mul(x):
    """F.silu(gate) * up of x (..., 2F) = [gate | up], contiguous, in one kernel."""
    assert x.is_contiguous()
    F = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], F, dtype=x.dtype, device=x.device)
    args = SiluArgs(x=nvrtc.ptr(x), out=nvrtc.ptr(out), F=F)
    nvrtc.launch(_kernel(x.device, "silu", x.dtype), (x.numel() // (2 * F), -(-F // THREADS)), THREADS, 0, args,
                     False, x.device)
    return out


def rms_norm(x, weight, eps, delta=None):
    """model.RMSNorm of x (..., D) contiguous, weight (D,) of x's dtype, D <= MAX_D: its output; with delta (x's shape,
    contiguous) the norm of x + delta instead, and (x + delta, that)."""
    D = x.shape[-1]
    if x.numel() == 0:
        return torch.empty_like(x) if delta is None else (x + delta, torch.empty_like(x))
    assert x.is_contiguous() and D <= MAX_D and weight.shape == (D,) and weight.dtype == x.dtype
    assert delta is None or (delta.shape == x.shape and delta.is_contiguous() and delta.dtype == x.dtype)
    y = torch.empty_like(x)
    h = None if delta is None else torch.empty_like(x)
    ptr = nvrtc.ptr
    args = NormArgs(x=ptr(x), delta=ptr(delta), w=ptr(weight.contiguous()), h=ptr(h), y=ptr(y), D=D, eps=eps)
    nvrtc.launch(_kernel(x.device, "norm", x.dtype), (x.numel() // D,), THREADS, 0, args, False, x.device)
    return y if delta is None else (h, y)
