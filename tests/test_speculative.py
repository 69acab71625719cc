"""Speculative Jacobi decoding (speculative.py) against the reference sampler: greedy identity, and the exact
distribution of whole token sequences on a tiny vocabulary, which planted mistakes must break."""
import copy
import functools
import itertools
import math
import types

import pytest
import torch

from fast_inference import engine as engine_module
from fast_inference import generate as generate_module
from fast_inference import draft_tree, plan, speculative
from fast_inference.engine import Engine
from fast_inference.generate import Prepared, generate, prepare
from fast_inference.plan import PlanError
from fast_inference.sampling import cfg_merge, filter_logits
from test_reference import greedy_case, tiny_inputs, tiny_model


@pytest.mark.parametrize("backend,init,window,coupling,tree", [
    ("eager", "random", 3, "none", ()), ("eager", "left", 4, "none", ()), ("eager", "above", 4, "none", ()),
    ("eager", "random", 4, "gumbel", ()), ("inductor", "random", 4, "none", ()), ("eager", "left", 4, "pathwise", ()),
    ("eager", "left", 4, "pathwise", (4, 3)), ("eager", "left", 4, "pathwise", (2, 1, 2, 1))])
def test_greedy_tokens_equal_reference(backend, init, window, coupling, tree):
    model, cond, n, kw = greedy_case()
    ref = generate(model, cond, n, **kw)
    engine = Engine(model, backend=backend, speculative="jacobi", draft_window=window, draft_init=init,
                    draft_coupling=coupling, draft_tree=tree)
    assert torch.equal(engine.generate(cond, n, **kw), ref)
    stats = engine.last_speculation
    assert len(stats["passes"]) == 2 and all(-(-(n - 1) // window) <= p <= n - 1 for p in stats["passes"])
    assert stats["tokens_per_pass"] == pytest.approx(2 * (n - 1) / sum(stats["passes"]))
    assert torch.equal(engine.generate(cond, n, **kw), ref)  # again: the shape's pass reused
    r = engine.runner  # a pass's query rows (the pass prefetcher's plan): every key_valid row's window or tree
    assert r.pass_rows == r.key_valid.shape[0] * (draft_tree.tree_size(window, *tree) if tree else window)


class PrefetchRecord:
    """A pass prefetcher's calls; start says whether a graph is being captured."""

    def __init__(self, capturing):
        self.capturing, self.calls = capturing, []

    def start(self, rows):
        self.calls.append(("start", rows))
        return self.capturing

    def join(self):
        self.calls.append("join")

    def reset(self):
        self.calls.append("reset")


@pytest.mark.parametrize("capturing", [True, False])
def test_a_pass_runs_beside_its_prefetcher_inside_a_capture_only(capturing):
    """run_pass: the prefetcher started at the pass's rows before it and joined after it inside a capture; outside one
    (the capture's warm-up) it does not run and its count (the window attention counts anyway) is put back."""
    record = PrefetchRecord(capturing)
    runner = types.SimpleNamespace(pass_prefetcher=record, pass_rows=126,
                                   jacobi_pass=lambda: record.calls.append("pass"))
    speculative.JacobiRunner.run_pass(runner)
    assert record.calls == [("start", 126), "pass", "join" if capturing else "reset"]
    runner.pass_prefetcher, record.calls = None, []
    speculative.JacobiRunner.run_pass(runner)
    assert record.calls == ["pass"]


def test_hash32_is_lowbias32():
    """speculative.hash32 in int64 tensors against the hash written in Python integers (mod 2**32)."""
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    xs = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF] + list(range(12345, 2**32, 2**32 // 97))
    assert speculative.hash32(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_position_noise_is_exponential_and_fixed_by_position():
    """Coupled drafts' noise: Exp(1) (mean 1, P(E > 1) = 1/e, within 5 standard errors over 2 x 64 x 512 values),
    the same for the same (seed, image, position, token) wherever the position sits in the window, another for
    another seed or image."""
    seed = torch.tensor(12345)
    positions = torch.arange(128).reshape(2, 64)
    e = speculative.position_noise(seed, positions, 512)
    n = e.numel()
    assert abs(e.mean().item() - 1) < 5 / math.sqrt(n) and abs((e > 1).double().mean().item() - math.exp(-1)) < 5 * (
        math.exp(-1) * (1 - math.exp(-1)) / n) ** 0.5
    shifted = speculative.position_noise(seed, positions[:, 5:9], 512)
    assert torch.equal(shifted, e[:, 5:9])
    assert not torch.equal(speculative.position_noise(seed + 1, positions, 512), e)
    assert not torch.equal(e[0], speculative.position_noise(seed, positions[[1, 0]], 512)[1])


# ---- the exact distribution ----------------------------------------------------------------------------------------

V, N, WINDOW = 4, 4, 3  # 256 sequences; the first token from the prefill, three from passes of 3 positions
SETTINGS = dict(cfg_scale=2.5, temperature=0.9, top_k=3, top_p=0.95, control_strength=0.8)
SAMPLES = 4000  # images, half per caption


def distribution_case():
    """A tiny model over 4 tokens whose output is scaled so that the sequences' distribution is spread (entropy
    ~3.5 nats over ~75 sequences per caption), two captions with their own controls."""
    model = tiny_model(cls=8, seed=5, block_size=4, vocab_size=V)
    with torch.no_grad():
        model.output.weight.mul_(0.05)
        model.tok_embeddings.weight.mul_(4)  # the next token's distribution depends on the tokens before it
    cond, mask, condition = tiny_inputs(model, B=2, valid=(3, 6))
    return model, cond, mask, condition[..., :32, :32]


def repeat_prepare(monkeypatch, module, cond, mask, condition, idx):
    """module's prepare() run once per caption, its rows repeated as idx picks them: the condition encoder of
    thousands of images would be most of the test's time (prepare itself is tested elsewhere)."""
    def prepared(model, cond_, condition_, emb_masks, cfg_scale, strength):
        p = prepare(model, cond, condition, mask, cfg_scale, strength)
        rows = torch.cat([idx, idx + cond.shape[0]])  # both CFG halves
        return Prepared(p.prefix[rows], p.text_mask[rows], p.controls[:, rows])

    monkeypatch.setattr(module, "prepare", prepared)


def reference_probabilities(model, cond, mask, condition):
    """(captions, V**N): the reference sampler's probability of every sequence, by teacher forcing: the product of
    each token's probability under sampling.py's CFG merge, temperature, top-k and top-p."""
    seqs = torch.tensor(list(itertools.product(range(V), repeat=N)))
    out = []
    for c in range(cond.shape[0]):
        rows = torch.zeros(len(seqs), dtype=torch.long) + c
        with pytest.MonkeyPatch.context() as monkeypatch:
            repeat_prepare(monkeypatch, generate_module, cond, mask, condition, rows)
            _, logits = generate(model, cond[rows], N, emb_masks=mask[rows], condition=condition[rows], forced=seqs,
                                 return_logits=True, cfg_scale=SETTINGS["cfg_scale"],
                                 control_strength=SETTINGS["control_strength"])
        logp = torch.zeros(len(seqs), dtype=torch.float64)
        for j, l in enumerate(logits):
            merged = filter_logits(cfg_merge(l, SETTINGS["cfg_scale"]), SETTINGS["temperature"], SETTINGS["top_k"],
                                   SETTINGS["top_p"])
            logp += torch.log_softmax(merged.double(), -1).gather(1, seqs[:, j : j + 1])[:, 0]
        out.append(logp.exp())
    return torch.stack(out)


def speculative_counts(model, cond, mask, condition, monkeypatch, init="random", window=WINDOW, coupling="none",
                       tree=()):
    """(captions, V**N): how often the speculative sampler drew each sequence over SAMPLES images (alternating
    captions, one batch whose rows accept different counts)."""
    idx = torch.arange(SAMPLES) % cond.shape[0]
    repeat_prepare(monkeypatch, engine_module, cond, mask, condition, idx)
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init=init,
                    draft_coupling=coupling, draft_tree=tree)
    torch.manual_seed(0)
    out = engine.generate(cond[idx], N, emb_masks=mask[idx], condition=condition[idx], **SETTINGS)
    if tree:  # the tree's branches (its side branches: beyond the tree without them) must be taken for the test
        assert engine.last_speculation["tokens_per_pass"] > TREE_GAIN * chain_tokens_per_pass(window, init, tree[:2]
                                                                                             if tree[2:] else ()), tree
    code = (out * V ** torch.arange(N - 1, -1, -1)).sum(1)
    return torch.stack([torch.bincount(code[idx == c], minlength=V**N) for c in range(cond.shape[0])]).double()


def goodness_of_fit(counts, probs):
    """Per caption: (sequences drawn that the reference never draws, Pearson's chi-square over the sequences
    expected >= 5 times and one bin of the rest, its bound at p = 1e-4 (Wilson-Hilferty): the real sampler runs in
    five configurations of two captions each; the planted mistakes' statistics are about twice it or more)."""
    out = []
    for obs, p in zip(counts, probs):
        expected = p * obs.sum()
        big = expected >= 5
        chi2 = (((obs[big] - expected[big]) ** 2) / expected[big]).sum().item()
        chi2 += (obs[~big].sum() - expected[~big].sum()).item() ** 2 / max(expected[~big].sum().item(), 1e-9)
        dof = int(big.sum())
        bound = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
        out.append((int(obs[p == 0].sum()), chi2, bound))
    return out


TREE_GAIN = 1.05  # a tree of the distribution test accepts more per pass than its chain (measured: 1.61 -> 1.74),
# side branches than the tree without them (2x1 -> 2x1+1x1: 1.61 -> 1.72)


@functools.lru_cache(maxsize=None)
def chain_tokens_per_pass(window, init, tree=()):
    """Tokens per pass of the pathwise chain (or tree) in the distribution test's setting (a tree must beat it)."""
    model, cond, mask, condition = distribution_case()
    idx = torch.arange(SAMPLES) % cond.shape[0]
    with pytest.MonkeyPatch.context() as monkeypatch:
        repeat_prepare(monkeypatch, engine_module, cond, mask, condition, idx)
        engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init=init,
                        draft_coupling="pathwise", draft_tree=tree)
        torch.manual_seed(0)
        engine.generate(cond[idx], N, emb_masks=mask[idx], condition=condition[idx], **SETTINGS)
    return engine.last_speculation["tokens_per_pass"]


def plant(monkeypatch, mistake):
    """A mistake the exact test must catch."""
    if mistake == "always_accept":  # every draft accepted, whatever p and q say
        monkeypatch.setattr(speculative, "accepted_count", lambda p, q, drafts, u: torch.full_like(drafts[:, 0],
                                                                                                  drafts.shape[1]))
    elif mistake == "residual_is_p":  # the token at the first rejection drawn from p, not norm(max(0, p - q))
        monkeypatch.setattr(speculative, "residual", lambda p, q: p)
    elif mistake == "stale_q":  # redrawn drafts verified against the distribution of the draft they replace
        real, before = speculative.next_window, {}
        advance = speculative.JacobiRunner.advance

        def remember(self, p):
            before["q"] = self.q.clone()  # the q of the drafts this pass verified (drawn in earlier passes)
            return advance(self, p)

        def stale(dist, count, redraw):
            inside, drafts, _ = real(dist, count, redraw)
            return inside, drafts, real(before["q"], count, redraw)[2]

        monkeypatch.setattr(speculative.JacobiRunner, "advance", remember)
        monkeypatch.setattr(speculative, "next_window", stale)
    elif mistake == "past_mismatch":  # pathwise: the targets after a differing draft kept too (a wrong context's)
        monkeypatch.setattr(speculative, "matched_count",
                            lambda drafts, target: (drafts[:, :-1] == target[:, :-1]).sum(-1) + 1)
    elif mistake == "fresh_at_mismatch":  # pathwise: the token where a draft differs drawn with fresh noise
        settle = speculative.JacobiRunner.settle

        def fresh(self, dist, tokens, count, redraw):
            last = torch.arange(tokens.shape[1]) == (count - 1)[:, None]
            return settle(self, dist, torch.where(last, speculative.race(dist), tokens), count, redraw)

        monkeypatch.setattr(speculative.JacobiRunner, "settle", fresh)
    elif mistake == "sibling_distribution":  # a tree's branch verified against its sibling's (the chain's) distribution
        advance = draft_tree.TreeRunner.advance_tree

        def sibling(self, p, tokens, start, target=None):
            node = torch.arange(len(self.depth))
            chain = torch.where(node < self.window, node, self.depth)  # a branch's node -> the chain's at its depth
            return advance(self, p[:, chain], tokens, start, None if target is None else target[:, chain])

        monkeypatch.setattr(draft_tree.TreeRunner, "advance_tree", sibling)
    elif mistake == "uncompacted":  # a tree's kept branch left in its slots: the next pass reads the chain's keys
        monkeypatch.setattr(draft_tree, "compact", lambda caches, start, line, count: None)
    elif mistake == "side_sees_root":  # a side branch's mask without its chain ancestors: it sees the root only
        real = draft_tree.ancestry

        def root_only(tree):
            window = next(k for k, d in enumerate(tree.depth) if d != k)  # the chain first: node k at depth k
            chain = sum(1 << k for k in range(1, window))
            return [m & ~chain if side else m for m, side in zip(real(tree), side_nodes(tree))]

        monkeypatch.setattr(draft_tree, "ancestry", root_only)
    elif mistake == "side_sibling":  # a side branch verified against its sibling's (the chain's) distribution
        advance = draft_tree.TreeRunner.advance_tree

        def sibling(self, p, tokens, start, target=None):
            node = torch.arange(len(self.depth))
            chain = torch.where(torch.tensor(side_nodes(self.tree)), self.depth, node)  # a side node -> the chain's
            return advance(self, p[:, chain], tokens, start, None if target is None else target[:, chain])

        monkeypatch.setattr(draft_tree.TreeRunner, "advance_tree", sibling)


def side_nodes(tree):
    """Which of a tree's nodes are in its side branches: a runner-up past the first draft, or below one."""
    side = []
    for node, up in enumerate(tree.parent):
        side.append(tree.rank[node] > 0 and tree.depth[node] >= 2 or up >= 0 and side[up])
    return side


@pytest.fixture(scope="module")
def reference():
    model, cond, mask, condition = distribution_case()
    return (model, cond, mask, condition), reference_probabilities(model, cond, mask, condition)


@pytest.mark.parametrize("init,window,coupling,tree", [
    ("random", WINDOW, "none", ()), ("left", WINDOW, "none", ()), ("above", 2, "none", ()),  # above: a 2 x 2 grid
    ("random", WINDOW, "gumbel", ()), ("left", WINDOW, "gumbel", ()), ("random", WINDOW, "pathwise", ()),
    ("left", WINDOW, "pathwise", (3, 2)), ("random", WINDOW, "pathwise", (2, 1)),
    ("left", WINDOW, "pathwise", (2, 1, 1, 1))])  # a side branch at depth 2
def test_sequence_distribution_is_the_reference_one(reference, monkeypatch, init, window, coupling, tree):
    case, probs = reference
    assert (probs > 0).sum(1).min() >= 40, "the test needs a spread distribution"
    counts = speculative_counts(*case, monkeypatch, init, window, coupling, tree)
    for outside, chi2, bound in goodness_of_fit(counts, probs):
        assert outside == 0 and chi2 < bound, (outside, chi2, bound)


@pytest.mark.parametrize("mistake,coupling,tree", [
    ("always_accept", "none", ()), ("residual_is_p", "none", ()), ("stale_q", "none", ()),
    ("past_mismatch", "pathwise", ()), ("fresh_at_mismatch", "pathwise", ()),
    ("sibling_distribution", "pathwise", (3, 2)), ("side_sibling", "pathwise", (2, 1, 1, 1))])
def test_planted_mistakes_change_the_distribution(reference, monkeypatch, mistake, coupling, tree):
    case, probs = reference
    init = "left" if tree else "random"
    plant(monkeypatch, mistake)
    fits = goodness_of_fit(speculative_counts(*case, monkeypatch, init, coupling=coupling, tree=tree), probs)
    assert any(outside > 0 or chi2 > bound for outside, chi2, bound in fits), fits


# ---- pathwise passes: the image is a function of the noise -----------------------------------------------------------

PATH_N, PATH_B = 16, 64  # a 4 x 4 grid of the tiny vocabulary, 64 images (two captions)


def pathwise_case():
    """distribution_case's model over 16 tokens (windows up to 8, a 4 x 4 grid for 'above') and its inputs."""
    model = tiny_model(cls=8, seed=5, block_size=PATH_N, vocab_size=V)
    with torch.no_grad():
        model.output.weight.mul_(0.05)
        model.tok_embeddings.weight.mul_(4)
    cond, mask, condition = tiny_inputs(model, B=2, valid=(3, 6))
    return model, cond, mask, condition[..., :32, :32]


def pathwise_tokens(monkeypatch, case, window, init, tree=()):
    """(images, tokens) of a pathwise engine from seed 0, its noise seed and tokens per pass."""
    model, cond, mask, condition = case
    idx = torch.arange(PATH_B) % cond.shape[0]
    repeat_prepare(monkeypatch, engine_module, cond, mask, condition, idx)
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window, draft_init=init,
                    draft_coupling="pathwise", draft_tree=tree)
    torch.manual_seed(0)
    out = engine.generate(cond[idx], PATH_N, emb_masks=mask[idx], condition=condition[idx], **SETTINGS)
    return out, engine.runner.noise_seed.clone(), engine.last_speculation["tokens_per_pass"]


def noise_function(case, out, seed):
    """Whether each token after the first is its position's race with the fixed noise (speculative.position_noise)
    of the reference's distribution given the tokens before it (teacher forcing): the sequential pathwise sampler."""
    model, cond, mask, condition = case
    idx = torch.arange(out.shape[0]) % cond.shape[0]
    with pytest.MonkeyPatch.context() as monkeypatch:
        repeat_prepare(monkeypatch, generate_module, cond, mask, condition, idx)
        _, logits = generate(model, cond[idx], PATH_N, emb_masks=mask[idx], condition=condition[idx], forced=out,
                             return_logits=True, cfg_scale=SETTINGS["cfg_scale"],
                             control_strength=SETTINGS["control_strength"])
    same = []
    for j in range(1, PATH_N):
        p = speculative.probabilities(logits[j][:, None], True, SETTINGS["cfg_scale"], SETTINGS["temperature"],
                                      SETTINGS["top_k"], SETTINGS["top_p"])
        noise = speculative.position_noise(seed, torch.full((out.shape[0], 1), j), V)
        same.append(speculative.coupled_race(p, noise)[:, 0] == out[:, j])
    return torch.stack(same, 1)


@pytest.fixture(scope="module")
def pathwise_chain():
    """The reference's pathwise image: the chain of 2 positions from seed 0, checked token by token."""
    case = pathwise_case()
    with pytest.MonkeyPatch.context() as monkeypatch:
        out, seed, _ = pathwise_tokens(monkeypatch, case, 2, "random")
    assert noise_function(case, out, seed).all()
    return case, out, seed


@pytest.mark.parametrize("window,init,tree", [(3, "left", ()), (4, "above", ()), (8, "random", ()),
                                              (4, "left", (2, 1)), (4, "above", (4, 3)), (6, "random", (3, 2)),
                                              (4, "left", (2, 1, 2, 1)), (8, "left", (4, 3, 3, 3))])
def test_pathwise_tokens_are_the_noise_s_function(pathwise_chain, monkeypatch, window, init, tree):
    """Pathwise passes give every image the tokens of the sequential sampler with the fixed noise, whatever the
    window, the initial drafts and the tree: the same tokens as the chain of 2 (each of which is checked against the
    reference), and more tokens per pass for the tree than its chain (side branches: than the tree without them)."""
    case, chain, seed = pathwise_chain
    out, seed_, per_pass = pathwise_tokens(monkeypatch, case, window, init, tree)
    assert torch.equal(seed_, seed) and torch.equal(out, chain)
    if tree:
        with pytest.MonkeyPatch.context() as chain_patch:
            assert per_pass > pathwise_tokens(chain_patch, case, window, init, tree[:2] if tree[2:] else ())[2]


@pytest.mark.parametrize("mistake,tree", [("past_mismatch", ()), ("fresh_at_mismatch", ()),
                                          ("sibling_distribution", (3, 2)), ("uncompacted", (3, 2)),
                                          ("side_sees_root", (2, 1, 2, 1)), ("side_sibling", (2, 1, 2, 1))])
def test_planted_mistakes_change_pathwise_tokens(pathwise_chain, monkeypatch, mistake, tree):
    case, chain, seed = pathwise_chain
    plant(monkeypatch, mistake)
    out, _, _ = pathwise_tokens(monkeypatch, case, 4, "left", tree)
    assert not torch.equal(out, chain) and not noise_function(case, out, seed).all()


def test_window_mask_of_a_chain_is_the_causal_mask():
    """Context.window with a chain's ancestry (each row its own bit and those before) is attention_mask at the rows'
    positions, for rows whose windows start at different slots and a text mask in the prefix."""
    from fast_inference.model import attention_mask, window_mask
    key_valid = torch.ones(3, 24, dtype=torch.bool)
    key_valid[:, 1:3] = False
    start, S = torch.tensor([5, 9, 16]), 6
    chain = draft_tree.ancestry(draft_tree.make_tree(S, 1, 1))
    assert chain == [(1 << (j + 1)) - 1 for j in range(S)]
    pos = start[:, None] + torch.arange(S)
    assert torch.equal(window_mask(key_valid, start, torch.tensor(chain).expand(3, S)), attention_mask(key_valid, pos))


def test_candidates_are_the_draft_then_the_race():
    """A position's candidates: its draft first, then the race of q with the position's noise; all distinct."""
    q = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.0, 0.0]]])
    log_noise = torch.zeros(1, 1, 6)  # the noise 1 at every token
    assert draft_tree.candidates(q, torch.tensor([[5]]), log_noise, 4).tolist() == [[[5, 3, 2, 1]]]
    assert draft_tree.candidates(q, torch.tensor([[2]]), log_noise, 3).tolist() == [[[2, 3, 1]]]
    log_noise[..., 3] = math.log(100.0)  # token 3 loses the race: log 0.4 - log 100 is below log 0.1 - log 1
    assert draft_tree.candidates(q, torch.tensor([[2]]), log_noise, 3).tolist() == [[[2, 1, 0]]]


