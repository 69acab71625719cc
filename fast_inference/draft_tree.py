"""Draft trees: several candidate continuations of a pathwise Jacobi window verified in one pass (speculative.py).

A window's chain fails most at its first draft: that draft was redrawn from a distribution computed with the token
the last pass rejected before it. A W x D tree gives that position W candidates (the chain's draft and the W - 1
runners-up of the same race: the largest log q - log E after it), each followed by D - 1 more drafts of the chain
(the main one by all L - 1), all in one pass: each node its own query row and cache slot, RoPE'd at its depth's
position, seeing its ancestors only (Context.window: one 64-bit word of ancestry per row). A branch the walk enters
gives up to D tokens more than the chain's pass (its last node's target included).

Side branches (WxD+SxE): the chain fails at its later drafts too (about half its passes end past the first draft,
docs/PERF_NOTES.md), most often where the token is the race's runner-up; each of the S chain drafts after the first
gets that runner-up as a sibling, below the chain's node before it, with E - 1 chain drafts under it.

Exact for pathwise passes only, and pathwise-exact there: a node's target (its race with the position's fixed noise)
is the sequential sampler's token wherever the node's ancestors are the image's tokens, so walking from the root into
the child that holds each target, and keeping the targets along the walk, keeps the image the function of the noise
that the chain gives; a tree changes only how many passes an image takes. (Trees under the ratio test stay out: docs/PERF_NOTES.md.)
After the pass the kept path's keys and values move to their positions' slots (compact), so the next pass reads the
cache as after a chain.
"""
from dataclasses import dataclass, replace

import torch

from fast_inference.kernels import tree_triton
from fast_inference.speculative import JacobiRunner, position_noise, probabilities


@dataclass(frozen=True)
class Tree:
    """A draft tree's nodes in pass order: node 0 the last accepted token, 1..L-1 the chain, then the branches."""
    parent: tuple  # the node's parent (-1: the root)
    depth: tuple  # the node's position in the window: its token at image position n - 1 + depth
    rank: tuple  # which candidate of its position its token is (0: the chain's draft)

    @property
    def size(self):
        return len(self.parent)


def tree_size(window, width, depth, side=0, side_depth=0):
    """The nodes of a width x depth tree over a window of L: the chain's L, (width - 1) branches of depth, and `side`
    side branches of side_depth."""
    return window + (width - 1) * depth + side * side_depth


def parse_tree(text):
    """--draft-tree's value: "none" -> (), "WxD" -> (W, D) (a W x D tree, make_tree), "WxD+SxE" -> (W, D, S, E)
    (and S side branches of depth E)."""
    if text == "none":
        return ()
    parts = [part.partition("x") for part in text.split("+")]
    if not (len(parts) <= 2 and all(a.isdigit() and x and b.isdigit() for a, x, b in parts)):
        raise ValueError(f"--draft-tree {text!r}: give WxD (candidates of the first draft x their depth), e.g. 4x3, "
                         f"WxD+SxE (and the runner-up of the next S drafts, each E deep), e.g. 4x3+11x2, or none")
    return tuple(int(n) for a, _, b in parts for n in (a, b))


def format_tree(tree):
    """parse_tree's inverse: (4, 3, 11, 2) -> "4x3+11x2", () -> "none"."""
    return "+".join(f"{a}x{b}" for a, b in zip(tree[::2], tree[1::2])) or "none"


def make_tree(window, width, depth, side=0, side_depth=0):
    """The root, the chain of window - 1 drafts below it, width - 1 more candidates for the first draft's position,
    each with the chain's next depth - 1 drafts below it, and the runner-up of each chain draft at depths 2 to side + 1
    below the chain's node before it, with the chain's next side_depth - 1 drafts below it."""
    parent, dep, rank = [-1] + list(range(window - 1)), list(range(window)), [0] * window
    for w in range(1, width):
        for d in range(1, depth + 1):
            parent.append(0 if d == 1 else len(parent) - 1)
            dep.append(d)
            rank.append(w if d == 1 else 0)
    for j in range(2, side + 2):
        for d in range(j, j + side_depth):
            parent.append(j - 1 if d == j else len(parent) - 1)
            dep.append(d)
            rank.append(1 if d == j else 0)
    assert len(parent) == tree_size(window, width, depth, side, side_depth) and max(dep) < window
    return Tree(tuple(parent), tuple(dep), tuple(rank))


def ancestry(tree):
    """Each node's mask over the tree's nodes as an integer: its own bit and its ancestors' (Context.window)."""
    masks = []
    for node, up in enumerate(tree.parent):
        masks.append((1 << node) | (masks[up] if up >= 0 else 0))
    return masks


