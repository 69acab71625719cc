"""A draft tree's pass on the fused block's kernels (the plan's window_block=fused: each key at its node's slot, its
RoPE row its depth's), in Triton's CPU interpreter: greedy tree runs whose tokens must be the reference's, a planted
slot mistake not; where the plan takes the fused block for a tree."""
import dataclasses

import pytest
import torch

import early
import interpret
from fast_inference import plan

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
from fast_inference import model as model_module, plan
from fast_inference.engine import Engine
from fast_inference.generate import generate
from fast_inference.kernels.block import fused_block
from test_reference import greedy_case
import forced_pass

checked = 0

# a tree's pass on the fused block's kernels, greedy (the tokens follow every logit), 2 x 19 nodes = 38 rows on the
# window kernels: the reference's tokens, as the eager blocks give them; every node's key written at the window's
# first slot gives others
model, cond, n, kw = greedy_case()
ref = generate(model, cond, n, **kw)
window_kernels = dict(attention="triton", inputs="triton")


def run_fused(fused):
    rows = 2 * cond.shape[0] * 19
    forced_pass.forced = dict(window_kernels, block="fused", rows=plan.pass_rows(rows)) if fused else window_kernels
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=6, draft_init="left",
                    draft_coupling="pathwise", draft_tree=(4, 3, 2, 2))
    out = engine.generate(cond, n, **kw)
    assert (getattr(engine.runner.pass_ctx.block, "func", None) is fused_block) == fused
    return out


assert torch.equal(run_fused(False), ref) and torch.equal(run_fused(True), ref)
checked += 1
slots = model_module.window_slots
model_module.window_slots = lambda start, ancestry: start[:, None] + 0 * ancestry
assert not torch.equal(run_fused(True), ref)
model_module.window_slots = slots
checked += 1
print("ok", checked)
"""

EARLY = {"test_a_tree_pass_on_the_fused_block_gives_the_reference_s_tokens_in_interpreter": (SCRIPT, interpret.ENV)}


def test_a_tree_pass_on_the_fused_block_gives_the_reference_s_tokens_in_interpreter():
    """A greedy tree run on the fused block's kernels gives the eager blocks' (the reference's) tokens; its keys all
    written at the window's first slot do not."""
    out = early.result(SCRIPT, interpret.ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", "2"], out.stdout


def test_a_tree_runs_the_fused_block_by_its_override_up_to_pass_fused_rows():
    """window_block=fused takes a draft tree's pass up to PASS_FUSED_ROWS rows, as a chain's: 4x3 at a window of 4
    (2 x 13 rows at n = 1) on the fused kernels, n = 1's 126 rows of 4x3+2x3 at 48 on inductor's block."""
    kernels = (("window_attention", "triton"), ("window_inputs", "triton"), ("window_block", "fused"))
    tree = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=48,
                          draft_coupling="pathwise", draft_tree=(4, 3, 2, 3),
                          overrides=(("jacobi", "on"), ("draft_tree", "on")) + kernels)
    assert plan.make(tree).jacobi.block == "compiled"
    small = dataclasses.replace(tree, draft_window=4, draft_tree=(4, 3))
    j = plan.make(small).jacobi
    assert j.block == "fused" and j.rows.rows == 26 and j.rows.projection("qkv").impl == "triton_dot"
    assert "fused (Triton dot" in plan.explain(plan.make(small))
    assert plan.make(dataclasses.replace(small, batch=2)).jacobi.block == "compiled"  # 52 rows
    chain = dataclasses.replace(tree, draft_window=32, draft_tree=())
    assert plan.make(chain).jacobi.block == "compiled"  # 64 rows: past PASS_FUSED_ROWS
    assert plan.make(dataclasses.replace(chain, draft_window=16)).jacobi.block == "fused"