def test_tree_walk_takes_the_branch_holding_each_target():
    """make_tree's nodes, their ancestry, and walk's path on a hand-made pass: a 3 x 2 tree over a window of 4."""
    tree = draft_tree.make_tree(4, 3, 2)
    assert tree.parent == (-1, 0, 1, 2, 0, 4, 0, 6) and tree.depth == (0, 1, 2, 3, 1, 2, 1, 2)
    assert tree.rank == (0, 0, 0, 0, 1, 0, 2, 0) and draft_tree.tree_size(4, 3, 2) == tree.size
    assert draft_tree.ancestry(tree)[5] == 0b110001
    tokens = torch.tensor([[9, 1, 2, 3, 5, 2, 6, 2],   # root target 5: branch 4, its target 2: node 5, then the chain
                           [9, 1, 2, 3, 5, 2, 6, 2],   # root target 1: the chain to its end
                           [9, 1, 2, 3, 5, 2, 6, 2]])  # root target 7: no child holds it
    target = torch.tensor([[5, 0, 0, 0, 2, 3, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0], [7, 0, 0, 0, 0, 0, 0, 0]])
    line, count = tree_walk(tree, 4, tokens, target)
    assert line.tolist() == [[0, 4, 5, 3], [0, 1, 2, 3], [0, 1, 2, 3]] and count.tolist() == [3, 4, 1]


