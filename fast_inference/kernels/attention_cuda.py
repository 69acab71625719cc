"""The decode attention as a CUDA C++ kernel under PDL (attention.cu), no Triton: the "attention" operation's other
implementation beside attention_triton's, for the cudagraph backend.

At one token per step SDPA reads the cache window and launches without PDL, so the output projection after it cannot
stage its weights while it runs. Here several programs per (row, head) each take a slice of the filled keys only,
stage the keys and values of earlier steps in shared memory before the PDL wait, and merge their partials in the last
program to finish; the next kernel launches right after the wait. The same function as attention_triton's kernels
(the mask rule of model.attention_mask), and as they do the text prefix's keys (zero: RoPE's zero rows) as one
partial, their values' sum and count made after each prefill, not read. Past a few rows (the plan's CUDA_LOOP_ROWS)
the form that loops over its slices with loads in flight (`loop`) instead of staging them whole.

Built by NVRTC and launched through the driver (nvrtc.py); the plan asks `fits` and `builds` before it takes it.
"""
import ctypes

import torch

from fast_inference.kernels import nvrtc

WARPS = 4
PDL = 1  # the staging form lets the next kernel launch right after its wait (EARLY)
SLICE = 144  # keys per program at most (docs/PERF_NOTES.md #69)
LOOP_WARPS, U, PER_SM, MAX_SPLITS = 4, 4, 4, 16  # the loop form: warps, keys a trip per lane group, programs per SM
MAX_HEADS = 4096  # rows x heads: the counts' length


class Args(ctypes.Structure):  # attention.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "kc", "vc", "valid", "pos", "out", "part", "count")] + \
               [("sr", ctypes.c_longlong), ("sh", ctypes.c_longlong), ("sv", ctypes.c_longlong),
                ("heads", ctypes.c_int), ("span", ctypes.c_int), ("scale", ctypes.c_float), ("tlen", ctypes.c_int),
                ("tsum", ctypes.c_void_p), ("tcount", ctypes.c_void_p), ("fk", ctypes.c_void_p),
                ("fv", ctypes.c_void_p), ("freqs", ctypes.c_void_p), ("sq", ctypes.c_longlong)]


def source(names):
    """attention.cu with an entry point per (name, (form, head dim, warps, x)) in `names`: form "attend" (x: pdl)
    or "loop" (x: U)."""
    body = dict(attend="attend<{}, {}, {}>", loop="attend_loop<{}, {}, {}>")
    return nvrtc.cuda_source("attention.cu") + "".join(
        f'extern "C" __global__ void __launch_bounds__({nw * 32}) {name}(const Args a) '
        f"{{ {body[form].format(hd, nw, x)}(a); }}\n" for name, (form, hd, nw, x) in names)


def _kernel(device, head_dim, loop=False):
    entry = ("loop", head_dim, LOOP_WARPS, U) if loop else ("attend", head_dim, WARPS, PDL)
    name = "attention_cuda_" + "_".join(map(str, entry))
    return nvrtc.compiled(device, name, lambda: source([(name, entry)]), nvrtc.MAX_SMEM, "attention.cu")


