"""The order of the global loads, stores, barriers and branches in the engine's hand-written kernels' sm_90 SASS (the
CUDA C++ ones, and block_triton's GEMVs), built as the engine builds them (nvcc, Triton, Triton's bundled
cuobjdump; no GPU needed): where a kernel's loads wait on each other.

    python tools/sass_loads.py [eager_ops_cuda inputs_cuda draw_cuda block_cuda attention_cuda block_triton] [--all]

A load the compiler may not issue before a store to memory it might alias, or after a branch (an IEEE division's
check), or whose register a store must free first, waits for the one before it to land: an L2 round trip each,
0.3-0.5 us on the H200 (docs/PERF_NOTES.md #85-#89). Each kernel prints its registers and stack, then its memory
operations in program order, runs of one kind folded ("LDG x8": issued back to back). Not every break in a run is a
wait (a branch over a predicated-off element is not), so read the folded lines with the source. --all: every SASS line
of those kinds, unfolded. block_triton: the default engine's Triton projections at 2 and 4 rows (n = 1 and 2 under CFG) as it
launches them (PDL; ACQBULK is the wait), built by Triton for sm_90 (its bundled ptxas).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fast_inference import plan
from fast_inference.kernels import attention_cuda, block_cuda, draw_cuda, eager_ops_cuda, inputs_cuda

KINDS = ("ACQBULK", "LDGSTS", "LDG", "STG", "STS", "LDS", "BAR", "BRA", "CALL", "ATOM", "RED", "MEMBAR", "EXIT",
         "SYNCS")


def cuda_sources():
    """module name -> its source(names)'s text, for the CUDA C++ kernels the engine builds for GPT-XL in bf16."""
    V = 16_384
    # the cudagraph backend's launches (plan.CUDA_FIRST_ROWS)
    mode = lambda rows: plan.FIRST if rows <= plan.CUDA_FIRST_ROWS else plan.EARLY
    gemv = [(f"block_cuda_{name}_{rows}", block_cuda.entry(name, k, rows, mode(rows)))
            for name, k in (("qkv", 1280), ("wo", 1280), ("gate_up", 1280), ("w2", 3584)) for rows in (2, 4)]
    return dict(
        eager_ops_cuda=eager_ops_cuda.source([(f"eager_ops_cuda_{op}", (op, 0)) for op in eager_ops_cuda.KERNELS]),
        inputs_cuda=inputs_cuda.source([("inputs_cuda", 0)]),
        draw_cuda=draw_cuda.source([("draw_cuda", (draw_cuda.THREADS, *draw_cuda.layout(V), 0))]),
        block_cuda=block_cuda.source(gemv),
        attention_cuda=attention_cuda.source([("attention_cuda_attend", ("attend", 64, attention_cuda.WARPS,
                                                                          attention_cuda.PDL)),
                                              ("attention_cuda_loop", ("loop", 64, attention_cuda.LOOP_WARPS,
                                                                        attention_cuda.U))]))


def triton_cubins(rows=2):
    """{kernel: cubin} of block_triton's qkv, wo and w2 kernels for GPT-XL in bf16 at `rows` rows, as the engine
    launches them under PDL on an H100/H200."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from fast_inference.kernels import block_triton as db

    t, D, F = "*bf16", 1280, 3584
    dot = rows > plan.GEMV_ROWS
    pdl = plan.LATE if dot else plan.GEMV_PDL
    split = {"PART": "*fp32", "COUNT": "*i32", "PROGRESS": "*i32"}
    sig = dict(linear={"X": t, "W": t, "S": t, "RES": t, "ADD": t, "OUT": t, **split, "R": "i32", "N": "i32"},
               qkv={"X": t, "NW": t, "W": t, "S": t, "FREQS": "*fp32", "POS": "*i64", "Q": t, "KC": t, "VC": t,
                    **split, "R": "i32", "stride_cr": "i32", "stride_ch": "i32", "stride_cn": "i32"})
    out = {}
    for name, K, kernel, tiles in (("qkv", D, db._qkv_kernel, 2), ("wo", D, db._linear_kernel, 1),
                                   ("w2", F, db._linear_kernel, 1)):
        x, w = (torch.empty(n, K, dtype=torch.bfloat16, device="meta") for n in (rows, 1))
        bn, kw = db.tiling(name, x, w, tiles, pdl, dot)
        options = {o: kw.pop(o) for o in ("launch_pdl", "num_warps", "num_stages") if o in kw}
        kw = dict(kw, QUANT=False, BUMP=False)
        del kw["PROGRESS"]
        if name == "qkv":
            kw.update(EPS=1e-5, D=D, HD=64, BP=min(bn, 32), WINDOW=0)
        else:
            kw.update(K=K, BN=bn, THEN=False)
        signature = dict(sig["qkv" if name == "qkv" else "linear"], **{k: "constexpr" for k in kw})
        attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(signature.values()) if v.startswith("*")}
        k = compile(ASTSource(kernel, signature, constexprs=kw, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                    options=options)
        out[f"block_triton_{name}_{rows}"] = k.asm["cubin"]
    return out


def cuobjdump():
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def cubins(module):
    """{kernel name, or None for the cubin's own names: cubin} of `module`'s kernels as the engine builds them."""
    if module == "block_triton":
        return {**triton_cubins(2), **triton_cubins(4)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(cuda_sources()[module])
        subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", path + ".cubin", path], check=True)
        with open(path + ".cubin", "rb") as f:
            return {None: f.read()}


def sass(cubin, rename=None):
    """{kernel: (resource usage line, [SASS instruction lines])} of a cubin, its one kernel named `rename` if given."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True)
        usage = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    out = {}
    for block in re.split(r"\n\s*Function : ", text.stdout)[1:]:
        name, body = block.split("\n", 1)
        lines = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", body)]
        res = re.search(rf"Function {re.escape(name.strip())}:\s*\n\s*(REG:.*)", usage)
        out[rename or name.strip()] = (res.group(1).split(" SHARED")[0] if res else "", lines)
    return out


def kind(line):
    """The memory or control kind of a SASS line (its predicate dropped), or None."""
    op = line.split()[1] if line.startswith("@") else line.split()[0]
    return next((k for k in KINDS if op.startswith(k)), None)


def folded(lines):
    """[(kind, count)] of the lines of KINDS in order, consecutive ones of a kind folded."""
    runs = []
    for k in filter(None, map(kind, lines)):
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
    return [tuple(r) for r in runs]


def main():
    modules = (*cuda_sources(), "block_triton")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help=f"of {', '.join(modules)} (all)")
    ap.add_argument("--all", action="store_true", help="every line of those kinds, unfolded")
    args = ap.parse_args()
    unknown = set(args.modules) - set(modules)
    if unknown:
        sys.exit(f"sass_loads.py: unknown module(s) {', '.join(sorted(unknown))}: choose from {', '.join(modules)}")
    for module in args.modules or modules:
        for name, cubin in cubins(module).items():
            for kernel, (usage, lines) in sass(cubin, name).items():
                print(f"{kernel}: {usage}")
                if args.all:
                    print("\n".join(f"  {line}" for line in lines if kind(line)))
                else:
                    print("  " + ", ".join(k if n == 1 else f"{k} x{n}" for k, n in folded(lines)))


if __name__ == "__main__":
    main()