def test_side_branches_hang_below_the_chain():
    """A 2 x 1 tree with 2 side branches of depth 2 over a window of 5 (make_tree), its ancestry, parse_tree's form,
    and walk into a side branch: the runner-up of the chain's draft at depth 2 or 3, below the chain's node before
    it."""
    tree = draft_tree.make_tree(5, 2, 1, 2, 2)
    assert tree.parent == (-1, 0, 1, 2, 3, 0, 1, 6, 2, 8) and tree.depth == (0, 1, 2, 3, 4, 1, 2, 3, 3, 4)
    assert tree.rank == (0, 0, 0, 0, 0, 1, 1, 0, 1, 0) and draft_tree.tree_size(5, 2, 1, 2, 2) == tree.size
    assert draft_tree.ancestry(tree)[9] == 0b1100000111
    assert draft_tree.parse_tree("2x1+2x2") == (2, 1, 2, 2) and draft_tree.format_tree((2, 1, 2, 2)) == "2x1+2x2"
    for bad in ("2x1+2", "2x1+", "2x1+1x1+1x1"):
        with pytest.raises(ValueError, match=r"WxD\+SxE"):
            draft_tree.parse_tree(bad)
    tokens = torch.tensor([[9, 1, 2, 3, 4, 5, 6, 3, 7, 4],   # 1 kept, its target 6: side node 6, then node 7's 3
                           [9, 1, 2, 3, 4, 5, 6, 3, 7, 4]])  # 1 and 2 kept, 2's target 7: side node 8, its target 8
    target = torch.tensor([[1, 6, 0, 0, 0, 0, 3, 5, 0, 0], [1, 2, 7, 0, 0, 0, 0, 0, 8, 0]])
    line, count = tree_walk(tree, 5, tokens, target)
    assert line.tolist() == [[0, 1, 6, 7, 4], [0, 1, 2, 8, 9]] and count.tolist() == [4, 4]


