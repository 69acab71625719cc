"""The fused verify (kernels/verify_triton.py) against speculative.py's ops, in Triton's CPU interpreter: each kernel
against the torch it replaces at tiny shapes (CFG pairs and not, top-k, greedy, fresh and coupled noise, every kind
of window slot), then whole speculative runs whose tokens must be the torch verify's for the same seeds (every draft
init and coupling, and the exact test's tiny vocabulary at 300 images), and planted mistakes that must change them."""
import dataclasses

import pytest
import torch

import early
import interpret
import sm90
from fast_inference import plan

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
from fast_inference import speculative
from fast_inference.engine import Engine
from fast_inference.kernels import verify_triton as vt
from fast_inference.speculative import coupled_race, position_keys, position_noise, probabilities, residual
from test_reference import tiny_inputs, tiny_model

TINY = torch.finfo(torch.float32).tiny
checked = 0


def race_with(p, noise):  # speculative.race with the given Exp(1) noise
    return p.log().sub(noise.clamp_min(TINY).log()).argmax(-1)


# 1. the kernels against the ops they replace
g = torch.Generator().manual_seed(0)
B, L, V = 3, 4, 37
for guided, top_k, sample in ((True, 5, True), (False, 0, True), (True, 1, False), (True, V, True), (True, 2, True)):
    logits = torch.randn(2 * B if guided else B, L, V, generator=g) * 3
    if top_k == 2:  # ties at the k-th largest survive, as filter_logits keeps them
        logits[..., 7] = logits[..., 9] = logits.amax(-1) + 1
    drafts = torch.randint(0, V, (B, L), generator=g)
    pos = torch.randint(0, 100, (B, L), generator=g)
    seed, scale, temperature = torch.tensor(3_000_000_019), torch.tensor(2.5), torch.tensor(0.9)
    p = probabilities(logits, guided, scale, temperature, top_k, 1.0, sample)
    for noise in (None, torch.empty(B, L, V).exponential_(1, generator=g)):
        st = vt.rows(logits, drafts, pos, seed, scale, temperature, top_k, sample, noise)
        torch.testing.assert_close(st.pd, p.gather(-1, drafts[..., None])[..., 0], rtol=1e-6, atol=0)
        want = coupled_race(p, position_noise(seed, pos, V)) if noise is None else race_with(p, noise)
        assert torch.equal(st.redraw, want), (guided, top_k, st.redraw, want)
        checked += 1
    q = torch.softmax(torch.randn(B, L, V, generator=g) * 2, -1)
    q[0, :, :5] = 0  # tokens the residual must draw where q is 0
    j = torch.randint(0, L, (B,), generator=g)
    fresh = torch.empty(B, V).exponential_(1, generator=g)
    images = torch.arange(B)
    fixed = vt.residual(logits, q, st, j, fresh, scale, temperature, sample)
    assert torch.equal(fixed, race_with(residual(p[images, j], q[images, j]), fresh)), (fixed,)
    mode = torch.tensor([[vt.FROM_PASS, vt.ONE_HOT, vt.UNIFORM, vt.UNIFORM_KEYED]] * B)
    mode[1] = vt.FROM_PASS
    src = torch.randint(0, L, (B, L), generator=g)
    slot_drafts = torch.randint(0, V, (B, L), generator=g)
    given = slot_drafts.clone()
    out = torch.full((B, L, V), -1.0)
    vt.window(logits, out, st, mode, src, slot_drafts, pos, seed, scale, temperature, sample)
    keyed = position_keys(seed, pos, V).argmax(-1)
    for b in range(B):
        for k in range(L):
            m = int(mode[b, k])
            want = (p[b, src[b, k]] if m == vt.FROM_PASS else
                    torch.nn.functional.one_hot(given[b, k], V).float() if m == vt.ONE_HOT else torch.full((V,), 1.0 / V))
            torch.testing.assert_close(out[b, k], want, rtol=1e-6, atol=0)
            assert slot_drafts[b, k] == (keyed[b, k] if m == vt.UNIFORM_KEYED else given[b, k])
    checked += 1
