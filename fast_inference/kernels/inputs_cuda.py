"""The step's inputs as one CUDA C++ kernel (inputs.cu), no Triton: the "inputs" operation's other implementation beside
inputs_triton's, for the cudagraph backend. Eager, the model's ops around the blocks are ~13 small kernels per step
(the rows' concatenation, the embedding, the position arithmetic, the controls' gather and scaling, the first add).
Built by NVRTC and launched through the driver (nvrtc.py); the plan asks `builds` first.
"""
import ctypes

import torch

from fast_inference.kernels import nvrtc

THREADS = 256
MAX_LISTS = 4  # inputs.cu's


class Args(ctypes.Structure):  # inputs.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("token", "pos", "emb", "controls", "table", "x", "freqs", "picked")] + \
               [(name, ctypes.c_longlong) for name in ("sl", "sr", "sn")] + \
               [(name, ctypes.c_int) for name in ("batch", "n_controls", "cls_token_num", "D", "F", "lists")]


def source(names):
    """inputs.cu with an entry point per (name, float32) in `names`."""
    return nvrtc.cuda_source("inputs.cu") + "".join(
        f'extern "C" __global__ void __launch_bounds__({THREADS}) {name}(const Args a) {{ inputs<{f32}>(a); }}\n'
        for name, f32 in names)


def _kernel(device, dtype):
    f32 = int(dtype == torch.float32)
    name = f"inputs_cuda_{f32}"
    return nvrtc.compiled(device, name, lambda: source([(name, f32)]), 0, "inputs.cu")


def builds(device, dtype):
    """Whether the kernel for bf16 or float32 embeddings builds on device, now, before any capture (the RoPE table is
    float32 once the model's caches are set up)."""
    return nvrtc.available(device) and _kernel(nvrtc.cuda_device(device), dtype) is not None


def step_inputs(model, token, input_pos, controls, guided):
    """inputs_triton.step_inputs: x = model.tok_embeddings(cat([token, token]) if guided else token) + control row 0,
    and (freqs, (None, control rows 1, 2, ...)) for input_pos (1,), each row (R, 1, D)."""
    emb, table = model.tok_embeddings.weight, model.freqs_cis
    batch, D = token.shape[0], emb.shape[1]
    R = 2 * batch if guided else batch
    lists, _, n_controls, _ = controls.shape
    assert controls.shape[1] >= R and n_controls > 0 and 0 < lists <= MAX_LISTS
    assert controls.stride(3) == 1 and controls.dtype == emb.dtype
    assert token.is_contiguous() and emb.is_contiguous() and table.is_contiguous() and table.dtype == torch.float32
    x = torch.empty(R, 1, D, device=emb.device, dtype=emb.dtype)
    freqs = torch.empty(1, *table.shape[1:], device=emb.device, dtype=table.dtype)
    picked = torch.empty(lists - 1, R, 1, D, device=emb.device, dtype=emb.dtype)
    ptr = nvrtc.ptr
    args = Args(token=ptr(token), pos=ptr(input_pos), emb=ptr(emb), controls=ptr(controls), table=ptr(table),
                x=ptr(x), freqs=ptr(freqs), picked=ptr(picked), sl=controls.stride(0), sr=controls.stride(1),
                sn=controls.stride(2), batch=batch, n_controls=n_controls, cls_token_num=model.args.cls_token_num, D=D,
                F=table[0].numel(), lists=lists)
    nvrtc.launch(_kernel(emb.device, emb.dtype), (R, -(-D // THREADS)), THREADS, 0, args, True, emb.device)
    return x, (freqs, (None, *picked))
