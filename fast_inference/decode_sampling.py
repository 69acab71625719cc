"""The head's sampling in one Triton kernel: CFG merge, temperature, top-k, the exponential race,
and the token written where the step needs it.

sampling.py's routine, eager, is ~20 small kernels per step around PyTorch's top-k: 80-100 us on an
H200 (scripts/bench_sampling.py), about 7% of a one-image step. Here one program per image does it
all in ~30 us:
  - the CFG merge and temperature in sampling.py's float32 rounding order (no fused multiply-add,
    a correctly rounded division);
  - top-k as sampling.filter_logits (values equal to the k-th largest survive). The k-th largest
    is found by bisection over the floats' 32-bit order-preserving keys, the row in registers: one
    block-wide count per pass, no sort;
  - the exponential race, argmax(logit - log E) with E = -log(U): no sync, the same distribution as
    torch.multinomial. U comes from Philox keyed by a per-call seed (drawn from torch's generator),
    at a counter unique to (position, image, token). log E depends on neither the logits nor the
    previous kernels, so the fused head (decode_block.logits) computes it before its PDL wait, spread
    over its programs (`race_noise`), and the draw reads it (NOISE) instead of two logarithms and a
    Philox round per logit on its one SM;
  - the token to `token` and `out`; the logits (float32) to the Sampler's buffer for teacher forcing.
Top-p needs a sorted cumulative sum and stays on sampling.py's path.
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

CHUNK = 4096  # logits per pass of the draw's loop: 8 per thread at 16 warps
WARPS = 16  # for a 16,384-token row: 32 logits per thread, 128 registers (sm_90), no spills


if triton is not None:

    @triton.jit
    def _order_key(x):
        """int32 keys of float32 x whose signed order is the floats' order (-0.0 below +0.0); an involution."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _kth_largest(x, ok, k):
        """The k-th largest of x[ok] (float32): the smallest of the keys >= the largest key t with at
        least k keys >= t, found by bisection, one block-wide count per pass. It stops early where
        exactly k keys are >= the midpoint (typically after ~20 of the 32 passes)."""
        key = tl.where(ok, _order_key(x + 0.0), -2147483648)  # + 0.0: -0.0 compares equal to 0.0, as in torch
        lo = tl.full((), -2147483648, tl.int64)
        hi = tl.full((), 2147483647, tl.int64)
        while lo < hi:  # at least k keys are >= lo; fewer than k are > hi
            mid = (lo + hi + 1) >> 1
            count = tl.sum((key >= mid.to(tl.int32)).to(tl.int32), 0)
            lo = tl.where(count >= k, mid, lo)
            hi = tl.where(count > k, hi, tl.where(count == k, mid, mid - 1))
        kth = tl.min(tl.where(key >= lo.to(tl.int32), key, 2147483647), 0)
        return _order_key(kth).to(tl.float32, bitcast=True)

    @triton.jit
    def _counter(pos, batch, b, c, VP: tl.constexpr):
        """Philox's first counter of the chunk at logit c of image b at pos (a chunk's lane t uses + t)."""
        return ((pos * batch + b) * VP + c) // 4

    @triton.jit
    def race_noise(seed, pos, b, batch, j, VP: tl.constexpr, CHUNK: tl.constexpr):
        """log E = log(-log U) of the race for tokens j of image b at pos, U as the draw's chunk loop draws it
        (a chunk's quarter q takes Philox output q at its lane's counter): the draw subtracts it from the logits."""
        Q: tl.constexpr = CHUNK // 4
        q = j % CHUNK // Q
        u0, u1, u2, u3 = tl.rand4x(seed, _counter(pos, batch, b, j // CHUNK * CHUNK, VP) + j % Q)
        u = tl.where(q == 0, u0, tl.where(q == 1, u1, tl.where(q == 2, u2, u3)))
        return tl.log(-tl.log(u))

    @triton.jit
    def _tempered(LOGITS, b, batch, V: tl.constexpr, offs, scale, temperature, GUIDED: tl.constexpr):
        """Image b's logits at offs, CFG-merged (if GUIDED) and divided by the temperature; -inf past V."""
        ok = offs < V
        x = tl.load(LOGITS + b * V + offs, mask=ok, other=0.0).to(tl.float32)
        if GUIDED:
            u = tl.load(LOGITS + (batch + b) * V + offs, mask=ok, other=0.0).to(tl.float32)
            x = u + (x - u) * scale
        x = tl.math.div_rn(x, temperature)  # a correctly rounded division, as torch's
        return tl.where(ok, x, float("-inf"))

    @triton.jit
    def _race(LOGITS, b, batch, V: tl.constexpr, offs, scale, temperature, kth, log_e, best, token,
              GUIDED: tl.constexpr, SAMPLE: tl.constexpr):
        """Each lane's running (best score, its token) updated with the logits at offs: those below kth
        out, and if SAMPLE the race's score x - log E (U = 0: E = inf, a score of -inf).
        Strictly greater keeps a lane's first maximum."""
        x = _tempered(LOGITS, b, batch, V, offs, scale, temperature, GUIDED)
        x = tl.where(x < kth, float("-inf"), x)
        if SAMPLE:
            x = x - log_e
        return tl.where(x > best, x, best), tl.where(x > best, offs, token)

    @triton.jit
    def _draw_kernel(LOGITS, LOGITS_OUT, NOISE, TOKEN, OUT, POS, SEED, CFG_SCALE, TEMPERATURE, batch, stride_out,
                     prefix_len, V: tl.constexpr, TOP_K: tl.constexpr, GUIDED: tl.constexpr, SAMPLE: tl.constexpr,
                     HAS_NOISE: tl.constexpr, VP: tl.constexpr, CHUNK: tl.constexpr):
        """Image b: rows b (and batch + b, unconditional, if GUIDED) of LOGITS (rows, V) -> TOKEN[b] and
        OUT[b, POS - prefix_len + 1]; the rows, in float32, to LOGITS_OUT. HAS_NOISE: the race's log E
        read from NOISE (batch, V), as race_noise made it, instead of drawn here."""
        b = tl.program_id(0)
        offs = tl.arange(0, VP)
        ok = offs < V
        tl.store(LOGITS_OUT + b * V + offs, tl.load(LOGITS + b * V + offs, mask=ok), mask=ok)
        if GUIDED:
            tl.store(LOGITS_OUT + (batch + b) * V + offs, tl.load(LOGITS + (batch + b) * V + offs, mask=ok), mask=ok)
        scale = tl.load(CFG_SCALE)
        temperature = tl.maximum(tl.load(TEMPERATURE), 1e-5)
        kth = float("-inf")
        if TOP_K > 0:  # the whole row in registers
            kth = _kth_largest(_tempered(LOGITS, b, batch, V, offs, scale, temperature, GUIDED), ok, TOP_K)
        pos = tl.load(POS)
        seed = tl.load(SEED)
        # The draw a chunk at a time (Philox over a whole row at once would not fit in registers), the
        # logits read again from cache, each lane keeping its best (a reduction per chunk would cost
        # more than the chunk). A chunk is four quarters, one per Philox output (each call makes four).
        Q: tl.constexpr = CHUNK // 4
        t = tl.arange(0, Q)
        best = tl.full([Q], float("-inf"), tl.float32)
        lane = tl.zeros([Q], tl.int32)
        for c in range(0, VP, CHUNK):
            e0, e1, e2, e3 = 0.0, 0.0, 0.0, 0.0
            if SAMPLE and HAS_NOISE:
                noise = NOISE + b * V + c + t
                e0 = tl.load(noise, mask=c + t < V, other=0.0)
                e1 = tl.load(noise + Q, mask=c + Q + t < V, other=0.0)
                e2 = tl.load(noise + 2 * Q, mask=c + 2 * Q + t < V, other=0.0)
                e3 = tl.load(noise + 3 * Q, mask=c + 3 * Q + t < V, other=0.0)
            elif SAMPLE:
                u0, u1, u2, u3 = tl.rand4x(seed, _counter(pos, batch, b, c, VP) + t)
                e0, e1, e2, e3 = tl.log(-tl.log(u0)), tl.log(-tl.log(u1)), tl.log(-tl.log(u2)), tl.log(-tl.log(u3))
            best, lane = _race(LOGITS, b, batch, V, c + t, scale, temperature, kth, e0, best, lane, GUIDED, SAMPLE)
            best, lane = _race(LOGITS, b, batch, V, c + Q + t, scale, temperature, kth, e1, best, lane, GUIDED, SAMPLE)
            best, lane = _race(LOGITS, b, batch, V, c + 2 * Q + t, scale, temperature, kth, e2, best, lane, GUIDED,
                               SAMPLE)
            best, lane = _race(LOGITS, b, batch, V, c + 3 * Q + t, scale, temperature, kth, e3, best, lane, GUIDED,
                               SAMPLE)
        # The first token with the best score, as torch.argmax: the smallest among the lanes holding it.
        token = tl.min(tl.where(best == tl.max(best, 0), lane, VP), 0)
        tl.store(TOKEN + b, token.to(tl.int64))
        tl.store(OUT + b * stride_out + pos - prefix_len + 1, token.to(tl.int64))


def layout(V):
    """(VP, CHUNK) of the draw for a vocabulary of V: the row padded to a power of two, and its chunk."""
    VP = triton.next_power_of_2(V)
    return VP, min(VP, CHUNK)


def draw(logits, logits_out, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, top_k, guided,
         sample_logits, noise=None):
    """sampling.sample(cfg_merge(logits) if guided else logits, temperature, top_k, race=True) for
    logits (rows, V) of one step at input_pos: the tokens (batch, 1) to `token` and to out[:, input_pos -
    prefix_len + 1]; logits, as float32, copied to logits_out[:rows]. noise: the race's log E (batch, V),
    made by race_noise for this step and seed (else drawn here). Tensors stay on the device: no sync."""
    batch, V = token.shape[0], logits.shape[-1]
    assert logits.shape[0] == (2 * batch if guided else batch) and logits.is_contiguous()
    assert noise is None or (noise.shape == (batch, V) and noise.is_contiguous())
    VP, chunk = layout(V)
    k = min(top_k, V) if top_k > 0 else 0
    _draw_kernel[(batch,)](
        logits, logits_out, logits_out if noise is None else noise, token, out, input_pos, seed, cfg_scale,
        temperature, batch, out.stride(0), prefix_len, V=V, TOP_K=0 if k == V else k, GUIDED=guided,
        SAMPLE=sample_logits, HAS_NOISE=noise is not None, VP=VP, CHUNK=chunk,
        num_warps=max(1, min(WARPS, VP // 1024)), enable_fp_fusion=False)


def supported(device, top_p):
    """Triton on a CUDA device; top-p (< 1) takes sampling.py's path."""
    return triton is not None and torch.device(device).type == "cuda" and top_p >= 1.0