def candidates(q, drafts, log_noise, width):
    """(images, L, width) tokens per window position: the draft, then the width - 1 tokens after it in the race of q
    (images, L, V) with the position's noise (log_noise (images, L, V): its log, clamped as coupled_race's): the
    likeliest winners where the position's distribution moves a little (better than the left and above tokens next:
    docs/PERF_NOTES.md). Distinct tokens."""
    score = q.clamp_min(1e-30).log() - log_noise
    return score.scatter(-1, drafts[..., None], float("inf")).topk(width, dim=-1).indices


def line_from(tree, end, window):
    """walk's line where the walk ends at node `end`: its ancestors and itself by depth, then the chain below it (its
    rank-0 child while it has one, then the main chain's node at each depth), whose distributions give the next
    window."""
    first = {up: node for node, up in enumerate(tree.parent) if up >= 0 and tree.rank[node] == 0}
    line = [end]
    while tree.parent[line[-1]] >= 0:
        line.append(tree.parent[line[-1]])
    line.reverse()
    for d in range(len(line), window):
        line.append(first.get(line[-1], d))  # the main chain's node d has node d + 1 below it
    return line


def links(tree, window, device=None):
    """walk's tables for a tree over a window: up (S,): each node's parent (the root's: itself, never read);
    outside (S, S) bool: [node, other] whether `other` is neither `node` nor one of its ancestors (the root counts as
    none: it is never drafted); lines (S, window): line_from each node."""
    up = torch.tensor([max(u, 0) for u in tree.parent])
    masks = ancestry(tree)
    outside = torch.tensor([[other == 0 or not masks[node] >> other & 1 for other in range(tree.size)]
                            for node in range(tree.size)])
    lines = torch.tensor([line_from(tree, end, window) for end in range(tree.size)])
    # depth d's node is the chain's node d or a branch node (past the chain): compact moves no slot it moves into
    assert ((lines == torch.arange(window)) | (lines >= window)).all()
    return up.to(device), outside.to(device), lines.to(device)


def walk(up, outside, depth, lines, tokens, target):
    """The path a pass keeps per image over a tree's links (links()) and node depths (S,): from the root, into the
    child whose token (tokens (images, S)) is its parent's target (images, S), while one is. Siblings hold distinct
    tokens (candidates()), so the nodes whose tokens and ancestors' all match their parents' targets are one path
    from the root, and its deepest node fixes the line. -> line (images, window): the node at each depth (past the
    walk's end, the chain below its last node, whose distributions give the next window), count (images,): the
    targets kept (the walk's nodes). A few ops, no loop over depths (one CUDA graph's kernels: issue 78)."""
    match = tokens == target[:, up]  # each node's token is its parent's target
    kept = (match[:, None, :] | outside).all(-1)  # ... and every ancestor's: the walk's nodes, the root's too
    end = (kept * depth).argmax(-1)  # the deepest (the root where no child matched: every product 0, the first)
    return lines[end], depth[end] + 1


def compact(caches, start, line, count):
    """The kept path's keys and values to their positions: slot start + d takes slot start + line[:, d] for the walk's
    d < count (line (images, L), count (images,)); start (rows,): each cache row's window, the images' CFG halves after
    them."""
    reps = start.shape[0] // line.shape[0]
    depth = torch.arange(line.shape[1], device=line.device)
    src = start[:, None] + torch.where(depth < count[:, None], line, depth).repeat(reps, 1)
    dst = start[:, None] + depth
    rows = torch.arange(start.shape[0], device=start.device)[:, None]
    for cache in caches:  # per layer: caches that are views of one tensor would alias in the compiled block's inputs
        for t in (cache.k_cache, cache.v_cache):
            t[rows, :, dst] = t[rows, :, src]


