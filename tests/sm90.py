"""Ahead-of-time compilation of the Triton kernels for sm_90 (H100/H200) with Triton's bundled ptxas, no
GPU needed: a kernel that only the interpreter accepts, or whose registers spill, fails here rather
than on the first GPU run. The tests run their compile scripts in a subprocess (`run`), away from the
interpreter settings of the other tests."""
import os
import re
import subprocess
import tempfile

import pytest

import early

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build(kernel, signature, constexprs, options, attrs=None, stack=0):
    """kernel compiled for sm_90 (attrs: Triton's argument specialisations, by default every pointer aligned);
    asserts that at most `stack` bytes spill to local memory (a stack frame): a kernel that holds its tiles in
    registers is slowed several times over by more, so none unless a measurement showed that a few cost less than
    what they buy."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if attrs is None:  # every pointer 16-byte aligned, as the JIT specialises a torch tensor's (vector loads)
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values()) if t.startswith("*")}
    signature = {**signature, **{name: "constexpr" for name in constexprs}}
    k = triton.compile(ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if os.path.exists(cuobjdump):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        frame = int(re.search(r"STACK:(\d+)", usage).group(1))
        assert frame <= stack, (kernel.__name__, constexprs, usage)
    return k


def env(**extra):
    """A compile script's environment: the repository and tests/ on the path, and `extra`."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]), **extra)


def run(script, **extra):
    """Run a compile script (it prints "compiled" at its end), or wait for it where its module started it early
    (EARLY: test name -> (script, env(**extra))); skipped where Triton has no ptxas."""
    pytest.importorskip("triton.compiler")
    out = early.result(script, env(**extra), timeout=900)
    if "ptxas" in out.stderr and "not found" in out.stderr.lower():
        pytest.skip("Triton's ptxas is not available here")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("compiled")


def nvcc_stack_frames(src):
    """ptxas's stack frame, in bytes, per kernel of the CUDA C++ `src` built for sm_90 by nvcc (asserts it builds)."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        open(path, "w").write(src)
        out = subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-Xptxas", "-v", path, "-o", path + ".cubin"],
                             capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [int(f) for f in re.findall(r"(\d+) bytes stack frame", out.stderr)]
