"""The head's sampling in one Triton kernel: CFG merge, temperature, top-k, the exponential race,
and the token written where the step needs it.

sampling.py's routine, eager, is ~20 small kernels per step around PyTorch's top-k: 80-100 us on an
H200 (scripts/bench_sampling.py), about 7% of a one-image step. Here one program per image does it
all:
  - the CFG merge and temperature in sampling.py's float32 rounding order (no fused multiply-add,
    a correctly rounded division);
  - the exponential race, argmax(logit - log E) with E = -log(U): no sync, the same distribution as
    torch.multinomial. U comes from Philox keyed by a per-call seed (drawn from torch's generator),
    at a counter unique to (position, image, token). log E depends on neither the logits nor the
    previous kernels, so the fused head (decode_block.logits) computes it before its PDL wait, spread
    over its programs (`race_noise`), and the draw reads it (NOISE_READY) instead of two logarithms
    and a Philox round per logit on its one SM; elsewhere the draw makes it first;
  - top-k as sampling.filter_logits (values equal to the k-th largest survive), decided for the
    race's winner alone: it is kept if fewer than k logits exceed its own. If not, the next winner
    races (TRIES in all; the first two found in one pass and counted in the next), and then the k-th
    largest is found by bisection over the floats' 32-bit order-preserving keys, the row in
    registers, one block-wide count per pass. Either way the token is the race's among the kept
    logits, the same bits;
  - the token to `token` and `out`.
Top-p needs a sorted cumulative sum and stays on sampling.py's path.
"""
import torch

from fast_inference.pdl import EARLY, launch, use_pdl

try:
    import triton
    import triton.language as tl

    from fast_inference.pdl import pdl_wait
except ImportError:
    triton = None