class TreeRunner(JacobiRunner):
    """JacobiRunner's passes with a draft tree (pathwise coupling only): each image's window as the tree's nodes;
    tree_shape (W, D) or (W, D, S, E): make_tree's."""

    STATE = JacobiRunner.STATE + ("cands", "log_noise")

    def __init__(self, model, plan, num_tokens, prefix_len, num_controls, top_k, keep_logits, init, width,
                 coupling, tree_shape):
        if coupling != "pathwise":
            raise ValueError(f"a draft tree is exact with --draft-coupling pathwise only, not {coupling!r}")
        super().__init__(model, plan, num_tokens, prefix_len, num_controls, top_k, keep_logits, init, width,
                         coupling)
        self.tree = make_tree(self.window, *tree_shape)
        self.width_candidates = max(self.tree.rank) + 1  # side branches take the runner-up even in a 1 x D tree
        device = self.out.device
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)
        buf("depth", torch.tensor(self.tree.depth, device=device))
        buf("rank", torch.tensor(self.tree.rank, device=device))
        buf("ancestry", torch.tensor(ancestry(self.tree), device=device))
        buf("cands", torch.zeros(self.batch, self.window, self.width_candidates, dtype=torch.long, device=device))
        # the window positions' log noise: the candidates' race and the next pass's draw (the same positions)
        buf("log_noise", torch.zeros_like(self.q))
        up, outside, lines = links(self.tree, self.window, device)
        buf("up", up)
        buf("outside", outside)
        buf("lines", lines)
        # compact's and the window noise's kernels (the plan's tree_ops), bound to the caches as the graphs are
        caches = [layer.attention.kv_cache for layer in model.layers]
        self.tree_kernels = plan.jacobi.tree_ops == "triton"
        self.cache_table = tree_triton.cache_table(caches) if self.tree_kernels else None

    def start(self):
        super().start()
        self.renew_candidates()

    def renew_candidates(self):
        """The window's noise (log_noise) and candidates (candidates()) from its drafts and their q."""
        positions = self.n[:, None] + self.steps
        if not self.tree_kernels:
            noise = position_noise(self.noise_seed, positions, self.q.shape[-1])
        else:  # the keys' uniforms in one kernel, position_noise's logs torch's (the same bits)
            noise = tree_triton.position_uniforms(self.noise_seed, positions, self.log_noise).log_().neg_()
        torch.log(noise.clamp_min_(torch.finfo(noise.dtype).tiny), out=self.log_noise)  # as coupled_race clamps it
        self.cands.copy_(candidates(self.q, self.drafts, self.log_noise, self.width_candidates))

    def jacobi_pass(self):
        """One pass over the tree's nodes: each its own row and cache slot, its depth's position and ancestry."""
        N, T, S = self.num_tokens, self.prefix_len, self.tree.size
        B = self.batch
        at = ((self.depth[1:] - 1) * self.cands.shape[-1] + self.rank[1:]).expand(B, -1)  # node -> its candidate
        tokens = torch.cat([self.last[:, None], self.cands.flatten(1).gather(1, at)], 1)
        pos = (T + self.n[:, None] - 1 + self.depth).clamp(max=T + N - 1)
        rows = (lambda t: torch.cat([t, t])) if self.cfg else (lambda t: t)
        start = rows(T + self.n - 1)
        ctx = replace(self.pass_ctx, window=(start, self.ancestry.expand(start.shape[0], S)))
        if self.pass_inputs is None:
            x = self.model.tok_embeddings(rows(tokens))
        else:  # the window inputs kernel: embeddings, RoPE and control rows at the nodes' positions
            x, inputs = self.pass_inputs(self.model, tokens, pos, self.controls, self.cfg)
            ctx = replace(ctx, inputs=inputs)
        h = self.model.blocks(x, rows(pos), self.key_valid, self.controls, ctx=ctx)
        if self.verify is None:
            p, target = probabilities(self.pass_head(h), self.cfg, self.cfg_scale, self.temperature, self.top_k,
                                      self.top_p, self.sample_logits), None
        else:  # the nodes' distributions and draws in one kernel (the plan's verify=triton)
            p, target = self.verify.tree(self.pass_head(h).contiguous(), self.log_noise, self.depth, self.cfg_scale,
                                         self.temperature, self.top_k, self.sample_logits)
        self.advance_tree(p, tokens, start, target)

    def advance_tree(self, p, tokens, start, target=None):
        """The walk over this pass's node distributions p (images, S, V) and their draws (target, or None: drawn here):
        the kept path's targets written and its cache slots compacted; the next window from the path's line (walk),
        and its candidates."""
        if target is None:  # draw(): coupled_race at the nodes' positions
            target = p.log().sub_(self.log_noise[:, self.depth]).argmax(-1)
        line, count = walk(self.up, self.outside, self.depth, self.lines, tokens, target)
        count = count * (self.n < self.num_tokens)
        caches = [layer.attention.kv_cache for layer in self.model.layers]
        if not self.tree_kernels:
            compact(caches, start, line, count)
        else:  # every layer's keys and values in one launch
            tree_triton.compact(caches, start, line, count, self.cache_table)
        dist = p.gather(1, line[..., None].expand(-1, -1, p.shape[-1]))
        on_line = target.gather(1, line)
        self.settle(dist, on_line, count, on_line)
        self.renew_candidates()
