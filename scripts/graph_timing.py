"""Timing for the CUDA C++ probes (persistent_chain_probe.py, bulk_stream_probe.py): the GPU they need, a driver
launch on the current stream, and the best time of a CUDA graph of it."""
import ctypes

import torch

from fast_inference import smem_gemv as S


def require_sm90(script):
    """Exit with one line unless a GPU of compute capability 9.0+ with NVRTC is here (the probes' kernels need it)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit(f"{script}: needs an NVIDIA GPU of compute capability 9.0 or later (H100, H200); run it there")


def launch(f, blocks, threads, smem, params):
    """cuLaunchKernelEx of the CUfunction f on torch's current stream; params: a ctypes array of argument pointers."""
    cfg = S._Config((blocks, 1, 1), (threads, 1, 1), smem, torch.cuda.current_stream().cuda_stream, None, 0)
    S._check(S._driver().cuLaunchKernelEx(ctypes.byref(cfg), f, params, None), "cuLaunchKernelEx")


def timed(fn, n=1):
    """Microseconds per unit of work: the best of 5 x 10 replays of a CUDA graph of fn, which does n units."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3 / (10 * n))
    return min(ts)