def tree_walk(tree, window, tokens, target):
    """draft_tree.walk over make_tree's tree (as TreeRunner calls it)."""
    up, outside, lines = draft_tree.links(tree, window)
    return draft_tree.walk(up, outside, torch.tensor(tree.depth), lines, tokens, target)


def looped_walk(tree, tokens, target, window):
    """walk as a loop over the window's depths (before issue 78), the reference for walk's few ops: from the root,
    into the child holding its parent's target while one does; past the walk's end, the last node's rank-0 child
    where it has one, else the main chain's node at that depth."""
    child = torch.zeros(tree.size, tree.size, dtype=torch.bool)
    first = torch.full((tree.size,), -1)
    for node, up in enumerate(tree.parent):
        if up >= 0:
            child[up, node] = True
            if tree.rank[node] == 0:
                first[up] = node
    rows = torch.arange(tokens.shape[0])
    at, alive = torch.zeros_like(rows), torch.ones_like(rows, dtype=torch.bool)
    line, count = [at], torch.ones_like(rows)
    for d in range(1, window):
        match = child[at] & (tokens == target[rows, at][:, None])
        alive = alive & match.any(-1)
        at = torch.where(alive, match.to(torch.long).argmax(-1), torch.where(first[at] >= 0, first[at], d))
        line.append(at)
        count = count + alive.to(torch.long)
    return torch.stack(line, 1), count