print("kernels", checked)

# 2. whole runs: the fused verify's tokens are the torch verify's for the same seeds
import forced_pass


def run(model, cond, n, kw, init, coupling, window, verify, seed=0):
    forced_pass.forced = dict(verify="triton") if verify else {}
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init=init,
                    draft_coupling=coupling)
    torch.manual_seed(seed)
    out = engine.generate(cond, n, **kw)
    assert (engine.runner.verify is vt) == verify
    return out, engine.last_speculation["tokens_per_pass"]


model = tiny_model(cls=8, seed=3)
with torch.no_grad():
    model.output.weight.mul_(0.3)  # a spread distribution: drafts rejected and accepted
cond, mask, condition = tiny_inputs(model)
kw = dict(emb_masks=mask, condition=condition, cfg_scale=2.0, control_strength=0.8, top_k=64, temperature=0.9)
n = model.args.block_size
for init, coupling, window in (("left", "gumbel", 4), ("random", "none", 4), ("above", "gumbel", 4),
                               ("above", "none", 3), ("random", "gumbel", 3), ("left", "pathwise", 4)):
    (want, tpp), (got, tpp2) = (run(model, cond, n, kw, init, coupling, window, v) for v in (False, True))
    assert torch.equal(got, want), (init, coupling, got, want)
    assert tpp == tpp2 and 1 < tpp < window, (init, coupling, tpp)  # rejections and acceptances both happen
    checked += 1
greedy = dict(kw, top_k=1)
from fast_inference.generate import generate
assert torch.equal(run(model, cond, n, greedy, "left", "gumbel", 4, True)[0], generate(model, cond, n, **greedy))
checked += 1
print("runs", checked)

# 3. the exact test's tiny vocabulary (tests/test_speculative.py), top-p 1: 300 images whose rows accept different
# counts, the same tokens; then planted mistakes in the fused path change them
from test_speculative import distribution_case
model, cond, mask, condition = distribution_case()
idx = torch.arange(300) % 2
case = (model, cond[idx], 4, dict(emb_masks=mask[idx], condition=condition[idx], cfg_scale=2.5, temperature=0.9, top_k=3,
                                  control_strength=0.8))
for init, coupling in (("random", "none"), ("left", "gumbel")):
    want = run(*case, init, coupling, 3, False)[0]
    assert torch.equal(run(*case, init, coupling, 3, True)[0], want), (init, coupling)
    checked += 1
want = run(*case, "random", "none", 3, False)[0]
real_window, real_residual = vt.window, vt.residual
for mistake in ("stale_q", "residual_row"):
    if mistake == "stale_q":  # the next window's q from the position after the slot's own
        vt.window = lambda logits, q, st, mode, src, *a: real_window(logits, q, st, mode, (src + 1).clamp(max=2), *a)
    else:  # the residual drawn at the position after the first rejected one
        vt.residual = lambda logits, q, st, j, *a: real_residual(logits, q, st, (j + 1).clamp(max=2), *a)
    got = run(*case, "random", "none", 3, True)[0]
    vt.window, vt.residual = real_window, real_residual
    assert not torch.equal(got, want), mistake
    checked += 1
print("ok", checked)
"""

AOT_SCRIPT = r"""
from fast_inference.kernels import draw_triton, verify_triton as vt
from sm90 import build

V = 16384  # GPT-XL's vocabulary
VP = 16384
warps, registers = draw_triton.warps_and_registers(VP)
options = {"num_warps": warps, "maxnreg": registers, "enable_fp_fusion": False}
tree = {"LOGITS": "*fp32", "LOG_NOISE": "*fp32", "DEPTH": "*i64", "P": "*fp32", "TARGET": "*i64", "CFG_SCALE": "*fp32",
        "TEMPERATURE": "*fp32", "nrows": "i32", "S": "i32", "D": "i32"}
