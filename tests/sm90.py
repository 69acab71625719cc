"""Ahead-of-time compilation of the Triton kernels for sm_90 (H100/H200) with Triton's bundled ptxas, no
GPU needed: a kernel that only the interpreter accepts, or whose registers spill, fails here rather
than on the first GPU run. The tests run their compile scripts in a subprocess (`run`), away from the
interpreter settings of the other tests.

With SM90_SASS_LOG=FILE each build appends a line to FILE: the kernel, its settings and a digest of its SASS, so that
two commits' builds can be compared (tools/compare_sass.py): a change that moves code but not kernels leaves every
digest as it was."""
import hashlib
import json
import os
import re
import subprocess
import tempfile

import pytest

import early

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# strides that are no multiple of 16 at GPT-XL's shapes: key_valid's row (the cache's 1,144 positions at 512 px) and a
# window's masks' row (its L queries)
UNEVEN = ("stride_valid", "stride_mr")


def build(kernel, signature, constexprs, options, attrs=None, stack=0):
    """kernel compiled for sm_90 (attrs: Triton's argument specialisations, by default every pointer aligned and every
    stride argument a multiple of 16, as the JIT specialises them at GPT-XL's shapes: without it a loop's loads may
    not become async copies, docs/PERF_NOTES.md, "Thirteenth session");
    asserts that at most `stack` bytes spill to local memory (a stack frame): a kernel that holds its tiles in
    registers is slowed several times over by more, so none unless a measurement showed that a few cost less than
    what they buy."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if attrs is None:  # every pointer 16-byte aligned and every stride a multiple of 16, as the JIT specialises them
        attrs = {(i,): [["tt.divisibility", 16]] for i, (name, t) in enumerate(signature.items())
                 if t.startswith("*") or (name.startswith("stride") and name not in UNEVEN and t in ("i32", "i64"))}
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
    log_sass("triton", k.asm["cubin"], f"{kernel.__name__} {json.dumps(constexprs, sort_keys=True, default=str)} "
                                          f"{json.dumps(options, sort_keys=True, default=str)}")
    return k


def log_sass(tool, cubin, what):
    """SM90_SASS_LOG's line per kernel of a cubin: tool, what was built (or {kernel: what}), kernel name, digest of
    its instructions."""
    path = os.environ.get("SM90_SASS_LOG")
    if not path:
        return
    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    with open(path, "a") as log:
        for block in re.split(r"\n\s*Function : ", text)[1:]:
            name, body = block.split("\n", 1)
            lines = "\n".join(m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", body))
            name = name.strip()
            built = what.get(name, "-") if isinstance(what, dict) else what
            log.write(f"{tool} {built} {name} {hashlib.sha1(lines.encode()).hexdigest()[:16]}\n")


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
        with open(path + ".cubin", "rb") as f:
            entries = re.findall(r"__launch_bounds__\((\d+)\) (\w+)\(const \w+ a\) \{ (.+?)\(a\); \}", src)
            log_sass("nvcc", f.read(), {name: f"{call.replace(' ', '')}@{threads}" for threads, name, call in entries})
    return [int(f) for f in re.findall(r"(\d+) bytes stack frame", out.stderr)]
