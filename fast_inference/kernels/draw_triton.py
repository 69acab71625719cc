"""The head's sampling in two Triton kernels: CFG merge, temperature, top-k, the exponential race,
and the token written where the step needs it.

sampling.py's routine, eager, is ~20 small kernels per step around PyTorch's top-k: 80-100 us on an
H200 (scripts/bench_sampling.py), about 7% of a one-image step. Here each image's row is split over a
few programs (a race chunk each, `splits`), and two kernels do it all:
  - the CFG merge and temperature in sampling.py's float32 rounding order (no fused multiply-add,
    a correctly rounded division);
  - the exponential race, argmax(logit - log E) with E = -log(U): no sync, the same distribution as
    torch.multinomial. U comes from Philox keyed by a per-call seed (drawn from torch's generator),
    at a counter unique to (position, image, token). log E depends on neither the logits nor the
    previous kernels, so the fused head (block_triton.logits) computes it before its PDL wait, spread
    over its programs (`race_noise`), and the draw reads it (NOISE_READY); elsewhere the first kernel
    makes it. The first kernel's programs each find their chunk's first two winners;
  - top-k as sampling.filter_logits (values equal to the k-th largest survive), decided for the
    race's winner alone: it is kept if fewer than k logits exceed its own. The second kernel's programs
    take the best two of the chunks' winners and count their chunks' logits above both; the image's last
    program decides. If both drop out, the next winner races on that program (TRIES in all), and then the
    k-th largest is found by bisection over the floats' 32-bit order-preserving keys, the row in
    registers, one block-wide count per pass. Either way the token is the race's among the kept
    logits, the same bits;
  - the token to `token` and `out`.
Top-p needs a sorted cumulative sum and stays on sampling.py's path.
"""
import torch

from fast_inference.kernels.pdl import launch

try:
    import triton
    import triton.language as tl

    from fast_inference.kernels.pdl import pdl_wait
except ImportError:
    triton = None