def splits(length):
    """Programs per (row, head) over a cache of `length` positions."""
    return max(1, -(-length // SLICE))


def _span(length, n):
    """Keys a program holds at most: the cache's length over n slices, a multiple of 4 (the scores after them)."""
    return -(-(-(-length // n)) // 4) * 4


def _smem(span, head_dim):
    return 128 + 2 * span * head_dim * 2 + span * 4 + WARPS * head_dim * 4


def _loop_smem(head_dim):
    return 128 + LOOP_WARPS * 32 // (head_dim // 8) * (head_dim + 2) * 4


def loop_splits(heads, device):
    """The loop form's programs per (row, head) for `heads` (rows x heads): about PER_SM programs per SM in all."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, round(PER_SM * sms / heads)))


_counts = {}  # per device: each (row, head)'s programs done, zero between calls


def _counts_for(device):
    if device not in _counts:
        _counts[device] = torch.zeros(MAX_HEADS, dtype=torch.int32, device=device)
    return _counts[device]


def fits(head_dim, n_head, rows, max_seq):
    """Whether steps of up to `rows` rows over caches of max_seq positions fit: a head dim of 64, 128 or 256, the
    counts, and a slice within a program's shared memory."""
    return (head_dim in (64, 128, 256) and rows * n_head <= MAX_HEADS
            and _smem(_span(max_seq, splits(max_seq)), head_dim) <= nvrtc.MAX_SMEM)


def builds(device, head_dim, loop):
    """Whether the form (loop or not) builds on device: built now, before any capture (its counts made too)."""
    device = nvrtc.cuda_device(device)
    if not nvrtc.available(device) or _kernel(device, head_dim, loop) is None:
        return False
    _counts_for(device)  # made before any capture, so that it persists
    return True


def decode_attention(q, k_cache, v_cache, key_valid, input_pos, fresh=None, text=None, loop=False):
    """q (R, H, 1, hd); caches (>= R, H, L, hd) bf16; key_valid (R, L) bool -> (R, H, 1, hd). fresh: None (q is
    rotated and the caches hold the step's key and value at input_pos (1,)) or (k, v, freqs): the step's key and value
    (R, H, 1, hd) as q before RoPE, and the position's RoPE row (1, hd / 2, 2) float32; the kernel then rotates q and
    k and writes k and v to the caches (the model's rope_and_cache, in the same roundings). text: None or (sums,
    counts, T) from attention_triton.text_sums, the first T keys (zero: RoPE's zero rows) as one partial, not read.
    loop: the looping form (many rows), launched plainly (after the eager block's cuBLAS GEMM, which has no PDL)."""
    R, H, _, hd = q.shape
    L = k_cache.shape[2]
    assert k_cache.stride()[2:] == (hd, 1) and v_cache.stride() == k_cache.stride() and key_valid.dtype == torch.bool
    assert key_valid.stride(1) == 1 and q.dtype == k_cache.dtype == torch.bfloat16 and input_pos.dtype == torch.int64
    k, v, freqs = (None, None, None) if fresh is None else fresh
    if q.stride(1) != hd or q.stride(3) != 1:
        q = q.contiguous()
    assert fresh is None or (k.stride() == v.stride() == q.stride() and freqs.dtype == torch.float32
                             and freqs.is_contiguous() and freqs.numel() == hd)
    tsum, tcount, T = (None, None, 0) if text is None else text
    assert T == 0 or (tsum.dtype == tcount.dtype == torch.float32 and tsum.is_contiguous()
                      and tsum.shape[1:] == (H, hd))
    n = loop_splits(R * H, q.device) if loop else splits(L - T)
    span = _span(L - T, n)
    out = torch.empty(R, H, 1, hd, device=q.device, dtype=q.dtype)
    part = torch.empty(R * H, n, hd + 2, device=q.device, dtype=torch.float32)
    ptr = nvrtc.ptr
    args = Args(q=ptr(q), kc=ptr(k_cache), vc=ptr(v_cache), valid=ptr(key_valid), pos=ptr(input_pos),
                out=ptr(out), part=ptr(part), count=ptr(_counts_for(q.device)), sr=k_cache.stride(0),
                sh=k_cache.stride(1), sv=key_valid.stride(0), heads=H, span=span, scale=hd ** -0.5, tlen=T,
                tsum=ptr(tsum), tcount=ptr(tcount), fk=ptr(k), fv=ptr(v), freqs=ptr(freqs), sq=q.stride(0))
    if loop:
        nvrtc.launch(_kernel(q.device, hd, True), (n, R * H), LOOP_WARPS * 32, _loop_smem(hd), args, False,
                     q.device)
    else:
        nvrtc.launch(_kernel(q.device, hd), (n, R * H), WARPS * 32, _smem(span, hd), args, True, q.device)
    return out
