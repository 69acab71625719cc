"""Speculative Jacobi decoding (SJD, Teng et al., ICLR 2025), lossless: several image tokens per pass, the sequential
sampler's distribution.

A pass feeds each image its last accepted token and L - 1 drafts of the next positions at once (its rows at their
own positions), and reads the L next-token distributions p (after CFG, temperature, top-k, top-p, as sampling.py).
Draft j, drawn from q_j, is accepted with probability min(1, p_j(x) / q_j(x)) while every draft before it was; at the
first rejection one token is drawn from norm(max(0, p_j - q_j)) and accepted, and the image's pass ends there. That
is speculative sampling's rule: each accepted token has the sequential sampler's distribution given the tokens before
it, whatever q_j was, as long as the draft was drawn from q_j with randomness of its own. The window's later
positions get new drafts drawn from this pass's p (their q), positions past it initial drafts (DRAFT_INITS, each
with its exact q). Every image advances by its own count; an image with all its tokens idles until its batch is done.

Coupled drafts (COUPLINGS "gumbel", as MC-SJD): the redraws and uniform drafts take their race noise from a hash of
(the call's seed, image, position, token) instead of fresh draws, so a position's draft moves only where its
distribution does. Still lossless: a position's noise decides an accepted token only in the verification that fixes
that position, and nothing before then depends on it (the distributions there are computed from earlier positions),
so each draft is still a fresh draw from its q; the residual draws and the accept tests keep fresh randomness.

Pathwise passes (COUPLINGS "pathwise"): every token, not only the drafts, is the race of its distribution with the
noise fixed per (image, position, token): the image is the sequential sampler's x_i = argmax(log p_i(. | x_<i) -
log E_i), one Exp(1) draw per position and token, a function of the noise alone. A pass computes each position's race
from the drafts before it (target) and keeps the targets up to the first whose draft differs: each kept target was
computed from the image's own tokens, so the image is that function of the noise whatever the drafts were (drafts,
windows and trees change only how many passes it takes), and the noise is independent of everything else. No accept
test, no residual: a draft is kept where it is the race's winner, and the one after the last kept draft is exact too.
"""
from dataclasses import replace

import torch
import torch.nn.functional as F

from fast_inference.kernels.attention_triton import chain_masks
from fast_inference.kernels.prefetch_triton import run_beside
from fast_inference.runner import ShapeRunner
from fast_inference.sampling import cfg_merge, filter_logits

# Initial drafts of the positions past a pass's window: a uniform draw (q uniform, as SJD); the token to the left
# (q: one-hot); the token above, one grid row up, already accepted (q: one-hot; a window no wider than the grid)
DRAFT_INITS = ("random", "left", "above")
# The redraws' noise: fresh per pass, or fixed per (image, position, token); pathwise: every token's noise fixed
COUPLINGS = ("none", "gumbel", "pathwise")
# The defaults accept most: on the trained demo model and on GPT-XL at 3 nats (docs/PERF_NOTES.md, issue 70).
DEFAULT_INIT, DEFAULT_COUPLING = "left", "gumbel"
DEFAULT_WINDOW = 16  # positions per pass: the chain's (plan.CHAIN)


def probabilities(logits, guided, cfg_scale, temperature, top_k, top_p, sample_logits=True):
    """(rows, L, V) float32 logits of a pass -> the draw's distributions (images, L, V): CFG merge, temperature, top-k,
    top-p (sampling.filter_logits), softmax; greedy (sample_logits False): one-hot at the best."""
    if guided:
        logits = cfg_merge(logits, cfg_scale)
    logits = filter_logits(logits, temperature, top_k, top_p)
    if not sample_logits:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    return F.softmax(logits, dim=-1)


def race(probs):
    """One index per row of probs (..., V), with probability probs (not normalised: proportional): the exponential
    race, argmax(log probs - log E), E ~ Exp(1); zeros are never drawn."""
    noise = torch.empty_like(probs).exponential_(1).clamp_min_(torch.finfo(probs.dtype).tiny).log_()
    return probs.log().sub_(noise).argmax(-1)  # in place: one (images, L, V) tensor fewer


