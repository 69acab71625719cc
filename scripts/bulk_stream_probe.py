"""The bulk-copy streaming rate into shared memory (scripts/bulk_stream.cu): how fast a persistent kernel's producer
could bring GPT-XL's weights in (docs/PERF_NOTES.md, "A persistent chain of the projections"). Needs an sm_90 GPU.

    python scripts/bulk_stream_probe.py

One program per SM over ~300 MB (8 GPT-XL blocks' weights, rounded to whole stages per SM), each variant the best
of 5 x 10 replays of a CUDA graph of one launch: (stage bytes, ring depth, producer lanes, copies per stage), then
16-byte loads at 256-1024 threads per SM.
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference import smem_gemv as S
from graph_timing import launch, require_sm90, timed

require_sm90("bulk_stream_probe.py")

BLOCK = 40_632_320  # bytes of one GPT-XL block's four projections
VARIANTS = [(20480, 7, 1, 1), (28672, 7, 1, 1), (28672, 7, 1, 8), (4096, 32, 1, 1), (8192, 16, 1, 1),
            (14336, 4, 4, 1), (7168, 8, 4, 1), (28672, 2, 4, 1), (4096, 12, 4, 1)]
nsm = torch.cuda.get_device_properties(0).multi_processor_count
total = 8 * BLOCK // (nsm * 286720) * (nsm * 286720)  # whole stages of every size above on every SM
per_sm = total // nsm


def name(v):
    return "s_%d_%d_%d_%d" % v


def load_kernels():
    """{name: CUfunction}: a stream per variant and the loads' `s_ldg`."""
    here = os.path.dirname(os.path.abspath(__file__))
    src = open(os.path.join(here, "bulk_stream.cu")).read() + "".join(
        f'extern "C" __global__ void {name(v)}(const unsigned char* s, long long n) {{ stream<{", ".join(map(str, v))}>(s, n); }}\n'
        for v in VARIANTS)
    src += 'extern "C" __global__ void s_ldg(const unsigned char* s, long long n, unsigned* o) { stream_ldg(s, n, o); }\n'
    smem = 1024 + max(b * d * p for b, d, p, _ in VARIANTS)
    return S.functions(src, "90", [name(v) for v in VARIANTS] + ["s_ldg"], smem)


def streamed(f, threads, smem, values):
    """Microseconds for one launch of f, a program per SM, over the buffer."""
    params = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
    return timed(lambda: launch(f, nsm, threads, smem, params))


buf = torch.empty(total, device="cuda", dtype=torch.uint8)
out = torch.zeros(4, device="cuda", dtype=torch.int32)
kernels = load_kernels()
for v in VARIANTS:  # a producer lane per warp
    t = streamed(kernels[name(v)], 32 * v[2], 1024 + v[0] * v[1] * v[2],
                 [ctypes.c_void_p(buf.data_ptr()), ctypes.c_longlong(per_sm)])
    print(f"bulk copies, stage {v[0]} B, depth {v[1]}, producers {v[2]}, copies per stage {v[3]}: {t:.1f} us, "
          f"{total / t / 1e6:.2f} TB/s ({BLOCK * t / total:.2f} us per GPT-XL block)", flush=True)
for threads in (256, 512, 1024):
    values = [ctypes.c_void_p(buf.data_ptr()), ctypes.c_longlong(per_sm), ctypes.c_void_p(out.data_ptr())]
    t = streamed(kernels["s_ldg"], threads, 0, values)
    print(f"16-byte loads, {threads} threads per SM: {t:.1f} us, {total / t / 1e6:.2f} TB/s", flush=True)
