"""The order of the global loads, stores, barriers and branches in the CUDA C++ kernels' sm_90 SASS, as the engine
builds them (nvcc and Triton's bundled cuobjdump; no GPU needed): where a kernel's loads wait on each other.

    python scripts/sass_loads.py [cuda_ops cuda_inputs cuda_draw smem_gemv smem_attention] [--all]

A load the compiler may not issue before a store to memory it might alias, or after a branch (an IEEE division's
check), or whose register a store must free first, waits for the one before it to land: an L2 round trip each,
0.3-0.5 us on the H200 (docs/PERF_NOTES.md #85-#89). Each kernel prints its registers and stack, then its memory
operations in program order, runs of one kind folded ("LDG x8": issued back to back). Not every break in a run is a
wait (a branch over a predicated-off element is not), so read the folded lines with the source. --all: every SASS line
of those kinds, unfolded.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fast_inference import cuda_draw, cuda_inputs, cuda_ops, smem_attention, smem_gemv

KINDS = ("LDGSTS", "LDG", "STG", "STS", "LDS", "BAR", "BRA", "CALL", "ATOM", "RED", "MEMBAR", "EXIT", "SYNCS")


def entries():
    """module name -> its source(names)'s text, for the kernels the engine builds for GPT-XL in bf16."""
    V = 16_384
    gemv = [(f"smem_gemv_{name}_{rows}", smem_gemv._entry(kind, name, k, rows, True, smem_gemv.ALL))
            for name, kind, k in (("qkv", "qkv", 1280), ("wo", "linear", 1280), ("gate_up", "gate_up", 1280),
                                  ("w2", "linear", 3584)) for rows in (2, 4)]
    return dict(
        cuda_ops=cuda_ops.source([(f"cuda_ops_{op}", (op, 0)) for op in cuda_ops.KERNELS]),
        cuda_inputs=cuda_inputs.source([("cuda_inputs", 0)]),
        cuda_draw=cuda_draw.source([("cuda_draw", (cuda_draw.THREADS, *cuda_draw.layout(V), 0))]),
        smem_gemv=smem_gemv.source(gemv),
        smem_attention=smem_attention.source([("smem_attention_attend", ("attend", 64, smem_attention.WARPS,
                                                                          smem_gemv.PDL)),
                                              ("smem_attention_loop", ("loop", 64, smem_attention.LOOP_WARPS,
                                                                        smem_attention.U))]))


def cuobjdump():
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def sass(src):
    """{kernel: (resource usage line, [SASS instruction lines])} of the CUDA C++ src built for sm_90."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(src)
        subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", path + ".cubin", path], check=True)
        text = subprocess.run([cuobjdump(), "-sass", path + ".cubin"], capture_output=True, text=True, check=True)
        usage = subprocess.run([cuobjdump(), "-res-usage", path + ".cubin"], capture_output=True, text=True,
                               check=True).stdout
    out = {}
    for block in re.split(r"\n\s*Function : ", text.stdout)[1:]:
        name, body = block.split("\n", 1)
        lines = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", body)]
        res = re.search(rf"Function {re.escape(name.strip())}:\s*\n\s*(REG:.*)", usage)
        out[name.strip()] = (res.group(1).split(" SHARED")[0] if res else "", lines)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help="cuda_ops, cuda_inputs, cuda_draw, smem_gemv, smem_attention (all)")
    ap.add_argument("--all", action="store_true", help="every line of those kinds, unfolded")
    args = ap.parse_args()
    sources = entries()
    unknown = set(args.modules) - set(sources)
    if unknown:
        sys.exit(f"sass_loads.py: unknown module(s) {', '.join(sorted(unknown))}: choose from {', '.join(sources)}")
    for module in args.modules or sources:
        for name, (usage, lines) in sass(sources[module]).items():
            print(f"{name}: {usage}")
            if args.all:
                print("\n".join(f"  {line}" for line in lines if kind(line)))
            else:
                print("  " + ", ".join(k if n == 1 else f"{k} x{n}" for k, n in folded(lines)))


if __name__ == "__main__":
    main()
