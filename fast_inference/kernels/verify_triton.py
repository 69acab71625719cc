"""The speculative pass's verify step (speculative.py) in three Triton kernels over the pass's logits, with no
(images, L, V) tensor besides the logits and the drafts' q:

  - `rows`, a program per (image, window position): the CFG merge and temperature in sampling.py's float32 rounding
    order (draw_triton._tempered: no fused multiply-add, a correctly rounded division), top-k as filter_logits (the
    k-th largest by bisection, draw_triton._kth_largest), softmax's max and sum; then p at the position's draft (the
    accept test's p) and the position's redraw, the race argmax(log p - log E) with E the run's Exp(1) noise (fresh,
    given) or the position's fixed noise (position_noise's hash, made here). Writes four floats and two ints per row.
  - `residual`, a program per image: the race over max(0, p - q) at the image's first rejected position (j), with
    the given fresh noise, as speculative.race(residual(p, q)).
  - `window`, a program per slot of the next window: its q written in place, p of this pass's position (recomputed
    from the logits and `rows`' sums, the same operations, the same bits), a one-hot row or a uniform one; for a coupled
    uniform draft (COUPLINGS gumbel, inits random and above) the draft too, the largest of the position's keys.

The accept test's count, the tokens written and the next window's drafts are (images, L) work in speculative.py.
A draft tree's pass (draft_tree.py) takes `tree` instead, a program per (image, node): the same row math, its p
written whole (the walk gathers its line's rows) and its target, the race at the node's depth. Top-p (a sorted
cumulative sum) keeps speculative.py's ops (plan.verify).
Tokens: the same draws as speculative.py's ops from the same random numbers (the same calls of torch's generator, in
the same order); p is softmax's up to the last bit of exp and of the sum's order, so a draw could differ only where
two of its values agree within that rounding (tests/test_verify_triton.py: the same tokens at tiny shapes).
"""
import torch

from fast_inference.kernels import draw_triton

try:
    import triton
    import triton.language as tl

    from fast_inference.kernels.draw_triton import _kth_largest, _scale_and_temperature, _tempered
except ImportError:
    triton = None

# What a slot of the next window holds (speculative.JacobiRunner.verify_fused): this pass's p at SRC, a one-hot q at
# its draft, a uniform q with its draft given (fresh), a uniform q whose draft is the position's largest key (coupled)
FROM_PASS, ONE_HOT, UNIFORM, UNIFORM_KEYED = 0, 1, 2, 3
TINY = torch.finfo(torch.float32).tiny  # the races' noise floor, as speculative.race's clamp


