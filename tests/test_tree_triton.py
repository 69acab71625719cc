"""A draft tree's kernels (kernels/tree_triton.py) against draft_tree.py's ops, in Triton's CPU interpreter: compact
and the window noise's uniforms bit for bit at tiny shapes, planted mistakes that must differ, and tree runs whose
tokens must be the torch ops' for the same seed. Also: compact's in-place claim on every make_tree shape."""
import dataclasses
import itertools

import pytest
import torch

import early
import interpret
from fast_inference import draft_tree, plan

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
from fast_inference import draft_tree
from fast_inference.engine import Engine
from fast_inference.kernels import tree_triton
from fast_inference.model import KVCache
from fast_inference.speculative import position_noise
from test_speculative import SETTINGS, pathwise_case

checked = 0
g = torch.Generator().manual_seed(0)


def caches_of(layers, rows, heads, slots, head_dim):
    out = []
    for _ in range(layers):
        cache = KVCache(rows, heads, slots, head_dim, torch.float32)
        cache.k_cache.normal_(generator=g)
        cache.v_cache.normal_(generator=g)
        out.append(cache)
    return out


def compacted(caches, start, line, count, kernel, mistake=False):
    copies = []
    for c in caches:
        copy = KVCache(*c.k_cache.shape, torch.float32)
        copy.k_cache.copy_(c.k_cache)
        copy.v_cache.copy_(c.v_cache)
        copies.append(copy)
    if mistake:  # a moved node's source one slot past its own
        line = torch.where(line >= line.shape[1], line + 1, line)
    if kernel:
        tree_triton.compact(copies, start, line, count, tree_triton.cache_table(copies))
    else:
        draft_tree.compact(copies, start, line, count)
    return torch.stack([torch.stack([c.k_cache, c.v_cache]) for c in copies])


# 1. compact: several layers, with and without CFG rows, counts 0, partial and full, windows and trees of several sizes
for window, shape, cfg, heads, head_dim in ((4, (3, 2), True, 2, 8), (6, (2, 2, 2, 1), False, 3, 4),
                                            (8, (4, 3, 3, 3), True, 1, 16)):
    tree = draft_tree.make_tree(window, *shape)
    up, outside, lines = draft_tree.links(tree, window)
    images = 3
    ends = torch.tensor([tree.size - 1, window + 1, tree.size - 2])  # branch nodes: lines that move slots
    line = lines[ends]
    depth = torch.tensor(tree.depth)
    for count in (torch.zeros(images, dtype=torch.long), depth[ends] + 1, torch.full((images,), window)):
        rows = 2 * images if cfg else images
        start = torch.randint(5, 9, (images,), generator=g).repeat(2 if cfg else 1)
        caches = caches_of(3, rows, heads, 12 + tree.size, head_dim)
        want = compacted(caches, start, line, count, kernel=False)
        assert torch.equal(compacted(caches, start, line, count, kernel=True), want), (window, shape, count)
        before = compacted(caches, start, line, torch.zeros_like(count), kernel=False)
        if count.any():
            assert not torch.equal(want, before)  # the case moves slots
            assert not torch.equal(compacted(caches, start, line, count, kernel=True, mistake=True), want)
        checked += 1
print("compact", checked)

# 2. the window noise: position_noise's bits from the kernel's uniforms (V within one block and over several)
for images, L, V, seed in ((2, 4, 37, 3_000_000_019), (3, 6, 2100, 7), (1, 5, tree_triton.NOISE_BLOCK, 0)):
    positions = torch.randint(0, 300, (images, L), generator=g)
    want = position_noise(torch.tensor(seed), positions, V)
    out = torch.full((images, L, V), -1.0)
    got = tree_triton.position_uniforms(torch.tensor(seed), positions, out).log_().neg_()
    assert torch.equal(got, want), (images, L, V)
    wrong = tree_triton.position_uniforms(torch.tensor(seed), positions + 1, out).log_().neg_()
    assert not torch.equal(wrong, want)
    checked += 1
print("noise", checked)

# 3. tree runs (test_speculative's pathwise case, 8 images): the kernels give the torch ops' tokens, tokens per pass
# and caches, bit for bit; a kernel pass left uncompacted, or a source one slot off, leaves other caches
model, cond, mask, condition = pathwise_case()
idx = torch.arange(8) % 2
kw = dict(emb_masks=mask[idx], condition=condition[idx], **SETTINGS)
import forced_pass


