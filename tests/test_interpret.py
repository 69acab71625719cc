"""tests/interpret.py, which the interpreter scripts import first: a kernel calling @triton.jit helpers (its own and
Triton's) gives the same in the interpreter with it as without it, and Triton's language modules are as they were
once the kernel has run."""
import subprocess
import sys

import pytest

import interpret

pytest.importorskip("triton")

SCRIPT = r"""
import sys
if sys.argv[1] == "patched":
    import interpret
import torch
import triton
import triton.language as tl


@triton.jit
def _twice(x):  # a helper calling one of Triton's (triton.language.standard's, which sees triton.language.core)
    return 2 * x + tl.zeros_like(x)


@triton.jit
def _kernel(X, OUT, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    y = _twice(tl.load(X + offs, mask=offs < N, other=0.0))
    tl.store(OUT + offs, tl.cumsum(y, 0) + tl.max(y, 0), mask=offs < N)


before = (tl.load, tl.core.full, tl.tensor.__add__, tl.standard.zeros_like)
x, out = torch.arange(10, dtype=torch.float32), torch.empty(10)
for _ in range(2):
    _kernel[(1,)](x, out, 10, BLOCK=16)
print(before == (tl.load, tl.core.full, tl.tensor.__add__, tl.standard.zeros_like), *out.tolist())
"""


def test_a_kernel_gives_the_same_with_it_and_the_language_is_restored():
    runs = {how: subprocess.run([sys.executable, "-c", SCRIPT, how], env=interpret.ENV, capture_output=True,
                                text=True, timeout=300) for how in ("plain", "patched")}
    for out in runs.values():
        assert out.returncode == 0, out.stderr[-2000:]
    x = [2.0 * i for i in range(10)]
    want = [str(sum(x[: i + 1]) + max(x)) for i in range(10)]
    plain, patched = (runs[how].stdout.split() for how in ("plain", "patched"))
    assert plain[1:] == patched[1:] == want, (plain, patched)
    assert patched[0] == "True"  # (the interpreter itself leaves its calls' patches in place)