CHUNK = 4096  # logits per Philox chunk of the race's noise: its quarter q takes Philox output q (race_noise)
RACE_CHUNK = 2048  # logits per pass of the race's and the counts' loops (4,096 spills at sm_90), and per program
TRIES = 5  # race winners checked against top-k before the k-th largest is searched (0: at once)
WARPS = 16  # for a 16,384-token row: 32 logits per thread, 128 registers (sm_90), no spills
PROGRAMS = 128  # the draw's programs over all images at most: one wave on an H100/H200's 132 SMs


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
        """log E = log(-log U) of the race for tokens j of image b at pos: the draw subtracts it from the logits.
        U is Philox output q at the counter of j's CHUNK-logit chunk plus j's place in its quarter q of it."""
        Q: tl.constexpr = CHUNK // 4
        q = j % CHUNK // Q
        u0, u1, u2, u3 = tl.rand4x(seed, _counter(pos, batch, b, j // CHUNK * CHUNK, VP) + j % Q)
        u = tl.where(q == 0, u0, tl.where(q == 1, u1, tl.where(q == 2, u2, u3)))
        return tl.log(-tl.log(u))

    @triton.jit
    def _scale_and_temperature(CFG_SCALE, TEMPERATURE):
        """The CFG scale and the temperature, floored as sampling.py's (set before the prefill: read before a wait)."""
        return tl.load(CFG_SCALE), tl.maximum(tl.load(TEMPERATURE), 1e-5)

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
    def _first_two(LOGITS, NOISE, b, batch, V: tl.constexpr, scale, temperature, lo, hi, seed, pos, image, images,
                   GUIDED: tl.constexpr, SAMPLE: tl.constexpr, MAKE_NOISE: tl.constexpr, VP: tl.constexpr,
                   CHUNK: tl.constexpr, RC: tl.constexpr):
        """The race's first two winners among logits lo..hi-1, (score, index) each, in _next_winner's order, in
        one pass: each lane keeps its best two, so the second is the first's lane's second or another lane's
        best. MAKE_NOISE: log E made here (race_noise, at the counter of image `image` of `images`) and stored to NOISE
        for later passes, else read there."""
        t = tl.arange(0, RC)
        run = tl.full([RC], float("-inf"), tl.float32)
        run2 = tl.full([RC], float("-inf"), tl.float32)
        lane = tl.zeros([RC], tl.int32)
        lane2 = tl.zeros([RC], tl.int32)
        for c in range(lo, hi, RC):
            x = _tempered(LOGITS, b, batch, V, c + t, scale, temperature, GUIDED)
            if SAMPLE:
                if MAKE_NOISE:
                    log_e = race_noise(seed, pos, image, images, c + t, VP, CHUNK)
                    tl.store(NOISE + b * V + c + t, log_e, mask=c + t < V)
                else:
                    log_e = tl.load(NOISE + b * V + c + t, mask=c + t < V, other=0.0)
                x = x - log_e
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
    def _count_above(LOGITS, b, batch, V: tl.constexpr, scale, temperature, x, x2, lo, hi, GUIDED: tl.constexpr,
                     RC: tl.constexpr):
        """How many of image b's logits lo..hi-1 exceed x, and how many exceed x2, a chunk at a time."""
        t = tl.arange(0, RC)
        n = tl.zeros([RC], tl.int32)
        n2 = tl.zeros([RC], tl.int32)
        for c in range(lo, hi, RC):
            v = _tempered(LOGITS, b, batch, V, c + t, scale, temperature, GUIDED)
            n += (v > x).to(tl.int32)
            n2 += (v > x2).to(tl.int32)
        return tl.sum(n, 0), tl.sum(n2, 0)

    @triton.jit
    def _race_kernel(LOGITS, NOISE, CAND_S, CAND_T, POS, SEED, CFG_SCALE, TEMPERATURE, IMAGE, IMAGES, batch,
                     V: tl.constexpr, GUIDED: tl.constexpr, SAMPLE: tl.constexpr, NOISE_READY: tl.constexpr,
                     PER_IMAGE: tl.constexpr, SPLITS: tl.constexpr, SPAN: tl.constexpr, VP: tl.constexpr,
                     CHUNK: tl.constexpr, RC: tl.constexpr, PDL: tl.constexpr):
        """The draw's first kernel: program (b, s) races image b's logits s*SPAN..(s+1)*SPAN-1 (their log E made
        first, unless NOISE_READY) and stores its first two winners, (score, index) each, to CAND_*[b, s].
        PER_IMAGE: image b's own seed, position, settings and counter (image IMAGE[b] of IMAGES[b]) at + b."""
        b = tl.program_id(0)
        s = tl.program_id(1)
        if PER_IMAGE:  # a server's batch: each image keyed by its request (draw_images)
            scale, temperature = _scale_and_temperature(CFG_SCALE + b, TEMPERATURE + b)
            seed = tl.load(SEED + b)
            image, images = tl.load(IMAGE + b), tl.load(IMAGES + b)
        else:
            scale, temperature = _scale_and_temperature(CFG_SCALE, TEMPERATURE)
            seed = tl.load(SEED)  # before the wait too: set before the prefill
            image, images = b, batch
        pdl_wait(PDL)  # the position after it: the prefill sets it right before its draw
        if PER_IMAGE:
            pos = tl.load(POS + b)
        else:
            pos = tl.load(POS)
        top, token, top2, token2 = _first_two(LOGITS, NOISE, b, batch, V, scale, temperature, s * SPAN, s * SPAN + SPAN,
                                              seed, pos, image, images, GUIDED, SAMPLE, SAMPLE and not NOISE_READY, VP,
                                              CHUNK, RC)
        at = (b * SPLITS + s) * 2
        tl.store(CAND_S + at, top)
        tl.store(CAND_S + at + 1, top2)
        tl.store(CAND_T + at, token)
        tl.store(CAND_T + at + 1, token2)

    @triton.jit
    def _draw_kernel(LOGITS, NOISE, CAND_S, CAND_T, TOKEN, OUT, POS, CFG_SCALE, TEMPERATURE, TOPK, COUNT, batch,
                     stride_out, prefix_len, V: tl.constexpr, TOP_K: tl.constexpr, GUIDED: tl.constexpr,
                     SAMPLE: tl.constexpr, ADVANCE: tl.constexpr, PER_IMAGE: tl.constexpr, TRIES: tl.constexpr,
                     SPLITS: tl.constexpr, SPAN: tl.constexpr, VP: tl.constexpr, RC: tl.constexpr, PDL: tl.constexpr):
        """The draw's second kernel: image b's token, from _race_kernel's winners, to TOKEN[b] and OUT[b, POS -
        prefix_len + 1]. Program (b, s) counts the logits s*SPAN..(s+1)*SPAN-1 above the first two winners'; the
        last of image b's SPLITS programs decides. COUNT (int64 zeros, left at zero): [0] the images decided,
        [1 + b] image b's programs done and their two counts in one word (bits 0, 16 and 40). ADVANCE: POS + 1
        to POS, by the last image's. PER_IMAGE: image b's own position, settings and k (TOPK[b], V: none) at + b,
        its filter's counts always run (TOP_K unused), ADVANCE off."""
        b = tl.program_id(0)
        s = tl.program_id(1)
        offs = tl.arange(0, VP)
        ok = offs < V
        FILTER: tl.constexpr = PER_IMAGE or TOP_K > 0
        if PER_IMAGE:
            scale, temperature = _scale_and_temperature(CFG_SCALE + b, TEMPERATURE + b)
            k = tl.load(TOPK + b)
        else:
            scale, temperature = _scale_and_temperature(CFG_SCALE, TEMPERATURE)
            k = TOP_K
        pdl_wait(PDL)
        # The race's winner over all tokens is top-k's if fewer than k logits exceed its own (x_i >= the k-th
        # largest exactly then); else it drops out and the next in (score, -index) order races, TRIES in all.
        # With GPT-XL's merged logits the first winner is in the top 2,000 ~90% of the time (its share of the
        # softmax, random weights): one count instead of the k-th largest's 20-32. The first two winners are the
        # best two of the programs' pairs and are counted at once, spread over the image's programs: with many
        # images some image's first winner is out most steps, and the slowest image sets the draw's time. The
        # further passes read the logits again from cache a chunk at a time, and the tries are unrolled, each under
        # its own branch: a row held in registers beside the k-th largest's spills at sm_90.
        j = tl.arange(0, 2 * SPLITS)
        cand_s = tl.load(CAND_S + b * 2 * SPLITS + j)
        cand_t = tl.load(CAND_T + b * 2 * SPLITS + j)
        best = tl.max(cand_s, 0)
        token = tl.min(tl.where(cand_s == best, cand_t, VP), 0)
        rest = tl.where(cand_t == token, float("-inf"), cand_s)
        best2 = tl.max(rest, 0)
        token2 = tl.min(tl.where((rest == best2) & (cand_t != token), cand_t, VP), 0)
        decides = s == 0
        if FILTER:
            x = _tempered(LOGITS, b, batch, V, token, scale, temperature, GUIDED)
            x2 = _tempered(LOGITS, b, batch, V, token2, scale, temperature, GUIDED)
            n, n2 = _count_above(LOGITS, b, batch, V, scale, temperature, x, x2, s * SPAN, s * SPAN + SPAN, GUIDED, RC)
            mine = 1 + (n.to(tl.int64) << 16) + (n2.to(tl.int64) << 40)
            word = tl.atomic_add(COUNT + 1 + b, mine, sem="relaxed", scope="gpu") + mine
            decides = (word & 0xFFFF) == SPLITS
        if decides:
            if FILTER:
                tl.store(COUNT + 1 + b, 0)
                above = ((word >> 16) & 0xFFFFFF).to(tl.int32)
                if TRIES == 0:
                    pending = tl.full((), 1, tl.int32)
                else:
                    pending = ((above >= k) | (best == float("-inf"))).to(tl.int32)
                    if TRIES >= 2:
                        if pending != 0:
                            best, token = best2, token2
                            pending = (((word >> 40).to(tl.int32) >= k) | (best2 == float("-inf"))).to(tl.int32)
                for _try in tl.static_range(max(TRIES - 2, 0)):  # then one winner per two passes, here
                    if pending != 0:
                        best, token = _next_winner(LOGITS, NOISE, b, batch, V, scale, temperature, float("-inf"),
                                                   best, token, GUIDED, SAMPLE, VP, RC)
                        x = _tempered(LOGITS, b, batch, V, token, scale, temperature, GUIDED)
                        above, _ = _count_above(LOGITS, b, batch, V, scale, temperature, x, x, 0, VP, GUIDED, RC)
                        pending = ((above >= k) | (best == float("-inf"))).to(tl.int32)
                if pending != 0:  # then the race among the logits >= the k-th largest
                    kth = _kth_largest(_tempered(LOGITS, b, batch, V, offs, scale, temperature, GUIDED), ok, k)
                    best, token = _next_winner(LOGITS, NOISE, b, batch, V, scale, temperature, kth, float("inf"), -1,
                                               GUIDED, SAMPLE, VP, RC)
            if PER_IMAGE:  # here: held through the tries it spilled
                pos = tl.load(POS + b)
            else:
                pos = tl.load(POS)
            tl.store(TOKEN + b, token.to(tl.int64))
            tl.store(OUT + b * stride_out + pos - prefix_len + 1, token.to(tl.int64))
            if ADVANCE:  # every image's deciding program has read the position once the count reaches batch
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


def splits(batch, VP, RC):
    """Programs per image of the draw's two kernels: a race chunk each, fewer where the images would take more than
    PROGRAMS (a power of two, at least one)."""
    n = max(1, min(VP // RC, PROGRAMS // batch))
    return 1 << (n.bit_length() - 1)


def draw(logits, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, top_k, guided,
         sample_logits, noise=None, noise_ready=False, count=None, pdl=False):
    """sampling.sample(cfg_merge(logits) if guided else logits, temperature, top_k, race=True) for
    logits (rows, V) of one step at input_pos: the tokens (batch, 1) to `token` and to out[:, input_pos -
    prefix_len + 1]. noise (batch, V) float32: the race's log E, made for this step by race_noise
    (noise_ready), or made here into it (None: a buffer of its own). count: int64 zeros (1 + batch,), left at
    zero; then input_pos is advanced here too, one kernel less per step. Two kernels, with PDL's mode pdl (the plan's:
    EARLY on sm_90+; before its wait each reads only cfg_scale, temperature and the seed, set before the prefill).
    Tensors stay on the device: no sync."""
    batch, V = token.shape[0], logits.shape[-1]
    if noise is None:
        assert not noise_ready
        noise = torch.empty(batch, V, device=logits.device)
    scratch = torch.zeros(1 + batch, dtype=torch.long, device=logits.device) if count is None else count
    k = min(top_k, V) if top_k > 0 else 0
    _launch(logits, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, guided, sample_logits, noise,
            scratch, dict(NOISE_READY=noise_ready, TOP_K=0 if k == V else k, ADVANCE=count is not None,
                          PER_IMAGE=False), (None, None, None), pdl)


def image_k(top_k, V):
    """draw_images' k of an image drawn with top_k (0: none) from V logits: V where nothing is filtered."""
    return min(top_k, V) if top_k > 0 else V


def draw_images(logits, token, out, input_pos, seed, image, images, cfg_scale, temperature, top_k, prefix_len, guided,
                noise, count):
    """draw for a server's batch, each image b keyed by its own request: its seed[b], position input_pos[b],
    cfg_scale[b], temperature[b] and top_k[b] (image_k's), and the race's counter of image image[b] of images[b]
    (its place in its request), so that it draws the tokens draw() gives it in its request's batch alone. Tokens
    (batch, 1) to `token` and to out[b, input_pos[b] - prefix_len + 1]; the positions are not advanced. noise (batch,
    V) float32: scratch for the race's log E; count: int64 zeros (1 + batch,), left at zero. No PDL: the settings are
    read after the wait."""
    _launch(logits, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, guided, True, noise, count,
            dict(NOISE_READY=False, TOP_K=0, ADVANCE=False, PER_IMAGE=True), (image, images, top_k), False)


def _launch(logits, token, out, input_pos, seed, cfg_scale, temperature, prefix_len, guided, sample_logits, noise,
            scratch, flags, per_image, pdl):
    """The draw's two kernels over `batch` images; flags: their constexprs NOISE_READY, TOP_K, ADVANCE, PER_IMAGE;
    per_image: (IMAGE, IMAGES, TOPK), or Nones."""
    batch, V = token.shape[0], logits.shape[-1]
    assert logits.shape[0] == (2 * batch if guided else batch) and logits.is_contiguous()
    assert V < 1 << 23  # the counts' 24 bits in COUNT's words
    assert noise.shape == (batch, V) and noise.is_contiguous()
    assert scratch.dtype == torch.long and scratch.numel() >= 1 + batch
    VP, chunk = layout(V)
    RC = min(VP, RACE_CHUNK)
    n = splits(batch, VP, RC)
    cand_s = torch.empty(batch, n, 2, device=logits.device)
    cand_t = torch.empty(batch, n, 2, dtype=torch.int32, device=logits.device)
    warps, registers = warps_and_registers(VP)
    image, images, top_k = per_image
    common = dict(V=V, GUIDED=guided, SAMPLE=sample_logits, PER_IMAGE=flags["PER_IMAGE"], SPLITS=n, SPAN=VP // n,
                  VP=VP, RC=RC, num_warps=warps, maxnreg=registers, enable_fp_fusion=False, **launch(pdl))
    _race_kernel[(batch, n)](logits, noise, cand_s, cand_t, input_pos, seed, cfg_scale, temperature, image, images,
                             batch, NOISE_READY=flags["NOISE_READY"], CHUNK=chunk, **common)
    _draw_kernel[(batch, n)](logits, noise, cand_s, cand_t, token, out, input_pos, cfg_scale, temperature, top_k,
                             scratch, batch, out.stride(0), prefix_len, TOP_K=flags["TOP_K"], ADVANCE=flags["ADVANCE"],
                             TRIES=TRIES, **common)
