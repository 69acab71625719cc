"""A pass's projections through block_triton.project (the plan's window_projections=triton), in Triton's CPU
interpreter: the op against x @ W.T at a tree pass's row counts, and tree runs whose tokens must be cuBLAS's (torch's)
for the same seed, a planted row mistake not; the plan's override and where it refuses."""
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
from fast_inference.engine import Engine
from fast_inference.kernels import block_triton
from test_speculative import SETTINGS, pathwise_case
import forced_pass

checked = 0
g = torch.Generator().manual_seed(0)

# 1. the op at 3, 33 and 126 rows (a tree pass's 2 x 63 at n = 1), each projection's tiling, against x @ W.T in float32
for rows in (3, 33, 126):
    for name, N, K in (("qkv", 96, 32), ("wo", 32, 32), ("gate_up", 176, 32), ("w2", 32, 88)):
        x = torch.randn(2, rows, K, generator=g)[:, :, :]
        w = torch.randn(N, K, generator=g)
        got = block_triton.project(x, w, name)
        assert got.shape == (2, rows, N), got.shape
        torch.testing.assert_close(got, x @ w.T, rtol=1e-5, atol=1e-5)
        checked += 1

# 2. tree runs (test_speculative's pathwise case, 8 images, eager blocks): the same tokens and tokens per pass through
# the op as through torch's linear; the op with its first output row (the window's first node: always read) zeroed
# gives other tokens
model, cond, mask, condition = pathwise_case()
idx = torch.arange(8) % 2
kw = dict(emb_masks=mask[idx], condition=condition[idx], **SETTINGS)


def run(window, tree, projections):
    forced_pass.forced = dict(projections=projections)
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init="left",
                    draft_coupling="pathwise", draft_tree=tree)
    torch.manual_seed(0)
    out = engine.generate(cond[idx], 16, **kw)
    assert (engine.runner.pass_ctx.ops.linear is block_triton.project) == (projections == "triton")
    return out, engine.last_speculation["tokens_per_pass"]


want = run(6, (4, 3, 2, 2), "torch")
got = run(6, (4, 3, 2, 2), "triton")
assert torch.equal(got[0], want[0]) and got[1] == want[1]
checked += 1
real = block_triton.linear
block_triton.linear = lambda x, *a, **k: torch.cat([torch.zeros_like(real(x, *a, **k)[:1]), real(x, *a, **k)[1:]])
assert not torch.equal(run(6, (4, 3, 2, 2), "triton")[0], want[0])
block_triton.linear = real
checked += 1

# 3. a tree's pass on the fused block's kernels (window_block=fused: each key at its node's slot, its RoPE row its
# depth's), greedy (the tokens follow every logit), 2 x 19 nodes = 38 rows on the window kernels: the reference's
# tokens, as the eager blocks give them; every node's key written at the window's first slot gives others
from fast_inference import model as model_module, plan
from fast_inference.generate import generate
from fast_inference.kernels.block import fused_block
from test_reference import tiny_inputs, tiny_model
model = tiny_model(cls=8, seed=3)
cond, mask, condition = tiny_inputs(model)
kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, control_strength=0.8, top_k=1)
n = model.args.block_size
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

EARLY = {"test_projections_through_the_op_give_torch_s_tokens_in_interpreter": (SCRIPT, interpret.ENV)}


def test_projections_through_the_op_give_torch_s_tokens_in_interpreter():
    """block_triton.project equals x @ W.T (float32) at 3, 33 and 126 rows for each projection's tiling; tree runs
    through it give torch's tokens and tokens per pass; its first output row zeroed gives others. A tree's pass on the
    fused block's kernels gives the eager blocks' tokens; its keys all written at the window's first slot do not."""
    out = early.result(SCRIPT, interpret.ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", "16"], out.stdout


def test_the_plan_takes_the_op_by_its_override_and_refuses_it_where_it_cannot_run():
    """window_projections: cuBLAS's by default; triton by the override for a tree's pass on CUDA, named in --explain;
    refused on the CPU, with int8 weights, past PROJECT_ROWS rows and with the fused block (its own projections)."""
    tree = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=48,
                          draft_coupling="pathwise", draft_tree=(4, 3, 2, 3),
                          overrides=(("jacobi", "on"), ("draft_tree", "on")))
    p = plan.make(tree)
    assert p.jacobi.projections == "torch" and "cuBLAS's GEMMs" in plan.explain(p)
    on = dataclasses.replace(tree, overrides=tree.overrides + (("window_projections", "triton"),))
    p = plan.make(on)
    assert p.jacobi.projections == "triton" and p.situation.rows * p.jacobi.nodes == 126
    assert "block_triton.project" in plan.explain(p)
    chain = dataclasses.replace(on, draft_window=16, draft_tree=(),
                                overrides=on.overrides + (("window_attention", "triton"), ("window_block", "fused")))
    for where in (dict(device="cpu", capability=None, dtype=torch.float32), dict(int8=True), dict(batch=2), chain):
        s = where if isinstance(where, plan.Situation) else dataclasses.replace(on, **where)
        with pytest.raises(plan.PlanError, match="window_projections=triton needs"):
            plan.make(s)


def test_a_tree_runs_the_fused_block_by_its_override_up_to_project_rows():
    """window_block=fused takes a draft tree's pass (each key at its node's slot) up to PROJECT_ROWS rows: n = 1's 126
    on the fused kernels at their 126 rows, n = 2's 252 on inductor's block; a chain keeps PASS_FUSED_ROWS."""
    kernels = (("window_attention", "triton"), ("window_inputs", "triton"), ("window_block", "fused"))
    tree = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=48,
                          draft_coupling="pathwise", draft_tree=(4, 3, 2, 3),
                          overrides=(("jacobi", "on"), ("draft_tree", "on")) + kernels)
    j = plan.make(tree).jacobi
    assert j.block == "fused" and j.rows.rows == 126 and j.rows.projection("qkv").impl == "triton_dot"
    assert "fused (Triton dot" in plan.explain(plan.make(tree))
    assert plan.make(dataclasses.replace(tree, batch=2)).jacobi.block == "compiled"
    chain = dataclasses.replace(tree, draft_window=32, draft_tree=())
    assert plan.make(chain).jacobi.block == "compiled"  # 64 rows: past PASS_FUSED_ROWS
    assert plan.make(dataclasses.replace(chain, draft_window=16)).jacobi.block == "fused"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [33, 126])
def test_the_op_on_cuda_is_cublas_s_product_in_bf16(rows):
    """On the GPU at GPT-XL's projections (bf16, 128-row tilings): within bf16's rounding of cuBLAS's product."""
    from fast_inference.kernels import block_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K in (("qkv", 3840, 1280), ("wo", 1280, 1280), ("gate_up", 7168, 1280), ("w2", 1280, 3584)):
        x = torch.randn(rows, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).bfloat16()
        torch.testing.assert_close(block_triton.project(x, w, name).float(), (x @ w.T).float(), rtol=2e-2, atol=2e-2)
