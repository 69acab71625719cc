"""The cudagraph backend's step inputs as one CUDA C++ kernel (cuda_inputs.cu), no Triton: decode_inputs.py's
contract. Eager, the model's ops around the blocks are ~13 small kernels per step (the rows' concatenation, the
embedding, the position arithmetic, the controls' gather and scaling, the first add). Built by NVRTC and launched
through the driver as smem_gemv's kernels (its `compiled` and `launch`); the engine asks `builds` before it captures a
step, else the model's ops run.
"""
import ctypes
import os

import torch

from fast_inference import smem_gemv

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda_inputs.cu")
THREADS = 256
MAX_LISTS = 4  # cuda_inputs.cu's
ENABLED = os.environ.get("FAST_CUDA_INPUTS", "1") != "0"


class Args(ctypes.Structure):  # cuda_inputs.cu's Args
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("token", "pos", "emb", "controls", "table", "x", "freqs", "picked")] + \
               [(name, ctypes.c_longlong) for name in ("sl", "sr", "sn")] + \
               [(name, ctypes.c_int) for name in ("batch", "n_controls", "cls_token_num", "D", "F", "lists")]


def source(names):
    """cuda_inputs.cu with an entry point per (name, float32) in `names`."""
    return smem_gemv.cuda_source(SOURCE) + "".join(
        f'extern "C" __global__ void __launch_bounds__({THREADS}) {name}(const Args a) {{ inputs<{f32}>(a); }}\n'
        for name, f32 in names)


def _kernel(device, dtype):
    f32 = int(dtype == torch.float32)
    name = f"cuda_inputs_{f32}"
    return smem_gemv.compiled(device, name, lambda: source([(name, f32)]), 0, "cuda_inputs.cu")


def builds(model, device):
    """Whether the step inputs of `model` run here: enabled, smem_gemv's NVRTC and driver (sm_90+), bf16 or float32
    embeddings, and the kernel built now, before any step is captured (the RoPE table is float32 once the model's
    caches are set up)."""
    device = smem_gemv.cuda_device(device)
    dtype = model.tok_embeddings.weight.dtype
    if not (ENABLED and dtype in (torch.bfloat16, torch.float32)):
        return False
    return smem_gemv.available(device) and _kernel(device, dtype) is not None


def step_inputs(model, token, input_pos, controls, guided):
    """decode_inputs.step_inputs: x = model.tok_embeddings(cat([token, token]) if guided else token) + control row 0,
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
    ptr = smem_gemv._ptr
    args = Args(token=ptr(token), pos=ptr(input_pos), emb=ptr(emb), controls=ptr(controls), table=ptr(table),
                x=ptr(x), freqs=ptr(freqs), picked=ptr(picked), sl=controls.stride(0), sr=controls.stride(1),
                sn=controls.stride(2), batch=batch, n_controls=n_controls, cls_token_num=model.args.cls_token_num, D=D,
                F=table[0].numel(), lists=lists)
    smem_gemv.launch(_kernel(emb.device, emb.dtype), (R, -(-D // THREADS)), THREADS, 0, args, True, emb.device)
    return x, (freqs, (None, *picked))