def tree_shapes():
    """Every make_tree shape over windows 2 to 6 (side branches as the plan allows: S + E below the window), and the
    issue's 4x3+2x3 and 4x3+7x3 over 48 and 32."""
    for window in range(2, 7):
        for width, depth in itertools.product(range(1, 5), range(1, window)):
            yield window, (width, depth)
            for side, side_depth in itertools.product(range(1, window), range(1, window)):
                if side + side_depth < window:
                    yield window, (width, depth, side, side_depth)
    yield 48, (4, 3, 2, 3)
    yield 32, (4, 3, 7, 3)


def random_pass(tree, window, images, g):
    """Tokens (images, S) as a pass's (each node its position's candidate of its rank: distinct per position, from a
    vocabulary of width + 1) and targets (images, S) that are one of the node's children's tokens 3 times in 4 (a
    random token else): walks of every length."""
    width = max(tree.rank) + 1
    cands = torch.rand(images, window, width + 1, generator=g).argsort(-1)[..., :width]
    depth, rank = torch.tensor(tree.depth), torch.tensor(tree.rank)
    tokens = cands[:, depth, rank]
    target = torch.randint(0, width + 1, (images, tree.size), generator=g)
    for node in range(tree.size):
        kids = [k for k, up in enumerate(tree.parent) if up == node]
        if kids:
            pick = torch.tensor(kids)[torch.randint(0, len(kids), (images,), generator=g)]
            take = torch.rand(images, generator=g) < 0.75
            target[:, node] = torch.where(take, tokens.gather(1, pick[:, None])[:, 0], target[:, node])
    return tokens, target