def run(window, tree, kernels):  # the tokens, tokens per pass and every layer's keys and values after the run
    forced_pass.forced = dict(tree_ops="triton") if kernels else {}
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init="left",
                    draft_coupling="pathwise", draft_tree=tree)
    torch.manual_seed(0)
    out = engine.generate(cond[idx], 16, **kw)
    assert engine.runner.tree_kernels == kernels
    caches = torch.stack([torch.stack([layer.attention.kv_cache.k_cache, layer.attention.kv_cache.v_cache])
                          for layer in model.layers])
    return out, engine.last_speculation["tokens_per_pass"], caches


for window, tree in ((4, (3, 2)), (6, (4, 3, 2, 2))):
    want = run(window, tree, False)
    got = run(window, tree, True)
    assert torch.equal(got[0], want[0]) and got[1] == want[1] and torch.equal(got[2], want[2]), (window, tree)
    checked += 1
real = tree_triton.compact
for mistake in ("uncompacted", "source_off"):
    if mistake == "uncompacted":
        tree_triton.compact = lambda *a: None
    else:
        tree_triton.compact = lambda caches, start, line, count, table: real(
            caches, start, torch.where(line >= line.shape[1], line + 1, line), count, table)
    assert not torch.equal(run(6, (4, 3, 2, 2), True)[2], want[2]), mistake
    tree_triton.compact = real
    checked += 1

# 4. the nodes' distributions and draws in one kernel (verify_triton.tree, the plan's verify=triton) against
# probabilities() and the walk's draw; tree runs with it (top-p 1) give the torch verify's tokens; a draw from the next
# depth's noise changes them
from fast_inference.kernels import verify_triton
from fast_inference.speculative import probabilities
B, S, D, V = 3, 7, 4, 37
depth = torch.tensor([0, 1, 2, 3, 1, 2, 3])
log_noise = torch.empty(B, D, V).exponential_(1, generator=g).clamp_min_(torch.finfo(torch.float32).tiny).log_()
for guided, top_k, sample in ((True, 5, True), (False, 0, True), (True, 1, False)):
    logits = torch.randn(2 * B if guided else B, S, V, generator=g) * 3
    scale, temperature = torch.tensor(2.5), torch.tensor(0.9)
    want_p = probabilities(logits, guided, scale, temperature, top_k, 1.0, sample)
    p, target = verify_triton.tree(logits, log_noise, depth, scale, temperature, top_k, sample)
    torch.testing.assert_close(p, want_p, rtol=1e-6, atol=0)
    assert torch.equal(target, want_p.log().sub(log_noise[:, depth]).argmax(-1)), (guided, top_k, sample)
    checked += 1
kw = dict(kw, top_p=1.0)


def run_verify(window, tree, fused):  # the tokens and tokens per pass
    forced_pass.forced = dict(tree_ops="triton", verify="triton" if fused else "torch")
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init="left",
                    draft_coupling="pathwise", draft_tree=tree)
    torch.manual_seed(0)
    out = engine.generate(cond[idx], 16, **kw)
    assert (engine.runner.verify is verify_triton) == fused
    return out, engine.last_speculation["tokens_per_pass"]


for window, tree in ((4, (3, 2)), (6, (4, 3, 2, 2))):
    want, got = run_verify(window, tree, False), run_verify(window, tree, True)
    assert torch.equal(got[0], want[0]) and got[1] == want[1], (window, tree)
    checked += 1
