"""Settings of the fast engine against each other in the model: one process, the settings alternating
twice, decode ms/step of the second of two 1,024-token images each time (GPT-XL bf16, random weights,
default engine or --backend's, cfg 4, top-k 2000, the same seed), and whether the tokens equal the first setting's.

    python tools/engine_ab.py --batch-sizes 8 "" "overrides = 'merge_pdl=off'" "plan.FUSED_ROWS = 8"

A setting is Python run with the plan and the kernel modules in scope (plan, engine, pdl, and kernels/'s attention_*,
block, block_*, draw_*, inputs_*, eager_ops_*, prefetch_triton), after every attribute of those modules is put back
as it was (tables copied, so a setting may change them in place): it may change a rule of the plan (plan.WHOLE_ROWS
= range(64, 129)) or a kernel's tuning table (block_triton.DOT_CONFIG['wo'] = ...), and set `overrides`, plan
overrides as --plan takes them ("draw=torch,attention=sdpa"). "" is the code as it stands.
docs/PERF_NOTES.md gives the settings of its A/Bs. Settings in one process share its CUDA-graph
history (PERF_NOTES, "Inductor's PDL and a second capture": the process's first capture may run
faster), so bench.py gives the figures to quote. With --process-per-setting each setting runs in a
process of its own instead (the settings still alternating twice), every process with the same random
weights: the tokens' hash then says whether two settings drew the same. One CUDA GPU.
"""
import argparse
import copy
import hashlib
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference import engine, plan
from fast_inference.workload import inputs, random_gpt_xl
from fast_inference.kernels import (attention_cuda, attention_triton, block, block_cuda, block_triton, draw_cuda,
                                    draw_triton, eager_ops_cuda, eager_ops_triton, inputs_cuda, inputs_triton, pdl,
                                    prefetch_triton)

MODULES = dict(plan=plan, engine=engine, pdl=pdl, attention_cuda=attention_cuda, attention_triton=attention_triton,
               block=block, block_cuda=block_cuda, block_triton=block_triton, draw_cuda=draw_cuda,
               draw_triton=draw_triton, eager_ops_cuda=eager_ops_cuda, eager_ops_triton=eager_ops_triton,
               inputs_cuda=inputs_cuda, inputs_triton=inputs_triton, prefetch_triton=prefetch_triton)


def snapshot():
    """Every module attribute but the dunder ones, its dicts, lists and sets copied (their items are immutable tables,
    functions and modules)."""
    return {name: {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v for k, v in vars(m).items()
                   if not k.startswith("__")} for name, m in MODULES.items()}


def restore(saved):
    """The modules as in `saved`: attributes set since are removed, the others put back (fresh copies)."""
    for name, attrs in saved.items():
        module = MODULES[name]
        for k in {k for k in vars(module) if not k.startswith("__")} - set(attrs):
            delattr(module, k)
        for k, v in attrs.items():
            setattr(module, k, copy.copy(v) if isinstance(v, (dict, list, set)) else v)


def compile_settings(settings):
    """Each setting as a code object; a SyntaxError becomes a ValueError naming the setting."""
    codes = []
    for text in settings:
        try:
            codes.append(compile(text, "<setting>", "exec"))
        except SyntaxError as e:
            raise ValueError(f"setting {text!r} is not Python: {e.msg}") from None
    return codes


def apply(saved, code):
    """The modules as saved, then the setting run; -> its plan overrides (`overrides`, "" if it sets none)."""
    restore(saved)
    scope = dict(MODULES)
    exec(code, scope)
    return scope.get("overrides", "")


def line(B, text, ms, tokens, first):
    """One run's result: decode ms/step, tok/s, whether the tokens equal `first` (the first setting's in this process;
    None in a child of --process-per-setting, which runs one setting: the hash compares across processes)."""
    digest = hashlib.sha1(tokens.cpu().numpy().tobytes()).hexdigest()[:10]
    same = "" if first is None else f"tokens as the first setting's: {bool(first.equal(tokens))} "
    return (f"n = {B}, {text or 'as it stands'}: decode {ms:.3f} ms/step ({B * 1000 / ms:,.0f} tok/s), "
            f"{same}(hash {digest})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="+",
                    help='Python per setting, e.g. "" (as it stands), "plan.FUSED_ROWS = 8", "overrides = \'draw=torch\'"')
    ap.add_argument("--batch-sizes", default="8")
    ap.add_argument("--backend", default="inductor", choices=engine.BACKENDS)
    ap.add_argument("--process-per-setting", action="store_true",
                    help="each setting in a process of its own, alternating twice (no shared CUDA-graph history)")
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # a child's one round
    args = ap.parse_args(argv)
    try:
        codes = compile_settings(args.settings)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        sys.exit("engine_ab.py needs a CUDA GPU (the engine's fast paths are Triton kernels and CUDA graphs)")
    if args.process_per_setting:
        for text in args.settings * 2:
            child = [sys.executable, os.path.abspath(__file__), "--batch-sizes", args.batch_sizes, "--backend",
                     args.backend, "--once", "--", text]
            if subprocess.run(child).returncode:
                sys.exit(f"engine_ab.py: the process for setting {text!r} failed")
        return
    saved = snapshot()
    torch.manual_seed(0)  # the same random weights in every process
    model = random_gpt_xl()
    with torch.no_grad():
        for B in map(int, args.batch_sizes.split(",")):
            cond, mask, condition = inputs(model, B, 512, "cuda")
            first = None
            for text, code in list(zip(args.settings, codes)) * (1 if args.once else 2):
                overrides = apply(saved, code)
                torch._dynamo.reset()  # a compiled block reads the settings when it is traced
                model.clear_caches()
                fast = engine.Engine(model, backend=args.backend, overrides=plan.parse_overrides(overrides))
                for _ in range(2):
                    torch.manual_seed(0)
                    tokens = fast.generate(cond, 1024, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=2000)
                first = tokens if first is None else first
                ms = fast.last_timings["decode"] / 1023 * 1e3
                print(line(B, text, ms, tokens, None if args.once else first), flush=True)
    restore(saved)


if __name__ == "__main__":
    main()