CHUNK = 4096  # logits per pass of the draw's noise loop: 8 per thread at 16 warps
RACE_CHUNK = 2048  # logits per pass of the race's and the counts' loops (4,096 spills at sm_90)
TRIES = 5  # race winners checked against top-k before the k-th largest is searched (0: at once)
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
    def _next_winner(LOGITS, NOISE, b, batch, V: tl.constexpr, scale, temperature, kth, best, token,
                     GUIDED: tl.constexpr, SAMPLE: tl.constexpr, VP: tl.constexpr, RC: tl.constexpr):
        """The race's winner among the logits >= kth that come after (best, token) in (score descending,
        index ascending) order: its score x - log E (greedy: x) and its index, the first of equal scores
        (as torch.argmax). A chunk at a time, the logits read again from cache, each lane keeping its
        first best."""
        t = tl.arange(0, RC)
        run = tl.full([RC], float("-inf"), tl.float32)
        lane = tl.zeros([RC], tl.int32)
        for c in range(0, VP, RC):
            x = _tempered(LOGITS, b, batch, V, c + t, scale, temperature, GUIDED)
            x = tl.where(x < kth, float("-inf"), x)
            if SAMPLE:  # U = 0: E = inf, a score of -inf
                x = x - tl.load(NOISE + b * V + c + t, mask=c + t < V, other=0.0)
            x = tl.where((x < best) | ((x == best) & (c + t > token)), x, float("-inf"))
            lane = tl.where(x > run, c + t, lane)
            run = tl.where(x > run, x, run)
        top = tl.max(run, 0)
        return top, tl.min(tl.where(run == top, lane, VP), 0)

    @triton.jit
    def _first_two(LOGITS, NOISE, b, batch, V: tl.constexpr, scale, temperature, GUIDED: tl.constexpr,
                   SAMPLE: tl.constexpr, VP: tl.constexpr, RC: tl.constexpr):
        """The race's first two winners, (score, index) each, in _next_winner's order, in one pass: each lane
        keeps its best two, so the second is the first's lane's second or another lane's best."""
        t = tl.arange(0, RC)
        run = tl.full([RC], float("-inf"), tl.float32)
        run2 = tl.full([RC], float("-inf"), tl.float32)
        lane = tl.zeros([RC], tl.int32)
        lane2 = tl.zeros([RC], tl.int32)
        for c in range(0, VP, RC):
            x = _tempered(LOGITS, b, batch, V, c + t, scale, temperature, GUIDED)
            if SAMPLE:
                x = x - tl.load(NOISE + b * V + c + t, mask=c + t < V, other=0.0)
            first = x > run
            second = (x > run2) & ~first  # a tie with the lane's best comes after it: a later index
            run2 = tl.where(first, run, tl.where(second, x, run2))
            lane2 = tl.where(first, lane, tl.where(second, c + t, lane2))
            run = tl.where(first, x, run)
            lane = tl.where(first, c + t, lane)
        top = tl.max(run, 0)
        token = tl.min(tl.where(run == top, lane, VP), 0)
        alt = tl.where(lane == token, run2, run)
        alt_lane = tl.where(lane == token, lane2, lane)
        top2 = tl.max(alt, 0)
        return top, token, top2, tl.min(tl.where(alt == top2, alt_lane, VP), 0)

    @triton.jit
    def _count_above(LOGITS, b, batch, V: tl.constexpr, scale, temperature, x, x2, GUIDED: tl.constexpr,
                     VP: tl.constexpr, RC: tl.constexpr):
        """How many of image b's logits exceed x, and how many exceed x2, a chunk at a time."""
        t = tl.arange(0, RC)
        n = tl.zeros([RC], tl.int32)
        n2 = tl.zeros([RC], tl.int32)
        for c in range(0, VP, RC):
            v = _tempered(LOGITS, b, batch, V, c + t, scale, temperature, GUIDED)
            n += (v > x).to(tl.int32)
            n2 += (v > x2).to(tl.int32)
        return tl.sum(n, 0), tl.sum(n2, 0)

    @triton.jit
    def _make_noise(NOISE, b, batch, V: tl.constexpr, pos, seed, VP: tl.constexpr, CHUNK: tl.constexpr):
        """race_noise's values for image b into NOISE[b], a chunk at a time (over the whole row at once
        Philox would not fit in registers): a chunk's quarter q takes Philox output q, four per call."""
        Q: tl.constexpr = CHUNK // 4
        t = tl.arange(0, Q)
        for c in range(0, VP, CHUNK):
            u0, u1, u2, u3 = tl.rand4x(seed, _counter(pos, batch, b, c, VP) + t)
            at = NOISE + b * V + c + t
            tl.store(at, tl.log(-tl.log(u0)), mask=c + t < V)
            tl.store(at + Q, tl.log(-tl.log(u1)), mask=c + Q + t < V)
            tl.store(at + 2 * Q, tl.log(-tl.log(u2)), mask=c + 2 * Q + t < V)
            tl.store(at + 3 * Q, tl.log(-tl.log(u3)), mask=c + 3 * Q + t < V)
        tl.debug_barrier()  # the row is read back by other threads

    @triton.jit
    def _draw_kernel(LOGITS, NOISE, TOKEN, OUT, POS, SEED, CFG_SCALE, TEMPERATURE, COUNT, batch, stride_out,
                     prefix_len, V: tl.constexpr, TOP_K: tl.constexpr, GUIDED: tl.constexpr,
                     SAMPLE: tl.constexpr, NOISE_READY: tl.constexpr, ADVANCE: tl.constexpr, PAIR: tl.constexpr,
                     SINGLES: tl.constexpr, VP: tl.constexpr, CHUNK: tl.constexpr, RC: tl.constexpr,
                     PDL: tl.constexpr):
        """Image b: rows b (and batch + b, unconditional, if GUIDED) of LOGITS (rows, V) -> TOKEN[b] and
        OUT[b, POS - prefix_len + 1]. The race's log E is read from NOISE (batch, V): made by race_noise for
        this step (NOISE_READY), or here first. ADVANCE: POS + 1 to POS, by the last program to finish (an
        acq_rel count, left at zero). PAIR: the first two winners checked from two passes, then SINGLES
        more, one per two passes."""
        b = tl.program_id(0)
        offs = tl.arange(0, VP)
        ok = offs < V
        scale = tl.load(CFG_SCALE)  # before the wait: set before the prefill
        temperature = tl.maximum(tl.load(TEMPERATURE), 1e-5)
        pdl_wait(PDL)  # the position after it: the prefill sets it right before its draw
        if SAMPLE and not NOISE_READY:
            _make_noise(NOISE, b, batch, V, tl.load(POS), tl.load(SEED), VP, CHUNK)
        # The race's winner over all tokens is top-k's if fewer than k logits exceed its own (x_i >= the k-th
        # largest exactly then); else it drops out and the next in (score, -index) order races, TRIES in
        # all. With GPT-XL's merged logits the first winner is in the top 2,000 ~90% of the time (its share
        # of the softmax, random weights): two passes instead of the k-th largest's 20-32 counts. The first
        # two winners share their two passes: with many images some image's first winner is out most steps,
        # and the slowest image sets the draw's time. The passes read the logits again from cache a chunk at
        # a time, and the tries are unrolled, each under its own branch: a row held in registers beside the
        # k-th largest's spills at sm_90.
        best = tl.full((), float("inf"), tl.float32)
        token = tl.full((), -1, tl.int32)
        pending = tl.full((), 1, tl.int32)
        if PAIR:  # the first two winners from one pass, both counted in the next: two tries for two passes
            best, token, best2, token2 = _first_two(LOGITS, NOISE, b, batch, V, scale, temperature, GUIDED, SAMPLE,
                                                    VP, RC)
            pending = tl.zeros((), tl.int32)
            if TOP_K > 0:
                x = _tempered(LOGITS, b, batch, V, token, scale, temperature, GUIDED)
                x2 = _tempered(LOGITS, b, batch, V, token2, scale, temperature, GUIDED)
                above, above2 = _count_above(LOGITS, b, batch, V, scale, temperature, x, x2, GUIDED, VP, RC)
                if (above >= TOP_K) | (best == float("-inf")):
                    best, token = best2, token2
                    pending = ((above2 >= TOP_K) | (best2 == float("-inf"))).to(tl.int32)
        for _try in tl.static_range(SINGLES):  # then one winner per two passes
            if pending != 0:
                best, token = _next_winner(LOGITS, NOISE, b, batch, V, scale, temperature, float("-inf"), best, token,
                                           GUIDED, SAMPLE, VP, RC)
                pending = tl.zeros((), tl.int32)
                if TOP_K > 0:  # (no finite score left: the k-th largest decides)
                    x = _tempered(LOGITS, b, batch, V, token, scale, temperature, GUIDED)
                    above, _ = _count_above(LOGITS, b, batch, V, scale, temperature, x, x, GUIDED, VP, RC)
                    pending = ((above >= TOP_K) | (best == float("-inf"))).to(tl.int32)
        if pending != 0:  # then the race among the logits >= the k-th largest
            kth = float("-inf")
            if TOP_K > 0:
                kth = _kth_largest(_tempered(LOGITS, b, batch, V, offs, scale, temperature, GUIDED), ok, TOP_K)
            best, token = _next_winner(LOGITS, NOISE, b, batch, V, scale, temperature, kth, float("inf"), -1, GUIDED,
                                       SAMPLE, VP, RC)
        pos = tl.load(POS)  # here: held through the tries it spilled
        tl.store(TOKEN + b, token.to(tl.int64))
        tl.store(OUT + b * stride_out + pos - prefix_len + 1, token.to(tl.int64))
        if ADVANCE:  # every program has read the position once the count reaches batch
            tl.debug_barrier()
            last = tl.atomic_add(COUNT, 1, sem="acq_rel", scope="gpu") == batch - 1
            tl.store(POS, pos + 1, mask=last)
            tl.store(COUNT, 0, mask=last)