def plant_walk(links, tree, window, mistake):
    """A mistake in walk's tables that the comparison with the loop must catch."""
    up, outside, lines = links
    depth = torch.tensor(tree.depth)
    if mistake == "ancestors_ignored":  # a node kept where its own token matches, whatever its ancestors'
        outside = ~torch.eye(tree.size, dtype=torch.bool)
    elif mistake == "chain_below_ignored":  # past the walk's end the main chain's nodes, not the last node's branch
        lines = torch.where(torch.arange(window) > depth[:, None], torch.arange(window), lines)
    elif mistake == "depth_off_by_one":  # one target fewer kept per walk
        depth = (depth - 1).clamp(min=0)
    return up, outside, depth, lines


def test_siblings_hold_distinct_tokens():
    """walk's assumption: a node's children sit at one depth with distinct ranks (make_tree), and a position's
    candidates are distinct tokens (candidates(), even where q is 0 at most tokens and the noise ties)."""
    for window, shape in tree_shapes():
        tree = draft_tree.make_tree(window, *shape)
        for node in range(tree.size):
            kids = [k for k, up in enumerate(tree.parent) if up == node]
            assert len({tree.depth[k] for k in kids}) <= 1 and len({tree.rank[k] for k in kids}) == len(kids)
    g = torch.Generator().manual_seed(0)
    q = torch.rand(3, 5, 16, generator=g) * (torch.rand(3, 5, 16, generator=g) < 0.2)
    cands = draft_tree.candidates(q, torch.randint(0, 16, (3, 5), generator=g), torch.zeros(3, 5, 16), 6)
    assert all(len(set(c)) == 6 for c in cands.flatten(0, 1).tolist())


