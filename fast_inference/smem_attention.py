"""The cudagraph backend's decode attention as a CUDA C++ kernel under PDL (smem_attention.cu), no Triton.

At one token per step SDPA reads the cache window and launches without PDL, so the output projection after it cannot
stage its weights while it runs (cuDNN's SDPA and its reduction: 9.2 us per layer at n = 1 on the H200, PERF_NOTES
#68). Here SPLITS programs per (row, head) each take a slice of the filled keys only, stage the keys and values of
earlier steps in shared memory before the PDL wait, and merge their partials in the last program to finish; the next
kernel launches right after the wait. The same function as decode_attention.py's Triton kernels (the mask rule of
model.attention_mask: query p sees key q iff q == p or q <= p and key_valid[q]), and as they do the text prefix's
keys (zero: RoPE's zero rows) as one partial, their values' sum and count made after each prefill, not read.

Built by NVRTC and launched through the driver as smem_gemv's kernels (its `compiled` and `launch`), for the
cudagraph backend where smem_gemv runs the block's projections (q rotated, the step's key and value already in the
caches): the engine asks `builds` before it captures a step, else SDPA runs. The same backend's eager blocks (past
smem_gemv's rows) take it too, with their projection's q, k and v before RoPE (`fresh`: the kernel rotates them and
writes the cache, where a kernel of its own did before), past LOOP_ROWS as attend_loop, whose programs loop over
their slices with loads in flight instead of staging them whole.
"""
import ctypes
import os

import torch

from fast_inference import smem_gemv

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smem_attention.cu")
WARPS = 4
# Keys per program at most: the cache's length over SLICE programs per (row, head) (GPT-XL 512 px: 8). H200,
# `python scripts/engine_ab.py --backend cudagraph --batch-sizes 1,2` (PERF_NOTES #69), ms/step at n = 1 / 2: SLICE
# 144 1.343-1.355 / 1.862-1.871, 96 1.367 / 1.874-1.889, 192 1.366 / 1.886-1.899, 288 1.370 / 1.874, 576 1.447 /
# 2.165 (SDPA: 1.46 / 1.96).
SLICE = 144
# Past LOOP_ROWS rows (the cudagraph backend's eager blocks) attend_loop instead: the programs loop over their slices,
# U keys a trip per group of lanes, LOOP_WARPS warps a program, about PER_SM programs per SM (the splits per (row,
# head) from that, at most MAX_SPLITS). Whole slices staged lost to cuDNN's SDPA there (PERF_NOTES, the row before #76).
LOOP_ROWS = 4
LOOP_WARPS, U, PER_SM, MAX_SPLITS = 4, 4, 4, 16
# U = 2 (before the text's partial) gained ~1% up to 32 rows and lost 4.5% at 64; with the text as one partial it ties
# at 16 rows and loses at 32 and 64 (H200, a process per setting: PERF_NOTES #81, #83)
# The engine's eager blocks (the cudagraph backend past smem_gemv's rows) take it at every row count, where SDPA ran
# over the cache windows before: H200, `python fast_inference/bench.py --random-weights --backend cudagraph
# --batch-sizes 16` with FAST_SMEM_ATTENTION=0 / 1: n = 16 (32 rows) 2.91 -> 2.65 ms/step (PERF_NOTES #77);
# `python scripts/engine_ab.py --process-per-setting --backend cudagraph --batch-sizes 4,8` with SDPA below 32 rows
# against this (PERF_NOTES #78): n = 4 1.984 / 1.985 -> 1.975 / 1.976, n = 8 2.442 / 2.442 -> 2.425 / 2.425, and the
# same seed the same tokens from process to process, which cuDNN's SDPA plans do not give. (#77's loss at n = 4 was
# the one-process A/B's: its first setting's captures ran faster.)
ENABLED = os.environ.get("FAST_SMEM_ATTENTION", "1") != "0"
MAX_HEADS = 4096  # rows x heads: the counts' length


class Args(ctypes.Structure):  # smem_attention.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "kc", "vc", "valid", "pos", "out", "part", "count")] + \
               [("sr", ctypes.c_longlong), ("sh", ctypes.c_longlong), ("sv", ctypes.c_longlong),
                ("heads", ctypes.c_int), ("span", ctypes.c_int), ("scale", ctypes.c_float), ("tlen", ctypes.c_int),
                ("tsum", ctypes.c_void_p), ("tcount", ctypes.c_void_p), ("fk", ctypes.c_void_p),
                ("fv", ctypes.c_void_p), ("freqs", ctypes.c_void_p), ("sq", ctypes.c_longlong)]