real = verify_triton.tree
verify_triton.tree = lambda logits, log_noise, depth, *a: real(logits, log_noise, (depth + 1).clamp(max=5), *a)
assert not torch.equal(run_verify(6, (4, 3, 2, 2), True)[0], want[0])
verify_triton.tree = real
checked += 1
print("ok", checked)
"""

EARLY = {"test_tree_kernels_give_the_torch_ops_bits_and_tokens_in_interpreter": (SCRIPT, interpret.ENV)}


def test_tree_kernels_give_the_torch_ops_bits_and_tokens_in_interpreter():
    """tree_triton.compact moves the same keys and values as draft_tree.compact (3 layers, CFG rows or not, counts 0,
    partial and full, three trees), a source one slot off differs; position_uniforms' logs are position_noise's bits;
    tree runs with both kernels give the torch ops' tokens, tokens per pass and caches; a run left uncompacted, or
    with a source one slot off, leaves other caches. verify_triton.tree gives probabilities()' node distributions and
    the walk's draws; tree runs with it give the torch verify's tokens, and a draw from the next depth's noise not."""
    out = early.result(SCRIPT, interpret.ENV, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", "22"], out.stdout


@pytest.mark.parametrize("window", [2, 4, 8, 48])
def test_compact_moves_no_slot_it_moves_into(window):
    """Every line of every make_tree shape: depth d's node is the chain's node d (not moved) or a branch node (past the
    chain's L), so the slots compact reads are never ones it writes (in place is safe); links asserts it too."""
    for width, depth, side, side_depth in itertools.product((1, 2, 4), (1, 2, 3), (0, 1, 3), (1, 3)):
        if depth >= window or side and side + side_depth >= window:
            continue
        tree = draft_tree.make_tree(window, width, depth, side, side_depth)
        for end in range(tree.size):
            line = draft_tree.line_from(tree, end, window)
            assert all(node == d or node >= window for d, node in enumerate(line)), (window, tree, end)
            assert all(tree.depth[node] == d for d, node in enumerate(line))


def test_the_plan_runs_the_tree_kernels_where_triton_runs_on_cuda():
    hopper = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=16,
                            draft_tree=(4, 3), overrides=(("jacobi", "on"), ("draft_tree", "on")))
    assert plan.make(hopper).jacobi.tree_ops == "triton" and "tree_triton" in plan.explain(plan.make(hopper))
    for where in (dict(device="cpu", capability=None, dtype=torch.float32), dict(triton=False), dict(draft_tree=())):
        assert plan.make(dataclasses.replace(hopper, **where)).jacobi.tree_ops == "torch", where
    # the override: torch's ops anywhere, the kernels only where Triton runs on CUDA
    torch_ops = dataclasses.replace(hopper, overrides=hopper.overrides + (("tree_ops", "torch"),))
    assert plan.make(torch_ops).jacobi.tree_ops == "torch"
    with pytest.raises(plan.PlanError, match="tree_ops=triton needs Triton on a CUDA device"):
        plan.make(dataclasses.replace(hopper, triton=False, overrides=hopper.overrides + (("tree_ops", "triton"),)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tree_kernels_give_the_torch_ops_bits_on_cuda():
    """On the GPU (compiled, not interpreted): compact over 36 layers of bfloat16 caches at GPT-XL's heads and the
    window noise at LlamaGen's vocabulary, bit for bit as the torch ops."""
    from fast_inference.kernels import tree_triton
    from fast_inference.model import KVCache
    from fast_inference.speculative import position_noise
    window, shape = 48, (4, 3, 2, 3)
    tree = draft_tree.make_tree(window, *shape)
    _, _, lines = draft_tree.links(tree, window, "cuda")
    ends = torch.tensor([tree.size - 1, window + 2], device="cuda")
    line, count = lines[ends], torch.tensor(tree.depth, device="cuda")[ends] + 1
    start = torch.tensor([700, 650], device="cuda").repeat(2)
    done = []
    for kernel in (False, True):
        torch.manual_seed(0)
        caches = [KVCache(4, 20, 800, 64, torch.bfloat16).cuda() for _ in range(36)]
        for c in caches:
            c.k_cache.normal_()
            c.v_cache.normal_()
        if kernel:
            tree_triton.compact(caches, start, line, count, tree_triton.cache_table(caches))
        else:
            draft_tree.compact(caches, start, line, count)
        done.append(torch.stack([torch.stack([c.k_cache, c.v_cache]) for c in caches]))
    assert torch.equal(done[0], done[1])
    seed, positions = torch.tensor(2**32 - 5, device="cuda"), torch.arange(96, device="cuda").view(2, 48) * 7
    out = torch.empty(2, 48, 16384, device="cuda")
    assert torch.equal(tree_triton.position_uniforms(seed, positions, out).log_().neg_(),
                       position_noise(seed, positions, 16384))
