"""tools/sass_loads.py: its folding of SASS lines on made-up ones, and with nvcc (no GPU needed) the kernels' memory
operations in order, where #85's norm must issue every load before its first store, and block_triton's GEMVs
their weights' before the PDL wait and, at 4 rows, x's and the residual's before their first barrier (#90;
docs/PERF_NOTES.md)."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import sass_loads  # noqa: E402


def test_folds_runs_of_a_kind_and_drops_the_rest():
    lines = ["LDG.E.U16 R0, desc[UR6][R12.64] ;", "@!P2 LDG.E.U16 R2, desc[UR6][R10.64] ;", "FADD R1, R0, R2 ;",
             "LDGSTS.E.BYPASS.128 [R9], desc[UR6][R6.64] ;", "@!P2 STG.E.U16 desc[UR6][R8.64], R3 ;",
             "BAR.SYNC.DEFER_BLOCKING 0x0 ;", "@P0 BRA 0x1420 ;", "BRA 0x1430 ;", "EXIT ;"]
    assert sass_loads.folded(lines) == [("LDG", 2), ("LDGSTS", 1), ("STG", 1), ("BAR", 1), ("BRA", 2), ("EXIT", 1)]


@pytest.mark.skipif(shutil.which("nvcc") is None or not os.path.exists(sass_loads.cuobjdump()),
                    reason="no nvcc or cuobjdump")
def test_the_norm_loads_everything_before_its_first_store():
    """eager_ops_cuda's RMSNorm (#85): a store between its loads made each element wait an L2 round trip for the one before."""
    kernels = sass_loads.sass(sass_loads.cubins("eager_ops_cuda")[None])
    runs = sass_loads.folded(kernels["eager_ops_cuda_norm"][1])
    first_store = next(i for i, (k, _) in enumerate(runs) if k == "STG")
    assert not any(k == "LDG" for k, _ in runs[first_store:]), runs


def test_an_unknown_module_is_a_one_line_error():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sass_loads.py"), "nope"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "unknown module(s) nope" in out.stderr and "eager_ops_cuda" in out.stderr


@pytest.mark.skipif(not os.path.exists(sass_loads.cuobjdump()), reason="no cuobjdump")
def test_the_gemv_paths_triton_kernels_load_their_weights_before_their_wait():
    """block_triton's qkv, wo and w2 at 2 and 4 rows (in a process of their own, away from the interpreter's settings),
    as the engine launches them under PDL: weight loads, then the wait (ACQBULK), then x's; at 4 rows wo and w2 load
    every row of x and the residual right after the wait, before their first barrier (#90: no load waits for a
    reduction)."""
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "sass_loads.py"), "block_triton"],
                         capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="0"))
    if "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("Triton's ptxas is not available here")
    assert out.returncode == 0, out.stderr[-2000:]
    kernels = dict(zip(*[iter(line.strip() for line in out.stdout.splitlines() if line.strip())] * 2))
    assert {name.split(":")[0] for name in kernels} == {f"block_triton_{p}_{r}" for p in ("qkv", "wo", "w2")
                                                        for r in (2, 4)}
    for name, runs in kernels.items():
        assert runs.startswith("LDG x") and ", ACQBULK, LDG" in runs, (name, runs)
        if name.startswith(("block_triton_wo_4", "block_triton_w2_4")):
            assert "LDG" not in runs.split(", BAR, ", 1)[1], (name, runs)