@pytest.mark.parametrize("mistake", [None, "ancestors_ignored", "chain_below_ignored", "depth_off_by_one"])
def test_walk_is_the_loop_over_depths(mistake):
    """walk's few ops give the loop's line and count (looped_walk) for every make_tree shape, on random passes with
    walks of every length; each planted mistake in its tables gives another for some tree."""
    g = torch.Generator().manual_seed(78)
    same, lengths = [], set()
    for window, shape in tree_shapes():
        tree = draft_tree.make_tree(window, *shape)
        tokens, target = random_pass(tree, window, 64, g)
        want = looped_walk(tree, tokens, target, window)
        line, count = draft_tree.walk(*plant_walk(draft_tree.links(tree, window), tree, window, mistake), tokens,
                                      target)
        same.append(torch.equal(line, want[0]) and torch.equal(count, want[1]))
        lengths.update(want[1].tolist())
    assert lengths >= set(range(1, 7)), lengths  # walks ending at every depth of the small windows, and deeper
    assert all(same) if mistake is None else not all(same)


def test_compact_moves_the_kept_path_to_its_positions():
    """draft_tree.compact: slot start + d of every layer's keys and values takes slot start + line[d] for d < count,
    each image's CFG half as the image; the slots past count keep theirs."""
    model = tiny_model(n_layer=2)
    model.setup_caches(4, 24, torch.float32)
    caches = [layer.attention.kv_cache for layer in model.layers]
    for i, c in enumerate(caches):
        c.k_cache.normal_(generator=torch.Generator().manual_seed(2 * i))
        c.v_cache.normal_(generator=torch.Generator().manual_seed(2 * i + 1))
    before = [(c.k_cache.clone(), c.v_cache.clone()) for c in caches]
    start, line, count = torch.tensor([3, 7, 3, 7]), torch.tensor([[0, 4, 5, 2], [0, 1, 6, 3]]), torch.tensor([3, 2])
    draft_tree.compact(caches, start, line, count)
    for c, old in zip(caches, before):
        for t, o in zip((c.k_cache, c.v_cache), old):
            for row in range(4):
                image, s = row % 2, int(start[row])
                for d in range(4):
                    src = int(line[image, d]) if d < count[image] else d
                    assert torch.equal(t[row, :, s + d], o[row, :, s + src]), (row, d)


# ---- refusals ------------------------------------------------------------------------------------------------------

def test_what_the_pass_cannot_run_is_refused():
    model, cond, n, kw = greedy_case()
    with pytest.raises(PlanError, match="compile scope block"):
        Engine(model, backend="inductor", compile_scope="step", speculative="jacobi")
    with pytest.raises(PlanError, match="at least 2 positions"):
        Engine(model, backend="eager", speculative="jacobi", draft_window=1)
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=5, draft_init="above")
    with pytest.raises(ValueError, match="at least as wide as the draft window"):  # a 4 x 4 grid
        engine.generate(cond, n, **kw)
    with pytest.raises(ValueError, match="cfg_interval -1"):
        Engine(model, backend="eager", speculative="jacobi").generate(cond, n, **dict(kw, cfg_interval=3))
    with pytest.raises(ValueError, match="pathwise' only"):
        Engine(model, backend="eager", speculative="jacobi", draft_tree=(4, 3), draft_coupling="gumbel")
    tree = dict(backend="eager", speculative="jacobi", draft_coupling="pathwise")
    with pytest.raises(PlanError, match="a depth of 1 to --draft-window - 1"):
        Engine(model, draft_window=4, draft_tree=(2, 4), **tree)
    with pytest.raises(PlanError, match="65 rows per image, the window's mask holds 63"):
        Engine(model, draft_window=32, draft_tree=(12, 3), **tree)
    with pytest.raises(PlanError, match="side branches SxE need S and E of at least 1 and S \\+ E below"):
        Engine(model, draft_window=4, draft_tree=(2, 1, 2, 2), **tree)