for guided, top_k in ((True, 2000), (False, 0)):
    build(vt._tree_kernel, tree, {"V": V, "VP": VP, "TOP_K": top_k, "GUIDED": guided, "SAMPLE": True}, options)
print("compiled")
"""

EARLY = {"test_verify_kernels_give_the_torch_verify_s_tokens_in_interpreter": (SCRIPT, interpret.ENV),
         "test_tree_kernel_compiles_for_sm90": (AOT_SCRIPT, sm90.env())}


def test_tree_kernel_compiles_for_sm90():
    """verify_triton.tree's kernel at GPT-XL's 16,384-token vocabulary, with CFG and top-k 2000 and without: an H100/H200
    cubin with Triton's bundled ptxas, no register spills (a row of logits in local memory would be slow)."""
    sm90.run(AOT_SCRIPT)


def test_verify_kernels_give_the_torch_verify_s_tokens_in_interpreter():
    """verify_triton's kernels against speculative.py's ops (p at the drafts within 1e-6, the same redraws, residual
    draws, next-window q rows and coupled uniform drafts); speculative runs of every draft init and coupling on the
    tiny model give the torch verify's tokens for the same seed (and the reference's greedy ones), and so do 300
    images of the exact test's tiny vocabulary; a stale q or a residual at the wrong position changes them."""
    out = early.result(SCRIPT, interpret.ENV, timeout=1500)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", "26"], out.stdout


def test_the_plan_takes_the_fused_verify_where_measured_and_refuses_it_where_it_cannot_run():
    hopper = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=16,
                            overrides=(("jacobi", "on"),))
    assert plan.make(hopper).jacobi.verify == ("triton" if plan.VERIFY_KERNELS else "torch")
    on = dataclasses.replace(hopper, overrides=(("jacobi", "on"), ("verify", "triton")))
    p = plan.make(on)
    assert p.jacobi.verify == "triton" and "verify_triton" in plan.explain(p)
    assert "speculative.py's ops" in plan.explain(plan.make(hopper)) or plan.VERIFY_KERNELS
    for where in (dict(top_p=0.9), dict(device="cpu", capability=None)):
        with pytest.raises(plan.PlanError, match="verify=triton needs"):
            plan.make(dataclasses.replace(on, **where))
    # a draft tree: its kernel (verify_triton.tree) as a chain's, measured faster on an H100; verify=torch keeps the ops
    tree = dataclasses.replace(hopper, draft_tree=(2, 1), overrides=(("jacobi", "on"), ("draft_tree", "on")))
    p = plan.make(tree)
    assert p.jacobi.verify == ("triton" if plan.VERIFY_KERNELS else "torch")
    assert "verify_triton.tree" in plan.explain(p) or not plan.VERIFY_KERNELS
    off = plan.make(dataclasses.replace(tree, overrides=tree.overrides + (("verify", "torch"),)))
    assert off.jacobi.verify == "torch" and "verify_triton.tree" not in plan.explain(off)
    with pytest.raises(plan.PlanError, match="verify=triton needs"):
        plan.make(dataclasses.replace(tree, top_p=0.9, overrides=tree.overrides + (("verify", "triton"),)))