if triton is not None:

    @triton.jit
    def _times(x, c: tl.constexpr):
        """x * c mod 2**32 for uint32 x."""
        return x * tl.full((), c, tl.uint32)

    @triton.jit
    def _hash32(x):
        """speculative.hash32 (lowbias32) in uint32 arithmetic."""
        x = x ^ (x >> 16)
        x = _times(x, 0x7FEB352D)
        x = x ^ (x >> 15)
        x = _times(x, 0x846CA68B)
        return x ^ (x >> 16)

    @triton.jit
    def _keys(seed, b, pos, tokens):
        """speculative.position_keys of image b at image position pos for `tokens`: uint32."""
        h = _hash32(_hash32(seed ^ b.to(tl.uint32)) ^ pos.to(tl.uint32))
        return _hash32(h ^ tokens.to(tl.uint32))

    @triton.jit
    def _filtered(LOGITS, r, nrows, V: tl.constexpr, offs, scale, temperature, kth, GUIDED: tl.constexpr):
        """Row r's logits, merged, tempered, and -inf under kth (top-k); -inf past V."""
        x = _tempered(LOGITS, r, nrows, V, offs, scale, temperature, GUIDED)
        return tl.where(x < kth, float("-inf"), x)

    @triton.jit
    def _probs(x, m, s, best, offs, SAMPLE: tl.constexpr):
        """softmax(x) from its max m and sum s (exp(x - m) / s, zeros where x is -inf); greedy: one-hot at best."""
        if SAMPLE:
            p = tl.math.div_rn(tl.exp(x - m), s)
        else:
            p = tl.where(offs == best, 1.0, 0.0)
        return p

    @triton.jit
    def _argmax(score, offs, VP: tl.constexpr):
        """torch.argmax's index: the first of the largest (0 where every score is -inf)."""
        top = tl.max(score, 0)
        return tl.min(tl.where(score == top, offs, VP), 0)

    @triton.jit
    def _row(LOGITS, r, nrows, CFG_SCALE, TEMPERATURE, offs, ok, V: tl.constexpr, VP: tl.constexpr,
             TOP_K: tl.constexpr, GUIDED: tl.constexpr, SAMPLE: tl.constexpr):
        """Row r's draw distribution p (CFG merge, temperature, top-k, softmax), its max m and sum s, top-k's
        threshold kth and the best token."""
        scale, temperature = _scale_and_temperature(CFG_SCALE, TEMPERATURE)
        x = _tempered(LOGITS, r, nrows, V, offs, scale, temperature, GUIDED)
        kth = float("-inf")
        if TOP_K > 0:
            kth = _kth_largest(x, ok, TOP_K)
            x = tl.where(x < kth, float("-inf"), x)
        m = tl.max(x, 0)
        best = _argmax(x, offs, VP)
        s = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), 0)
        return _probs(x, m, s, best, offs, SAMPLE), m, s, kth, best

    @triton.jit
    def _rows_kernel(LOGITS, DRAFTS, NOISE, POS, SEED, CFG_SCALE, TEMPERATURE, M, S, KTH, BEST, PD, REDRAW, nrows,
                     L, V: tl.constexpr, VP: tl.constexpr, TOP_K: tl.constexpr, GUIDED: tl.constexpr,
                     SAMPLE: tl.constexpr, KEYED: tl.constexpr, TINY: tl.constexpr):
        r = tl.program_id(0)  # image r // L, window position r % L
        offs = tl.arange(0, VP)
        ok = offs < V
        p, m, s, kth, best = _row(LOGITS, r, nrows, CFG_SCALE, TEMPERATURE, offs, ok, V, VP, TOP_K, GUIDED, SAMPLE)
        draft = tl.load(DRAFTS + r)
        if KEYED:  # position_noise: the keys' top 23 bits as a uniform, E = -log U
            key = _keys(tl.load(SEED).to(tl.uint32), r // L, tl.load(POS + r), offs)
            e = -tl.log(((key >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07)
        else:
            e = tl.load(NOISE + r * V + offs, mask=ok, other=1.0)
        score = tl.where(ok, tl.log(p) - tl.log(tl.maximum(e, TINY)), float("-inf"))
        tl.store(M + r, m)
        tl.store(S + r, s)
        tl.store(KTH + r, kth)
        tl.store(BEST + r, best.to(tl.int64))
        tl.store(PD + r, tl.sum(tl.where(offs == draft, p, 0.0), 0))
        tl.store(REDRAW + r, _argmax(score, offs, VP).to(tl.int64))

    @triton.jit
    def _residual_kernel(LOGITS, Q, NOISE, J, M, S, KTH, BEST, FIXED, nrows, L, CFG_SCALE, TEMPERATURE,
                         V: tl.constexpr, VP: tl.constexpr, GUIDED: tl.constexpr, SAMPLE: tl.constexpr,
                         TINY: tl.constexpr):
        b = tl.program_id(0)
        r = b * L + tl.load(J + b)
        offs = tl.arange(0, VP)
        ok = offs < V
        scale, temperature = _scale_and_temperature(CFG_SCALE, TEMPERATURE)
        x = _filtered(LOGITS, r, nrows, V, offs, scale, temperature, tl.load(KTH + r), GUIDED)
        p = _probs(x, tl.load(M + r), tl.load(S + r), tl.load(BEST + r), offs, SAMPLE)
        q = tl.load(Q + r * V + offs, mask=ok, other=0.0)
        e = tl.load(NOISE + b * V + offs, mask=ok, other=1.0)
        score = tl.where(ok, tl.log(tl.maximum(p - q, 0.0)) - tl.log(tl.maximum(e, TINY)), float("-inf"))
        tl.store(FIXED + b, _argmax(score, offs, VP).to(tl.int64))

    @triton.jit
    def _window_kernel(LOGITS, Q, MODE, SRC, DRAFTS, POS, SEED, M, S, KTH, BEST, nrows, L, CFG_SCALE, TEMPERATURE,
                       uniform, V: tl.constexpr, VP: tl.constexpr, GUIDED: tl.constexpr, SAMPLE: tl.constexpr):
        r = tl.program_id(0)  # the next window's slot r % L of image r // L
        offs = tl.arange(0, VP)
        ok = offs < V
        mode = tl.load(MODE + r)
        if mode == 0:  # FROM_PASS
            src = r // L * L + tl.load(SRC + r)
            scale, temperature = _scale_and_temperature(CFG_SCALE, TEMPERATURE)
            x = _filtered(LOGITS, src, nrows, V, offs, scale, temperature, tl.load(KTH + src), GUIDED)
            q = _probs(x, tl.load(M + src), tl.load(S + src), tl.load(BEST + src), offs, SAMPLE)
        elif mode == 1:  # ONE_HOT at the slot's draft
            q = tl.where(offs == tl.load(DRAFTS + r), 1.0, 0.0)
        else:  # UNIFORM, UNIFORM_KEYED
            q = tl.zeros([VP], tl.float32) + uniform
            if mode == 3:
                key = _keys(tl.load(SEED).to(tl.uint32), r // L, tl.load(POS + r), offs)
                key = tl.where(ok, key.to(tl.int64), -1)
                tl.store(DRAFTS + r, _argmax(key, offs, VP).to(tl.int64))
        tl.store(Q + r * V + offs, q, mask=ok)

    @triton.jit
    def _tree_kernel(LOGITS, LOG_NOISE, DEPTH, P, TARGET, CFG_SCALE, TEMPERATURE, nrows, S, D, V: tl.constexpr,
                     VP: tl.constexpr, TOP_K: tl.constexpr, GUIDED: tl.constexpr, SAMPLE: tl.constexpr):
        r = tl.program_id(0)  # image r // S, node r % S
        offs = tl.arange(0, VP)
        ok = offs < V
        p = _row(LOGITS, r, nrows, CFG_SCALE, TEMPERATURE, offs, ok, V, VP, TOP_K, GUIDED, SAMPLE)[0]
        tl.store(P + r * V + offs, p, mask=ok)
        noise = LOG_NOISE + ((r // S) * D + tl.load(DEPTH + r % S)) * V
        score = tl.where(ok, tl.log(p) - tl.load(noise + offs, mask=ok, other=0.0), float("-inf"))
        tl.store(TARGET + r, _argmax(score, offs, VP).to(tl.int64))


class Rows:
    """`rows`' outputs per (image, window position): softmax's max and sum, top-k's threshold, the best token, p at the
    draft, the redraw."""

    def __init__(self, m, s, kth, best, pd, redraw):
        self.m, self.s, self.kth, self.best, self.pd, self.redraw = m, s, kth, best, pd, redraw


def _common(logits, images):
    rows, L, V = logits.shape
    assert logits.is_contiguous() and logits.dtype == torch.float32 and rows in (images, 2 * images)
    VP = triton.next_power_of_2(V)
    warps, registers = draw_triton.warps_and_registers(VP)
    return L, V, dict(V=V, VP=VP, GUIDED=rows == 2 * images, num_warps=warps, maxnreg=registers,
                      enable_fp_fusion=False)


def top_k_of(top_k, V):
    """filter_logits' k: 0 where nothing is filtered."""
    k = min(max(top_k, 1), V) if top_k > 0 else 0
    return 0 if k == V else k


def rows(logits, drafts, positions, seed, cfg_scale, temperature, top_k, sample_logits, noise=None):
    """logits (rows, L, V) float32 of a pass over `drafts` (images, L) at image positions (images, L) -> Rows. noise:
    the redraws' Exp(1) noise (images, L, V), or None for position_noise's (seed ()); cfg_scale, temperature: ()
    tensors."""
    B, L = drafts.shape
    L_, V, kw = _common(logits, B)
    assert L_ == L and drafts.is_contiguous() and positions.is_contiguous()
    f = lambda: torch.empty(B, L, device=logits.device)
    i = lambda: torch.empty(B, L, dtype=torch.long, device=logits.device)
    out = Rows(m=f(), s=f(), kth=f(), best=i(), pd=f(), redraw=i())
    keyed = noise is None
    if not keyed:
        assert noise.shape == (B, L, V) and noise.is_contiguous()
    _rows_kernel[(B * L,)](logits, drafts, logits if keyed else noise, positions, seed, cfg_scale, temperature, out.m,
                           out.s, out.kth, out.best, out.pd, out.redraw, B * L, L, TOP_K=top_k_of(top_k, V),
                           SAMPLE=sample_logits, KEYED=keyed, TINY=TINY, **kw)
    return out


def residual(logits, q, st, j, noise, cfg_scale, temperature, sample_logits):
    """Each image's race over max(0, p - q) at its window position j (images,), with Exp(1) noise (images, V)."""
    B, L, V = q.shape
    _, _, kw = _common(logits, B)
    assert q.is_contiguous() and noise.shape == (B, V) and noise.is_contiguous()
    fixed = torch.empty(B, dtype=torch.long, device=q.device)
    _residual_kernel[(B,)](logits, q, noise, j.contiguous(), st.m, st.s, st.kth, st.best, fixed, B * L, L, cfg_scale,
                           temperature, SAMPLE=sample_logits, TINY=TINY, **kw)
    return fixed


def window(logits, q, st, mode, src, drafts, positions, seed, cfg_scale, temperature, sample_logits):
    """The next window's q (images, L, V), in place: slot k of image b as mode[b, k] says (FROM_PASS: p at this pass's
    position src[b, k]); drafts (images, L) written where mode is UNIFORM_KEYED (the largest key at positions[b, k])."""
    B, L, V = q.shape
    _, _, kw = _common(logits, B)
    assert q.is_contiguous() and drafts.is_contiguous() and mode.is_contiguous() and src.is_contiguous()
    _window_kernel[(B * L,)](logits, q, mode, src, drafts, positions.contiguous(), seed, st.m, st.s, st.kth, st.best,
                             B * L, L, cfg_scale, temperature, 1.0 / V, SAMPLE=sample_logits, **kw)


def tree(logits, log_noise, depth, cfg_scale, temperature, top_k, sample_logits):
    """A draft tree's pass: logits (rows, S, V) float32 of its S nodes -> (p, target): the nodes' distributions
    (images, S, V), as speculative.probabilities gives them, and each node's draw argmax(log p - log_noise[image,
    depth[node]]) (images, S), as draft_tree.advance_tree draws them; log_noise (images, depths, V), depth (S,)."""
    S = depth.shape[0]
    B, D, V = log_noise.shape
    _, V_, kw = _common(logits, B)
    assert V_ == V and logits.shape[1] == S and log_noise.is_contiguous() and depth.is_contiguous()
    p = torch.empty(B, S, V, device=logits.device)
    target = torch.empty(B, S, dtype=torch.long, device=logits.device)
    _tree_kernel[(B * S,)](logits, log_noise, depth, p, target, cfg_scale, temperature, B * S, S, D,
                           TOP_K=top_k_of(top_k, V), SAMPLE=sample_logits, **kw)
    return p, target