def test_the_draft_flags_left_out_run_the_chain_on_the_cpu():
    """Engine(draft_window=None, draft_coupling=None, draft_tree=None): the plan's choice, on the CPU the chain of 16
    with gumbel coupling (plan.CHAIN; the measured tree needs CUDA), the reference's greedy tokens; a tree given alone
    takes pathwise coupling."""
    model, cond, n, kw = greedy_case()
    engine = Engine(model, backend="eager", speculative="jacobi")
    assert engine.drafts == plan.Drafts(16, "gumbel", (), auto=True)
    assert torch.equal(engine.generate(cond, n, **kw), generate(model, cond, n, **kw))
    s = engine.plan.situation
    assert (s.draft_window, s.draft_coupling, s.draft_tree) == (16, "gumbel", ()) and engine.plan.jacobi.window == 16
    assert engine.plan.drafts_chosen.startswith("the chain of 16, gumbel coupling: the measured tree 4x3+2x3")
    assert Engine(model, backend="eager", speculative="jacobi", draft_tree=(4, 3)).drafts == plan.Drafts(
        16, "pathwise", (4, 3))


def test_pinned_drafts_hold_for_every_batch_of_a_run(monkeypatch):
    """Engine.pin_drafts(batch) fixes the drafts the plan picks at the run's batch (fast_eval.py: --batch), so that a
    smaller batch (a run's last) runs them too; unpinned, that batch gets its own choice. The plan's choice stands in
    for a GPU's (a tree below 8 images, the chain from 8), which the CPU never makes."""
    import dataclasses

    def gpu_choice(s, want):
        if s.batch < 8:
            return dataclasses.replace(s, draft_window=4, draft_coupling="pathwise", draft_tree=(2, 1)), "the tree"
        return s, "the chain"

    monkeypatch.setattr(plan, "choose_drafts", gpu_choice)
    model, cond, n, kw = greedy_case()
    kw = dict(kw, emb_masks=kw["emb_masks"][:2], condition=kw["condition"][:2])
    ran = {}
    for pinned in (None, 8, 2):
        engine = Engine(model, backend="eager", speculative="jacobi")
        if pinned:
            engine.pin_drafts(pinned)
        assert engine.drafts.auto == (pinned is None)
        engine.generate(cond[:2], n, **kw)  # a batch of 2 images
        s = engine.plan.situation
        ran[pinned] = (s.draft_window, s.draft_coupling, s.draft_tree)
    assert ran[None] == ran[2] == (4, "pathwise", (2, 1))
    assert ran[8] == (16, "gumbel", ())


# ---- on a GPU: the captured pass -----------------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend,tree", [("inductor", ()), ("eager", ()), ("inductor", (4, 3)),
                                          ("inductor", (2, 1, 2, 1))])
def test_captured_pass_greedy_on_cuda(backend, tree):
    """GPT-XL's width (2 blocks, float32 so that no near tie turns): the pass captured as one CUDA graph (inductor)
    or run op by op (eager) gives the reference's greedy tokens, for 3 images whose rows accept different counts; a
    draft tree's pass (pathwise) too, with side branches."""
    model = tiny_model(dim=1280, n_head=20, n_layer=2, seed=4).cuda()
    cond, mask, condition = (t.cuda() for t in tiny_inputs(model, B=3, valid=(3, 8, 5)))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, control_strength=0.8, top_k=1)
    n = model.args.block_size
    ref = generate(model, cond, n, **kw)
    engine = Engine(model, backend=backend, speculative="jacobi", draft_window=4, draft_tree=tree,
                    draft_coupling="pathwise" if tree else speculative.DEFAULT_COUPLING,
                    overrides=("jacobi=on",))  # the pass, where the plan would run plain steps (PASS_GAINS)
    for _ in range(2):  # the first captures, the second replays
        assert torch.equal(engine.generate(cond, n, **kw), ref)
    assert (("pass",) in engine.graphs) == (backend == "inductor")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_pass_same_seed_same_tokens_on_cuda():
    model = tiny_model(dim=1280, n_head=20, n_layer=2, seed=4).cuda().to(torch.bfloat16)
    cond, mask, condition = (t.cuda() for t in tiny_inputs(model, B=2))
    engine = Engine(model, backend="inductor", speculative="jacobi", draft_window=8, overrides=("jacobi=on",))
    runs = []
    for _ in range(3):
        torch.manual_seed(7)
        runs.append(engine.generate(cond, model.args.block_size, emb_masks=mask, condition=condition, cfg_scale=4.0,
                                    top_k=100))
    assert torch.equal(runs[1], runs[2]) and torch.equal(runs[0], runs[1])
