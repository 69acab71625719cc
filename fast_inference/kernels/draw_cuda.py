"""The draw as one CUDA C++ kernel (draw.cu), no Triton: the "draw" operation's other implementation beside
draw_triton's, for the cudagraph backend.

Without it that backend draws with sampling.py's ops: ~20 small kernels per step around PyTorch's top-k (its radix
select alone ~30 us at n = 1 on the H200, PERF_NOTES #69's profile). Here one kernel does the CFG merge, the
temperature, top-k and the exponential race in sampling.py's float32 roundings (a few programs per image make the
race's scores, the last of them decides), writes the token where the step needs it and advances the position:
draw_triton.draw's contract, with the race's noise from its own Philox (the same distribution, another random
stream). Built by NVRTC and launched through the driver (nvrtc.py); the plan asks `fits` and `builds` first.
"""
import ctypes

import torch

from fast_inference.kernels import nvrtc

THREADS = 512
MAX_PER = 32  # logits per thread at most, held by the deciding program: vocabularies up to 16,384 (past it, spills)
PER = 4  # logits per thread of each program's scores (one Philox call): GPT-XL's 16,384 over 8 programs an image


class Args(ctypes.Structure):  # draw.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("logits", "token", "out", "pos", "seed", "cfg_scale", "temperature", "count", "cand", "scores")] + \
               [(name, ctypes.c_longlong) for name in ("stride", "stride_out", "prefix_len")] + \
               [(name, ctypes.c_int) for name in ("V", "batch", "top_k", "guided", "sample", "pad")]


def source(names):
    """draw.cu with an entry point per (name, (threads, logits per thread a program, programs an image, float32))
    in `names`."""
    return nvrtc.cuda_source("draw.cu") + "".join(
        f'extern "C" __global__ void __launch_bounds__({t}) {name}(const Args a) '
        f"{{ draw<{t}, {per}, {s}, {f32}>(a); }}\n" for name, (t, per, s, f32) in names)


def layout(V):
    """(logits per thread a program, programs an image) for V logits: PER each where it divides a thread's share."""
    share = -(-V // THREADS)
    per = PER if share % PER == 0 else share
    return per, share // per


def _kernel(device, V, dtype):
    entry = (THREADS, *layout(V), int(dtype == torch.float32))
    name = "draw_cuda_" + "_".join(map(str, entry))
    return nvrtc.compiled(device, name, lambda: source([(name, entry)]), 0, "draw.cu")


def fits(V):
    """A vocabulary of V logits fits: at most MAX_PER logits per thread of the deciding program."""
    per, n = layout(V)
    return per * n <= MAX_PER


def builds(device, V, dtype):
    """Whether the draw of V logits of `dtype` (bf16 or float32) builds on device, now, before any capture."""
    return nvrtc.available(device) and _kernel(nvrtc.cuda_device(device), V, dtype) is not None


def draw(logits, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, top_k, guided, sample_logits,
         noise=None, noise_ready=False, count=None):
    """draw_triton.draw's contract: sampling.sample(cfg_merge(logits) if guided else logits, temperature, top_k,
    race=True) for logits (rows, V) at input_pos, the tokens (batch, 1) to `token` and out[:, input_pos - prefix_len
    + 1], input_pos advanced. count: int64 zeros (>= 1 + batch,), left at zero (a buffer of its own if None). The
    race's noise is made here (noise and noise_ready are not used). Tensors stay on the device: no sync."""
    batch, V = token.shape[0], logits.shape[-1]
    assert not noise_ready and logits.shape[0] == (2 * batch if guided else batch) and logits.stride(-1) == 1
    assert token.dtype == out.dtype == input_pos.dtype == seed.dtype == torch.int64 and out.stride(1) == 1
    count = torch.zeros(1 + batch, dtype=torch.long, device=logits.device) if count is None else count
    assert count.dtype == torch.long and count.numel() >= 1 + batch
    per, n = layout(V)
    cand = torch.empty(batch, n, dtype=torch.long, device=logits.device)
    scores = torch.empty(batch, n * per * THREADS, device=logits.device)
    k = min(top_k, V) if top_k > 0 else 0
    ptr = nvrtc.ptr
    args = Args(logits=ptr(logits), token=ptr(token), out=ptr(out), pos=ptr(input_pos), seed=ptr(seed),
                cfg_scale=ptr(cfg_scale), temperature=ptr(temperature), count=ptr(count), cand=ptr(cand),
                scores=ptr(scores), stride=logits.stride(0),
                stride_out=out.stride(0), prefix_len=prefix_len, V=V, batch=batch, top_k=0 if k == V else k,
                guided=int(guided), sample=int(sample_logits))
    nvrtc.launch(_kernel(logits.device, V, logits.dtype), (n, batch), THREADS, 0, args, True, logits.device)
