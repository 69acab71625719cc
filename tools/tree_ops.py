"""The ops of a draft tree's pass on the CPU (issue 78): a proxy for its CUDA graph's kernels, counted per part.

    python tools/tree_ops.py [--window 48] [--tree 4x3+2x3] [--layers 36] [--triton]

A tiny model (dim 64, 2 heads, `--layers` blocks, an 8 x 8 grid, 512 tokens), eager, one image with CFG: after a
generate() the runner's pass runs once more under torch.profiler, and the aten ops that would launch a kernel (the
leaves of the op tree, less views and allocations) are counted inside advance_tree, walk, compact, settle and
renew_candidates, and over the whole pass. --triton: the profiled pass with tree_triton's kernels (compact, the
window noise's uniforms), run by Triton's CPU interpreter, each launch counted as one kernel.
"""
import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

if "--triton" in sys.argv:  # before triton's import: its CPU interpreter
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from fast_inference import draft_tree
from fast_inference.engine import Engine
from fast_inference.kernels import tree_triton
from fast_inference.speculative import JacobiRunner
from test_reference import tiny_inputs, tiny_model

# Ops that launch no kernel: views, shape changes, allocations
NO_KERNEL = {"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::expand", "aten::as_strided",
             "aten::select", "aten::slice", "aten::unsqueeze", "aten::squeeze", "aten::transpose", "aten::permute",
             "aten::t", "aten::alias", "aten::detach", "aten::empty", "aten::empty_strided", "aten::empty_like",
             "aten::resize_", "aten::unbind", "aten::split", "aten::chunk", "aten::flatten", "aten::unflatten",
             "aten::lift_fresh", "aten::_unsafe_view", "aten::set_", "aten::narrow", "aten::is_nonzero",
             "aten::item", "aten::_local_scalar_dense", "aten::result_type", "aten::numpy_T", "aten::dim",
             "aten::size", "aten::stride", "aten::is_same_size", "aten::_has_compatible_shallow_copy_type"}
PARTS = ("advance_tree", "walk", "compact", "settle", "renew_candidates")
TRITON = "triton::"  # a Triton launch's range: one kernel, whatever the interpreter runs under it


def labelled(name, fn):
    def run(*a, **k):
        with record_function(name):
            return fn(*a, **k)
    return run


def launches(e):
    """Whether e is an aten op of one kernel: not a view or an allocation, and no op under it launches one."""
    if e.name.startswith(TRITON):
        return True
    return e.name.startswith("aten::") and e.name not in NO_KERNEL and not any(map(has_kernel, e.cpu_children))


def has_kernel(e):
    return launches(e) or any(map(has_kernel, e.cpu_children))


def kernel_ops(events):
    """The ops of events that launch a kernel, by name."""
    return collections.Counter(e.name for e in events if launches(e))


def inside(events, label):
    """The events inside the ranges named label."""
    out = []
    for r in (e for e in events if e.name == label):
        stack = list(r.cpu_children)
        while stack:
            e = stack.pop()
            out.append(e)
            if not e.name.startswith(TRITON):
                stack.extend(e.cpu_children)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=48)
    ap.add_argument("--tree", default="4x3+2x3")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--top", type=int, default=12, help="the commonest ops of each part to list")
    ap.add_argument("--triton", action="store_true", help="the profiled pass with tree_triton's kernels (interpreted)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = tiny_model(n_layer=args.layers, block_size=64, vocab_size=512)
    cond, mask, condition = tiny_inputs(model, B=1)
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=args.window,
                    draft_coupling="pathwise", draft_tree=draft_tree.parse_tree(args.tree))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=100)
    with torch.no_grad():
        engine.generate(cond, 64, **kw)
        r = engine.runner
        for name in ("advance_tree", "settle", "renew_candidates"):  # on the instance: the class stays as it is
            setattr(r, name, labelled(name, getattr(r, name)))
        if args.triton:  # the generate above ran the torch ops (faster in the interpreter); the counted pass the kernels
            r.tree_kernels = True
            r.cache_table = tree_triton.cache_table([layer.attention.kv_cache for layer in model.layers])
        real_walk, real_compact = draft_tree.walk, draft_tree.compact
        real_kernels = tree_triton.compact, tree_triton.position_uniforms
        tree_triton.compact = labelled("compact", labelled(TRITON + "compact", tree_triton.compact))
        tree_triton.position_uniforms = labelled(TRITON + "position_uniforms", tree_triton.position_uniforms)
        draft_tree.walk, draft_tree.compact = labelled("walk", real_walk), labelled("compact", real_compact)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with record_function("pass"):
                    r.jacobi_pass()
        finally:
            draft_tree.walk, draft_tree.compact = real_walk, real_compact
            tree_triton.compact, tree_triton.position_uniforms = real_kernels
    events = prof.events()
    print(f"window {args.window}, tree {args.tree} ({r.tree.size} nodes), {args.layers} blocks, 1 image with CFG, "
          f"{'tree_triton' if args.triton else 'torch'}'s compact and noise")
    for label in ("pass",) + PARTS:
        print(f"{label:>17}: {sum(kernel_ops(inside(events, label)).values()):5d} kernel ops")
    for label in PARTS:
        print(f"{label}'s commonest:", ", ".join(f"{n.partition('::')[2]} {c}" for n, c in
                                              kernel_ops(inside(events, label)).most_common(args.top)))


if __name__ == "__main__":
    main()
