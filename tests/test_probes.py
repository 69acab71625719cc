"""The CUDA C++ probes in scripts/ build for sm_90 with nvcc where it is installed (no GPU needed): every kind of
variant that docs/PERF_NOTES.md quotes, without a stack frame (accumulators in local memory had cost the persistent
chain a fifth of its time), with the ring, x and the exchange inside a program's 227 KB of shared memory."""
import os
import shutil

import pytest

import sm90

SCRIPTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts")
CHAIN = ["run<2, 0, 1, 0, 0>", "run<2, 1, 1, 0, 0>", "run<2, 2, 0, 0, 0>", "run_mma<2, 0, 1, 1>", "run_mma<2, 3, 0, 3>",
         "run_ll<2, 1, 0, 1>", "run_ll<2, 8, 0, 1>", "run_ll<2, 4, 3, 1>", "run_ll<2, 8, 0, 1, 8>", "run_ll<2, 8, 0, 1, 4>",
         "run_ll<2, 8, 0, 1, 16, 1>", "run_ll<2, 8, 4, 0>", "run_ll<2, 8, 3, 0, 16, 0, 3>", "run_ll<2, 8, 3, 0, 16, 0, 7>",
         "run_ll<2, 8, 0, 1, 16, 0, 0, 1>", "run_ll<2, 4, 0, 1, 16, 0, 0, 1>",
         "run_ll<2, 8, 0, 1, 16, 0, 0, 1, 1>", "run_ll<2, 8, 3, 1, 16, 0, 0, 1, 1>", "run_ll<2, 8, 0, 1, 16, 0, 0, 1, 2>",
         "run_ll<2, 8, 0, 1, 16, 0, 0, 1, 3>", "run_ll<2, 8, 0, 1, 16, 0, 0, 1, 4>", "run_ll<2, 8, 0, 1, 16, 0, 8, 1, 4>",
         "run_ll<2, 8, 0, 1, 16, 0, 32, 1, 4>", "run_ll<2, 8, 0, 1, 16, 0, 968, 1, 4>", "run_ll<2, 8, 0, 1, 16, 0, 0, 1, 5>",
         "run_ll<2, 8, 0, 1, 16, 0, 1024, 1, 4>"]
AHEAD_XREG = "run<2, 0, 1, 7, 1>"  # measured (and lost) with w2 in halves only; in thirds it spills at 96 registers
ROWS16 = ["run_mma<16, 0, 1, 1>", "run_ll<16, 8, 0, 1>", "run_ll<16, 8, 3, 1>", "run_ll<16, 8, 0, 1, 16, 1>"]  # n = 8's rows (run_ll with NW 4 or 16, or L16, spills)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("w2p, stages, variants", [(2, 7, CHAIN + [AHEAD_XREG]), (3, 10, CHAIN), (3, 4, ROWS16)])
def test_persistent_chain_builds_without_stack(w2p, stages, variants):
    """As persistent_chain_probe.py composes it: its STAGES and W2P written over the source's constants (the source's
    static_assert holds the ring, x and the exchange to 227 KB)."""
    src = open(os.path.join(SCRIPTS, "persistent_chain.cu")).read()
    assert "S = 7," in src and "W2P = 2;" in src  # what the probe replaces
    src = src.replace("S = 7,", f"S = {stages},").replace("W2P = 2;", f"W2P = {w2p};")
    src += "".join(f'extern "C" __global__ void __launch_bounds__(544, 1) k{i}(const PArgs a) {{ {v}(a); }}\n'
                   for i, v in enumerate(variants))
    frames = sm90.nvcc_stack_frames(src)
    assert len(frames) == len(variants) and not any(frames)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_bulk_stream_builds_without_stack():
    src = open(os.path.join(SCRIPTS, "bulk_stream.cu")).read()
    src += 'extern "C" __global__ void s(const unsigned char* s, long long n) { stream<20480, 7, 1, 1>(s, n); }\n'
    src += 'extern "C" __global__ void l(const unsigned char* s, long long n, unsigned* o) { stream_ldg(s, n, o); }\n'
    frames = sm90.nvcc_stack_frames(src)
    assert len(frames) == 2 and not any(frames)