def layout(V):
    """(VP, CHUNK) of the draw for a vocabulary of V: the row padded to a power of two, and its chunk."""
    VP = triton.next_power_of_2(V)
    return VP, min(VP, CHUNK)


def warps_and_registers(VP):
    """The draw's warps for a row of VP (at least 4: with one, a 1,024-token row spilled 312 B at sm_90), and
    its registers per thread: the register file's share (128 at 16 warps; ptxas takes at most 255). Left to
    itself, ptxas (Triton 3.9's) gave the unguided float32 kernel 64 registers and spilled 40 B."""
    warps = max(4, min(WARPS, VP // 1024))
    return warps, min(255, 65536 // (32 * warps))


def draw(logits, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, top_k, guided,
         sample_logits, noise=None, noise_ready=False, count=None):
    """sampling.sample(cfg_merge(logits) if guided else logits, temperature, top_k, race=True) for
    logits (rows, V) of one step at input_pos: the tokens (batch, 1) to `token` and to out[:, input_pos -
    prefix_len + 1]. noise (batch, V) float32: the race's log E, made for this step by race_noise
    (noise_ready), or made here into it (None: a buffer of its own). count: an int32 zero; then input_pos
    is advanced here too, one kernel less per step. With PDL where it exists (before its wait it reads
    only cfg_scale and temperature, set before the prefill). Tensors stay on the device: no sync."""
    batch, V = token.shape[0], logits.shape[-1]
    assert logits.shape[0] == (2 * batch if guided else batch) and logits.is_contiguous()
    if noise is None:
        assert not noise_ready
        noise = torch.empty(batch, V, device=logits.device)
    assert noise.shape == (batch, V) and noise.is_contiguous()
    VP, chunk = layout(V)
    k = min(top_k, V) if top_k > 0 else 0
    warps, registers = warps_and_registers(VP)
    pair = TRIES >= 2
    _draw_kernel[(batch,)](
        logits, noise, token, out, input_pos, seed, cfg_scale, temperature, input_pos if count is None else count,
        batch, out.stride(0), prefix_len, V=V, TOP_K=0 if k == V else k, GUIDED=guided, SAMPLE=sample_logits,
        NOISE_READY=noise_ready, ADVANCE=count is not None, PAIR=pair, SINGLES=TRIES - 2 if pair else TRIES,
        VP=VP, CHUNK=chunk, RC=min(VP, RACE_CHUNK), num_warps=warps, maxnreg=registers,
        enable_fp_fusion=False, **launch(EARLY if use_pdl(logits.device) else False))


def supported(device, top_p):
    """Triton on a CUDA device; top-p (< 1) takes sampling.py's path."""
    return triton is not None and torch.device(device).type == "cuda" and top_p >= 1.0