def hash32(x):
    """A 32-bit integer hash (Wellons' lowbias32) of int64 tensors holding values in [0, 2**32), in int64 arithmetic:
    each multiply split in 16-bit halves so that nothing overflows; in place on its own copy (over (images, L, V) keys
    one temporary at a time)."""
    def times(x, c):  # x * c mod 2**32
        high = x * (c >> 16)
        high &= 0xFFFF
        high <<= 16
        x *= c & 0xFFFF
        x += high
        x &= 0xFFFFFFFF
        return x

    x = x ^ (x >> 16)
    x = times(x, 0x7FEB352D)
    x ^= x >> 15
    x = times(x, 0x846CA68B)
    x ^= x >> 16
    return x


def position_keys(seed, positions, vocab_size):
    """32-bit keys (images, L, V), int64, fixed by (seed (), image, image position (images, L), token)."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None, None]
    tokens = torch.arange(vocab_size, device=positions.device)
    return hash32(hash32(hash32(seed ^ rows) ^ positions[..., None]) ^ tokens)


def position_noise(seed, positions, vocab_size):
    """Exp(1) noise (images, L, V) fixed by (seed (), image, image position (images, L), token): the same in every
    pass of one generate() call; its uniforms are the keys' top 23 bits, ((key >> 9) + 0.5) / 2**23, exact in
    float32 and inside (0, 1) (no float64 tensor: 8 bytes per (image, position, token) fewer)."""
    key = position_keys(seed, positions, vocab_size)
    key >>= 9
    return key.to(torch.float32).add_(0.5).mul_(2.0**-23).log_().neg_()


def coupled_race(probs, noise):
    """race() with the given Exp(1) noise (..., V) instead of fresh draws."""
    return probs.log().sub_(noise.clamp_min(torch.finfo(noise.dtype).tiny).log_()).argmax(-1)


def accepted_count(p, q, drafts, u):
    """How many of each image's drafts (images, L) are accepted: draft j with probability min(1, p_j / q_j) at it
    (u (images, L) uniform in [0, 1): u q < p), counted while every draft before it was."""
    pd, qd = (t.gather(-1, drafts[..., None])[..., 0] for t in (p, q))
    return accepted_from(pd, qd, u)


def accepted_from(pd, qd, u):
    """accepted_count from p and q at the drafts (images, L)."""
    return (u * qd < pd).to(torch.int64).cumprod(-1).sum(-1)


def matched_count(drafts, target):
    """How many tokens a pathwise pass fixes per image: its targets (images, L) up to the first whose draft (images,
    L) differs, that one included; the last target always (no pass row holds its draft)."""
    return (drafts[:, :-1] == target[:, :-1]).to(torch.int64).cumprod(-1).sum(-1) + 1


def residual(p, q):
    """The distribution of the token drawn at a rejection, unnormalised: max(0, p - q)."""
    return (p - q).clamp_min(0)


def next_window(dist, count, redraw):
    """What this pass gives the next window: its position k is position count + k of this one; where that is inside
    (inside), the draft redrawn there and its q, `dist` there (the draws' distributions); the rest takes initial
    drafts. -> inside (images, L), drafts (images, L), q (images, L, V)."""
    L = dist.shape[1]
    src = count[:, None] + torch.arange(L, device=dist.device)
    at = src.clamp(max=L - 1)
    return src < L, redraw.gather(1, at), dist.gather(1, at[..., None].expand(-1, -1, dist.shape[-1]))


class JacobiRunner(ShapeRunner):
    """A shape's buffers for speculative passes: each image's accepted count n, last accepted token, window of L
    drafts and their q, and its passes; `jacobi_pass` runs one pass over every image, on the device, no sync."""

    STATE = ("n", "last", "drafts", "q", "out", "passes")

    def __init__(self, model, plan, num_tokens, prefix_len, num_controls, top_k, keep_logits, init, width,
                 coupling="none"):
        super().__init__(model, plan, num_tokens, prefix_len, num_controls, top_k, keep_logits)
        B, V, device = self.batch, model.args.vocab_size, self.out.device
        window = plan.jacobi.window
        if init == "above" and (width is None or window > width):
            raise ValueError(f"draft init 'above' needs a square token grid at least as wide as the draft window "
                             f"({window}); use a smaller window or another draft init")
        self.window, self.init, self.width, self.coupling = window, init, width, coupling
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)
        buf("n", torch.ones(B, dtype=torch.long, device=device))
        buf("last", torch.zeros(B, dtype=torch.long, device=device))
        buf("drafts", torch.zeros(B, window, dtype=torch.long, device=device))
        buf("q", torch.zeros(B, window, V, device=device))
        buf("passes", torch.zeros(B, dtype=torch.long, device=device))
        buf("steps", torch.arange(window, device=device))
        buf("noise_seed", torch.zeros((), dtype=torch.long, device=device))  # position_noise's, per generate()
        buf("masks", chain_masks(window, device))  # the window kernel's: query j sees the window's keys 0..j
        # the passes' Context and head, the window kernel's inputs or None, the fused verify (kernels/verify_triton)
        # or None: speculative.py's ops (wired by the Engine)
        self.pass_ctx, self.pass_head, self.pass_inputs, self.verify = None, None, None, None
        self.pass_prefetcher = None  # the L2 prefetcher beside the passes where the plan runs one (JacobiPass.prefetch)

    def start(self):
        """After the prefill's first token: every image at one token, its window of initial drafts."""
        self.n.fill_(1)
        self.passes.zero_()
        self.noise_seed.copy_(torch.randint(0, 2**32, (), device=self.n.device))
        self.last.copy_(self.out[:, 0])
        tokens, q = self.initial(self.n, torch.zeros_like(self.n), self.drafts)
        self.drafts.copy_(tokens)
        self.q.copy_(q)

    def initial(self, n, kept, drafts):
        """Initial drafts (images, L) and their q (images, L, V) of a window starting at image position n, whose
        first `kept` drafts are `drafts`' (redrawn from the pass): DRAFT_INITS."""
        B, L, V = self.batch, self.window, self.q.shape[-1]
        if self.init == "left":  # the token before the first initial draft, repeated
            before = torch.where(kept > 0, drafts.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0], self.last)
            return before[:, None].expand(B, L), F.one_hot(before, V).float()[:, None].expand(B, L, V)
        uniform = torch.full((B, L, V), 1.0 / V, device=n.device)
        # a uniform draft at each slot; coupled: the race over a uniform q, won by the largest key (the least noise)
        anywhere = (torch.randint(0, V, (B, L), device=n.device) if self.coupling == "none" else
                    position_keys(self.noise_seed, n[:, None] + self.steps, V).argmax(-1))
        if self.init == "random":
            return anywhere, uniform
        # above: image position i - width, accepted (the window is no wider than the grid); none in row 0
        at = n[:, None] + self.steps - self.width
        tokens = torch.where(at >= 0, self.out.gather(1, at.clamp(min=0)), anywhere)
        return tokens, torch.where((at >= 0)[..., None], F.one_hot(tokens, V).float(), uniform)

    def draw(self, probs, positions):
        """One draft per image and window slot from probs (images, L, V), at image positions (images, L): fresh race
        noise, or position_noise where drafts are coupled."""
        if self.coupling == "none":
            return race(probs)  # pathwise and gumbel: the noise fixed per position
        return coupled_race(probs, position_noise(self.noise_seed, positions, probs.shape[-1]))

    @property
    def pass_rows(self):
        """The query rows of a pass: each image's window (or tree's nodes), both CFG halves."""
        return (2 if self.cfg else 1) * self.batch * self.plan.jacobi.nodes

    def run_pass(self):
        """jacobi_pass with the L2 prefetcher beside it where the plan runs one (inside the pass's graph only)."""
        run_beside(self.pass_prefetcher, self.pass_rows, self.jacobi_pass)

    def jacobi_pass(self):
        """One pass: each image's last token and L - 1 drafts at their positions through the model, the L
        distributions, the drafts verified, the tokens written, the window moved on."""
        L, N, T = self.window, self.num_tokens, self.prefix_len
        tokens = torch.cat([self.last[:, None], self.drafts[:, : L - 1]], 1)
        # image position n - 1 + j sits at T + n - 1 + j; past the image (its outputs unused), at its last position
        pos = (T + self.n[:, None] - 1 + self.steps).clamp(max=T + N - 1)
        rows = (lambda t: torch.cat([t, t])) if self.cfg else (lambda t: t)
        ctx = self.pass_ctx
        if self.pass_inputs is None:
            x = self.model.tok_embeddings(rows(tokens))
        else:  # the embeddings, RoPE rows and control rows of each image's positions in one kernel
            x, inputs = self.pass_inputs(self.model, tokens, pos, self.controls, self.cfg)
            ctx = replace(ctx, inputs=inputs)
        if ctx.attention is not None:  # the window kernel: each image's filled keys before its window, a chain
            ctx = replace(ctx, window=(rows(T + self.n - 1), self.masks.expand(x.shape[0], L)))
        h = self.model.blocks(x, rows(pos), self.key_valid, self.controls, ctx=ctx)
        if self.verify is not None:
            return self.verify_fused(self.pass_head(h))
        p = probabilities(self.pass_head(h), self.cfg, self.cfg_scale, self.temperature, self.top_k, self.top_p,
                          self.sample_logits)
        self.advance(p)

    def advance(self, p):
        """The drafts verified against this pass's distributions p (images, L, V): tokens written, n advanced,
        the next window drawn."""
        B, L = self.batch, self.window
        if self.coupling == "pathwise":
            target = self.draw(p, self.n[:, None] + self.steps)
            return self.settle(p, target, matched_count(self.drafts, target), target)
        a = accepted_count(p, self.q, self.drafts, torch.rand(B, L, device=p.device))
        rows = torch.arange(B, device=p.device)
        j = a.clamp(max=L - 1)
        fixed = race(residual(p[rows, j], self.q[rows, j]))  # used where a draft was rejected (a < L)
        tokens = torch.where(self.steps < a[:, None], self.drafts, fixed[:, None])
        self.settle(p, tokens, torch.where(a < L, a + 1, a), self.draw(p, self.n[:, None] + self.steps))

    def settle(self, dist, tokens, count, redraw):
        """A pass's outcome per image: the first `count` of its window's tokens (images, L) written, n advanced, the
        next window's drafts: `redraw` and its distributions `dist` (images, L, V) inside (next_window), initial
        drafts past it."""
        L = self.window
        count, n_next, live = self.write_tokens(tokens, count)
        inside, redrawn, q = next_window(dist, count, redraw)
        init_tokens, init_q = self.initial(n_next, (L - count).clamp(min=0), redrawn)
        torch.where(inside, redrawn, init_tokens, out=self.drafts)
        torch.where(inside[..., None], q, init_q, out=self.q)  # no (images, L, V) tensor to copy from
        self.passes.add_(live.to(torch.long))
        self.n.copy_(n_next)

    def write_tokens(self, tokens, count):
        """The first `count` (images,) of each image's window tokens (images, L) to `out`, `last` moved on ->
        (count, 0 for finished images; the next n; which images were live)."""
        L, N = self.window, self.num_tokens
        n, live = self.n, self.n < N
        count = count * live
        k = torch.arange(N, device=tokens.device) - n[:, None]  # image position i is window position k (a gather: no
        written = (k >= 0) & (k < count[:, None])  # duplicate indices where the window runs past the image)
        self.out.copy_(torch.where(written, tokens.gather(1, k.clamp(0, L - 1)), self.out))
        n_next = (n + count).clamp(max=N)
        self.last.copy_(self.out.gather(1, (n_next - 1)[:, None])[:, 0])
        return count, n_next, live

    # ---- the fused verify (kernels/verify_triton.py): advance and settle without (images, L, V) tensors ----------

    def verify_fused(self, logits):
        """advance() from the pass's logits (rows, L, V) in verify_triton's kernels: the same calls of torch's
        generator in the same order (u, the residual's noise, fresh redraws' noise, then initial's), so the same
        tokens."""
        v, B, L, V = self.verify, self.batch, self.window, logits.shape[-1]
        settings = (self.cfg_scale, self.temperature)
        logits = logits.contiguous()
        positions = self.n[:, None] + self.steps
        if self.coupling == "pathwise":
            st = v.rows(logits, self.drafts, positions, self.noise_seed, *settings, self.top_k, self.sample_logits)
            return self.settle_fused(logits, st, st.redraw, matched_count(self.drafts, st.redraw))
        u = torch.rand(B, L, device=logits.device)
        fresh = torch.empty(B, V, device=logits.device).exponential_(1)  # the residual race's
        noise = torch.empty(B, L, V, device=logits.device).exponential_(1) if self.coupling == "none" else None
        st = v.rows(logits, self.drafts, positions, self.noise_seed, *settings, self.top_k, self.sample_logits, noise)
        a = accepted_from(st.pd, self.q.gather(-1, self.drafts[..., None])[..., 0], u)
        fixed = v.residual(logits, self.q, st, a.clamp(max=L - 1), fresh, *settings, self.sample_logits)
        tokens = torch.where(self.steps < a[:, None], self.drafts, fixed[:, None])
        self.settle_fused(logits, st, tokens, torch.where(a < L, a + 1, a))

    def settle_fused(self, logits, st, tokens, count):
        """settle() with the next window's q written by verify_triton.window from the logits and `st` (its Rows)."""
        v, L = self.verify, self.window
        count, n_next, live = self.write_tokens(tokens, count)
        src = count[:, None] + self.steps
        inside = src < L
        at = src.clamp(max=L - 1)
        redrawn = st.redraw.gather(1, at)
        init_tokens, mode = self.initial_tokens(n_next, (L - count).clamp(min=0), redrawn)
        torch.where(inside, redrawn, init_tokens, out=self.drafts)
        mode = torch.where(inside, v.FROM_PASS, mode)
        v.window(logits, self.q, st, mode, at, self.drafts, n_next[:, None] + self.steps, self.noise_seed,
                 self.cfg_scale, self.temperature, self.sample_logits)
        self.passes.add_(live.to(torch.long))
        self.n.copy_(n_next)

    def initial_tokens(self, n, kept, drafts):
        """initial()'s drafts (images, L) and what their q is (verify_triton's ONE_HOT, UNIFORM, or UNIFORM_KEYED: a
        coupled uniform draft, which the window kernel draws), without the (images, L, V) q."""
        v, B, L = self.verify, self.batch, self.window
        shape = (B, L)
        if self.init == "left":
            before = torch.where(kept > 0, drafts.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0], self.last)
            return before[:, None].expand(B, L), torch.full(shape, v.ONE_HOT, device=n.device)
        if self.coupling == "none":
            anywhere = torch.randint(0, self.q.shape[-1], shape, device=n.device)
            uniform = torch.full(shape, v.UNIFORM, device=n.device)
        else:
            anywhere = torch.zeros(shape, dtype=torch.long, device=n.device)
            uniform = torch.full(shape, v.UNIFORM_KEYED, device=n.device)
        if self.init == "random":
            return anywhere, uniform
        at = n[:, None] + self.steps - self.width
        above = at >= 0
        return torch.where(above, self.out.gather(1, at.clamp(min=0)), anywhere), torch.where(above, v.ONE_HOT, uniform)