def source(names):
    """smem_attention.cu with an entry point per (name, (form, head dim, warps, x)) in `names`: form "attend" (x: pdl)
    or "loop" (x: U)."""
    body = dict(attend="attend<{}, {}, {}>", loop="attend_loop<{}, {}, {}>")
    return smem_gemv.cuda_source(SOURCE) + "".join(
        f'extern "C" __global__ void __launch_bounds__({nw * 32}) {name}(const Args a) '
        f"{{ {body[form].format(hd, nw, x)}(a); }}\n" for name, (form, hd, nw, x) in names)


def _kernel(device, head_dim, loop=False):
    entry = ("loop", head_dim, LOOP_WARPS, U) if loop else ("attend", head_dim, WARPS, smem_gemv.PDL)
    name = "smem_attention_" + "_".join(map(str, entry))
    return smem_gemv.compiled(device, name, lambda: source([(name, entry)]), smem_gemv.MAX_SMEM,
                              "smem_attention.cu")


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
    """attend_loop's programs per (row, head) for `heads` (rows x heads): about PER_SM programs per SM in all."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLITS, round(PER_SM * sms / heads)))


_counts = {}  # per device: each (row, head)'s programs done, zero between calls


def _counts_for(device):
    if device not in _counts:
        _counts[device] = torch.zeros(MAX_HEADS, dtype=torch.int32, device=device)
    return _counts[device]


def builds(attention, max_seq, rows, device):
    """Whether the decode attention of `attention` (a model Attention) at the row counts in `rows` runs here, over
    caches of max_seq positions: enabled, bf16 weights (so caches), smem_gemv available (sm_90+, NVRTC), a head dim of
    64, 128 or 256, the slices within a program's shared memory, and the kernels for those rows (attend up to
    LOOP_ROWS, attend_loop past them) built now, before any step is captured."""
    device = smem_gemv.cuda_device(device)
    hd, heads = attention.head_dim, attention.n_head
    bf16 = attention.wqkv.weight.dtype == torch.bfloat16
    if not (ENABLED and bf16 and smem_gemv.available(device) and hd in (64, 128, 256)):
        return False
    if max(rows) * heads > MAX_HEADS or _smem(_span(max_seq, splits(max_seq)), hd) > smem_gemv.MAX_SMEM:
        return False
    _counts_for(device)  # made before any capture, so that it persists
    return all(_kernel(device, hd, loop) is not None for loop in {r > LOOP_ROWS for r in rows})


def decode_attention(q, k_cache, v_cache, key_valid, input_pos, fresh=None, text=None):
    """q (R, H, 1, hd); caches (>= R, H, L, hd) bf16; key_valid (R, L) bool -> (R, H, 1, hd). fresh: None (q is
    rotated and the caches hold the step's key and value at input_pos (1,)) or (k, v, freqs): the step's key and value
    (R, H, 1, hd) as q before RoPE, and the position's RoPE row (1, hd / 2, 2) float32; the kernel then rotates q and
    k and writes k and v to the caches (the model's rope_and_cache, in the same roundings). text: None or (sums,
    counts, T) from decode_attention.text_sums, the first T keys (zero: RoPE's zero rows) as one partial, not read.
    model.forward's decode_attention, as decode_attention.py's: `builds` is asked first."""
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
    loop = R > LOOP_ROWS
    n = loop_splits(R * H, q.device) if loop else splits(L - T)
    span = _span(L - T, n)
    out = torch.empty(R, H, 1, hd, device=q.device, dtype=q.dtype)
    part = torch.empty(R * H, n, hd + 2, device=q.device, dtype=torch.float32)
    ptr = smem_gemv._ptr
    args = Args(q=ptr(q), kc=ptr(k_cache), vc=ptr(v_cache), valid=ptr(key_valid), pos=ptr(input_pos),
                out=ptr(out), part=ptr(part), count=ptr(_counts_for(q.device)), sr=k_cache.stride(0),
                sh=k_cache.stride(1), sv=key_valid.stride(0), heads=H, span=span, scale=hd ** -0.5, tlen=T,
                tsum=ptr(tsum), tcount=ptr(tcount), fk=ptr(k), fv=ptr(v), freqs=ptr(freqs), sq=q.stride(0))
    if loop:  # after the eager block's cuBLAS GEMM, which has no PDL: launched plainly
        smem_gemv.launch(_kernel(q.device, hd, True), (n, R * H), LOOP_WARPS * 32, _loop_smem(hd), args, False,
                         q.device)
    else:
        smem_gemv.launch(_kernel(q.device, hd), (n, R * H), WARPS * 32, _smem(span, hd), args, True, q.device)
    return out


decode_attention.text = True  # the engine's Sampler makes the text partial for it (torch's ops, no Triton)