def test_jacobi_falls_back_to_plain_steps_where_the_pass_measured_a_loss():
    """PASS_GAINS: on a CUDA device --speculative jacobi runs plain steps where its measured gain is under 1, says so
    in --explain, and runs the passes with jacobi=on; the CPU (no table) keeps the passes."""
    gpu = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=16)
    kernels = (("window_attention", "triton"), ("window_inputs", "triton"))
    generic = (("window_attention", "sdpa"), ("window_inputs", "model"))
    losses = 0
    for batch, overrides in ((1, ()), (8, ()), (32, ()), (8, kernels), (1, kernels), (8, generic), (32, generic)):
        s = dataclasses.replace(gpu, batch=batch, overrides=overrides)
        forced = plan.make(dataclasses.replace(s, overrides=overrides + (("jacobi", "on"),))).jacobi
        assert forced is not None
        gain = plan.pass_gain(s, forced.attention == "triton")
        p = plan.make(s)
        assert (p.jacobi is None) == (gain < 1), (batch, overrides)
        assert ("plain steps: --speculative jacobi measured" in plan.explain(p)) == (gain < 1)
        losses += gain < 1
    assert losses  # the table holds a loss (the generic path at n = 8), so the fallback is exercised
    assert plan.pass_gain(dataclasses.replace(gpu, batch=32), False) == plan.PASS_GAINS[(False, 8)]
    assert plan.make(dataclasses.replace(gpu, device="cpu", capability=None, dtype=torch.float32)).jacobi is not None


def test_a_draft_tree_falls_back_to_the_chain_where_it_measured_a_loss():
    """TREE_GAINS: on a CUDA device --draft-tree runs the chain of the same window where the tree's passes measured a
    loss against plain steps (n = 8 on an H100), says so in --explain, and keeps the tree with draft_tree=on, where it
    gained (n = 1) and on the CPU (no table)."""
    tree = (4, 3, 7, 3)
    gpu = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=32, draft_tree=tree)
    for batch in (1, 8, 32):
        s = dataclasses.replace(gpu, batch=batch)
        p = plan.make(s)
        loses = plan.TREE_GAINS[max(n for n in plan.TREE_GAINS if n <= batch)] < 1
        assert (p.jacobi.tree == ()) == loses and (p.jacobi.nodes == 32 if loses else p.jacobi.nodes == 62), batch
        assert ("draft tree    the chain: --draft-tree 4x3+7x3 measured" in plan.explain(p)) == loses
        assert "draft tree of 62 nodes" in plan.explain(p) or loses
        forced = plan.make(dataclasses.replace(s, overrides=(("draft_tree", "on"),))).jacobi
        assert forced.tree == tree and forced.nodes == 62
    assert any(g < 1 for g in plan.TREE_GAINS.values()) and any(g >= 1 for g in plan.TREE_GAINS.values())
    cpu = dataclasses.replace(gpu, device="cpu", capability=None, dtype=torch.float32, batch=8)
    assert plan.make(cpu).jacobi.tree == tree


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("coupling", ["gumbel", "none", "tree"])
def test_fused_verify_gives_the_torch_verify_s_tokens_on_cuda(coupling):
    """fp32 at GPT-XL's width (2 blocks), 2 images x 256 tokens sampled (top-k 100), the pass captured: verify=triton
    draws the tokens of verify=torch for the same seed, and its replay the same again (tree: a 4x3+2x3 draft tree of
    the pathwise coupling, verify_triton.tree)."""
    from fast_inference.engine import Engine
    from test_reference import tiny_inputs, tiny_model

    model = tiny_model(dim=1280, n_head=20, n_layer=2, block_size=256, seed=5).to("cuda")
    cond, mask, condition = (t.to("cuda") for t in tiny_inputs(model))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=100)
    outs = []
    for verify in ("torch", "triton"):
        drafts = (dict(draft_window=16, draft_coupling=coupling) if coupling != "tree" else
                  dict(draft_window=32, draft_coupling="pathwise", draft_tree=(4, 3, 2, 3)))
        on = ("jacobi=on", f"verify={verify}") + (("draft_tree=on",) if coupling == "tree" else ())
        engine = Engine(model, backend="inductor", speculative="jacobi", overrides=on, **drafts)
        for _ in range(2):  # captured, then replayed
            torch.manual_seed(3)
            outs.append(engine.generate(cond, 256, **kw))
        assert engine.plan.jacobi.verify == verify and 1 < engine.last_speculation["tokens_per_pass"] < 32
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
