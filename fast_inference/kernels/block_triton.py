"""One transformer block of a one-token step at a few rows (n = 1 under CFG is 2 rows, n = 8 is 16), in four Triton
kernels around the decode attention: the "block" operation's Triton implementation (block_cuda.py is the other;
block.py composes a block from them as the plan says).

A decode step is memory- and launch-bound: the compiled block runs ~15 kernels per layer, and each
kernel boundary costs microseconds of ramp-up and tail. Here the element-wise work rides along with
the projections: RMSNorm in the projection that reads its output, RoPE and the KV-cache write in the
QKV projection, SiLU x up in the gate/up projection, the residual adds in the output and down
projections. Each result is rounded to the activation dtype where the model's op would round it.
The kernels launch with programmatic dependent launch (Hopper+): a kernel starts while the one
before it drains and fetches its weights before waiting for it, so the weight stream does not stop
at kernel boundaries. Two ways to multiply, one set of kernels (the plan picks one per projection, `dot`):
  GEMV (a few rows): a program holds whole rows of the weight (all of K) in registers, loaded before
                    the wait, and multiplies on the CUDA cores, the rows unrolled; with float weights
                    it lets the next kernel launch before its own wait (pdl.FIRST): two kernels ahead load;
  dot (up to 16 rows): a program walks K in chunks on the tensor cores (tl.dot), with nothing to fetch
                    before the wait: the next kernel may launch once the results are computed
                    (pdl.LATE; right after the wait its programs slowed this one); a
                    projection may split K over several programs per tile (split-K), the last of
                    them to finish adding the partial sums in split order (the same bits every run).
int8 weights (quantize.py) load as int8 and become floats in registers; each projection's row scales
apply to its rounded output, as model.int8_linear.
Computes TransformerBlock.forward for S = 1 (tests/test_block.py checks it against it). Past 16 rows the compiled
block borrows the dot path's down projection with its residual add (`down`).
Before its wait a kernel reads what pdl.py allows: weights and earlier cache rows, and on the GEMV
path also the position (the previous step's, from L2: .cg). Under pdl.EARLY (the plan's for int8 weights) the
GEMV path reads the residual there too (wo's is 4 kernels back, w2's 2); under FIRST no kernel before the wait
is known to have finished, so it reads it after the wait, as the dot path does. Given a prefetcher's count
(prefetch_triton.py), each projection's first program counts its start, which paces the prefetcher's pull of the
next projection's weights into L2.
"""
import torch

from fast_inference.kernels import draw_triton
from fast_inference.kernels.pdl import launch

try:
    import triton
    import triton.language as tl

    from fast_inference.kernels.draw_triton import race_noise
    from fast_inference.kernels.pdl import pdl_trigger, pdl_wait
    from fast_inference.kernels.prefetch_triton import bump
except ImportError:
    triton = None

# The tiling tables (docs/PERF_NOTES.md, "Tuning tables' histories": block_triton, with the sweeps behind each).
# GEMV path: rows of W per program (all of K, padded to a power of two, or in PIECES) and warps, per kernel
CONFIG = dict(qkv=(8, 8), wo=(4, 4), gate_up=(4, 4), w2=(4, 4), output=(4, 4))
CONFIG_INT8 = dict(qkv=(4, 4), wo=(4, 4), gate_up=(4, 4), w2=(4, 4), output=(4, 4))
PIECES = ("gate_up",)  # GEMV kernels that hold K in warp-wide pieces rather than padded (n = 1 0.997 -> 0.970, #52)
# dot path: rows of W per program (>= 16; pairs for qkv), K chunk, warps, pipeline stages, and split-K (programs per
# row tile, each a run of K chunks; the last to finish adds the partials)
DOT_CONFIG = dict(qkv=(32, 256, 4, 3, 1), wo=(16, 128, 4, 3, 4), gate_up=(32, 256, 4, 4, 1), w2=(16, 128, 4, 4, 3),
                  output=(64, 128, 8, 4, 1))
DOT_CONFIG_INT8 = dict(DOT_CONFIG, wo=(16, 256, 4, 3, 1), w2=(16, 256, 4, 6, 3), output=(16, 256, 4, 3, 1))
# float tilings of the fused block at a pass's rows (window_block=fused: 2 x L = 32 at n = 1), by rows rounded up to a
# power of two (tools/bench_block.py --rows 32: the block 89.4 -> 79.0 us, PERF_NOTES "at a pass's rows"); other row
# counts, and the compiled block's `down`, take DOT_CONFIG
DOT_CONFIG_ROWS = {32: dict(DOT_CONFIG, qkv=(16, 128, 4, 6, 1), wo=(32, 128, 4, 4, 2), gate_up=(32, 128, 4, 4, 1),
                            w2=(32, 256, 4, 6, 3))}


if triton is not None:

    @triton.jit
    def _rmsnorm(x, rstd, nw):
        """RMSNorm's rounding order: x * rstd in float32, rounded to x's dtype, times the weight nw,
        rounded again. x (RP, k), rstd (RP,) float32, nw broadcastable to x."""
        return ((x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * nw.to(tl.float32)).to(x.dtype)

    @triton.jit
    def _rows(X, offs_r, r_ok, K: tl.constexpr, PW: tl.constexpr):
        """(RP, PW) rows offs_r of X (R, K), zero past K and where not r_ok."""
        offs_k = tl.arange(0, PW)
        k_ok = offs_k < K
        return tl.load(X + offs_r[:, None] * K + offs_k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)

    @triton.jit
    def _normed(x, nw, EPS: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr):
        """Rows x as the projection reads them, in float32: RMS-normalised by the weights nw if NORM."""
        if NORM:
            xf = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(xf * xf, 1) / K + EPS)
            x = _rmsnorm(x, rstd, nw[None, :])
        return x.to(tl.float32)

    @triton.jit
    def _f32(w):
        """Weights as float32. int8 through the float's bits (q + 128 in the low mantissa bits of 2^23,
        then 2^23 + 128 subtracted: exact): an integer xor and a float add at full rate, where the
        int-to-float conversion runs at a quarter of it."""
        if w.dtype.is_int8():
            bits = w.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x4B000080
            return bits.to(tl.float32, bitcast=True) - 8388736.0
        return w.to(tl.float32)

    @triton.jit
    def _matvec(x, w):
        """(RP, BN) float32 = x (RP, PW) @ w (BN, PW).T"""
        return tl.sum(x[:, None, :] * _f32(w)[None, :, :], 2)

    @triton.jit
    def _matvec_rows(X, nw, w, R, EPS: tl.constexpr, K: tl.constexpr, PW: tl.constexpr, RP: tl.constexpr,
                     NORM: tl.constexpr, AHEAD: tl.constexpr):
        """_matvec of [RMSNorm](X), one row of X at a time, against w as it was loaded. AHEAD: every row loaded before
        the first is reduced (the reductions' barriers keep a later load behind them: an L2 round trip per row)."""
        xs = ()
        if AHEAD:
            for r in tl.static_range(RP):
                row = r + tl.arange(0, 1)
                xs = xs + (_rows(X, row, row < R, K, PW),)  # (1, PW) each
        offs_r = tl.arange(0, RP)[:, None]
        y = tl.zeros([RP, w.shape[0]], tl.float32)
        for r in tl.static_range(RP):
            if AHEAD:
                x = xs[r]
            else:
                row = r + tl.arange(0, 1)
                x = _rows(X, row, row < R, K, PW)
            y = tl.where(offs_r == r, tl.sum(_normed(x, nw, EPS, K, NORM) * _f32(w), 1)[None, :], y)
        return y

    @triton.jit
    def _pieces(W, rows, rows_ok, K: tl.constexpr, PW: tl.constexpr):
        """W[rows] as a tuple of (len(rows), PW) tiles, K in PW-wide pieces (the last zero past K; PW >= K: one)."""
        offs = tl.arange(0, PW)[None, :]
        tiles = ()
        for k0 in tl.static_range(0, K, PW):
            ok = rows_ok[:, None]
            if k0 + PW > K:
                ok = ok & (k0 + offs < K)
            tiles = tiles + (tl.load(W + rows[:, None] * K + k0 + offs, mask=ok, other=0.0),)
        return tiles

    @triton.jit
    def _piece(X, k0, ok, K: tl.constexpr, PW: tl.constexpr):
        """X[k0:k0 + PW] for each row of ok (BN, 1), zero where not ok or past K: every row of the tile reads the same
        vector, so that it loads in the weight tiles' layout rather than being converted to it."""
        offs = k0 + tl.arange(0, PW)[None, :]
        if k0 + PW > K:
            ok = ok & (offs < K)
        return tl.load(X + offs, mask=ok, other=0.0)

    @triton.jit
    def _row_times(X, NW, ws_a, ws_b, ok, EPS: tl.constexpr, K: tl.constexpr, PW: tl.constexpr, NORM: tl.constexpr,
                   PAIR: tl.constexpr):
        """[RMSNorm](X[:K]) @ the tiles' rows, (BN,) each: multiplied and added piece by piece, then summed over K
        once, within each warp. With NORM, X is read twice (the second time from L1), so that no piece need be held
        from the statistics to the product."""
        rstd = tl.full([1], 1.0, tl.float32)
        if NORM:
            x = _piece(X, 0, ok, K, PW).to(tl.float32)
            squares = x * x
            for k0 in tl.static_range(PW, K, PW):
                x = _piece(X, k0, ok, K, PW).to(tl.float32)
                squares += x * x
            rstd = tl.rsqrt(tl.sum(squares, 1) / K + EPS)
        acc_a = tl.zeros(ws_a[0].shape, tl.float32)
        acc_b = acc_a
        for j in tl.static_range(len(ws_a)):
            x = _piece(X, j * PW, ok, K, PW)
            if NORM:
                x = _rmsnorm(x, rstd, _piece(NW, j * PW, ok, K, PW))
            x = x.to(tl.float32)
            acc_a += x * _f32(ws_a[j])
            if PAIR:
                acc_b += x * _f32(ws_b[j])
        return tl.sum(acc_a, 1), tl.sum(acc_b, 1)

    @triton.jit
    def _times_pieces(X, NW, w_a, w_b, rows_a, R, EPS: tl.constexpr, K: tl.constexpr, PW: tl.constexpr,
                      RP: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr):
        """_gemv's products with K in PW-wide pieces, PW one warp's span of 16-byte loads: no padded lanes to hold and
        multiply (GPT-XL's K = 1,280 was padded to 2,048), a warp per weight row (Triton lays a (rows, 256) bf16 tile out
        so), so the sum over K needs no shared memory, and no tile converted to another layout after the wait. Each warp
        reads the whole of each row of X, in the tiles' layout, which costs registers: gate/up at 2 rows 167 against
        127 padded (sm_90, Triton 3.6: 3 programs per SM instead of 4), qkv 176 against 116 (8 warps: 1 instead of
        2)."""
        sums = ()
        for r in tl.static_range(RP):  # every row's sums before any is laid out as (RP, BN): the rows overlap
            sums = sums + (_row_times(X + r * K, NW, w_a, w_b, (0 * rows_a + r < R)[:, None], EPS, K, PW, NORM, PAIR),)
        offs_r = tl.arange(0, RP)[:, None]
        a = tl.zeros([RP, rows_a.shape[0]], tl.float32)
        b = a
        for r in tl.static_range(RP):
            a = tl.where(offs_r == r, sums[r][0][None, :], a)
            b = tl.where(offs_r == r, sums[r][1][None, :], b)
        return a, b

    @triton.jit
    def _gemv(X, NW, W, rows_a, rows_b, rows_ok, R, E, e_at, e_ok, EPS: tl.constexpr, K: tl.constexpr,
              PW: tl.constexpr, RP: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr, PDL: tl.constexpr,
              READ_E: tl.constexpr):
        """[RMSNorm](X) @ W[rows_a].T (and @ W[rows_b].T if PAIR) on the CUDA cores, the weight rows
        loaded whole before the wait; and E[e_at] where e_ok (zero elsewhere), in float32: the kernel's other input
        (the residual), read before the wait (READ_E == 1), right after it with every row of X (2: their L2 round
        trips overlap rather than follow each other and the products) or not at all (0). One tile (wo, w2, the
        head) multiplies a row of X at a time: the (RP, BN, PW) product needs the tile in another layout, converted
        through shared memory after the wait. A pair (qkv, and gate/up when padded) keeps the product: row by row its
        two tiles took 168-217 registers, fewer programs resident to load ahead. H200, scripts/engine_ab.py
        --process-per-setting, n = 1 ms/step: all as the product 1.012-1.018, all row by row 1.071, one tile row by
        row 1.001. PW < K: K in pieces instead (_times_pieces); else a row is one PW-wide tile, padded."""
        w_a = _pieces(W, rows_a, rows_ok, K, PW)
        w_b = w_a
        if PAIR:
            w_b = _pieces(W, rows_b, rows_ok, K, PW)
        offs_k = tl.arange(0, PW)
        nw = tl.zeros([PW], NW.dtype.element_ty)
        if NORM and PW >= K:  # a weight too (in pieces, read after the wait)
            nw = tl.load(NW + offs_k, mask=offs_k < K, other=0.0)
        e = tl.zeros(e_at.shape, tl.float32)
        if READ_E == 1:
            e = tl.load(E + e_at, mask=e_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        pdl_wait(PDL)
        if READ_E == 2:
            e = tl.load(E + e_at, mask=e_ok, other=0.0).to(tl.float32)
        if PW < K:
            a, b = _times_pieces(X, NW, w_a, w_b, rows_a, R, EPS, K, PW, RP, NORM, PAIR)
        elif PAIR:
            offs_r = tl.arange(0, RP)
            x = _normed(_rows(X, offs_r, offs_r < R, K, PW), nw, EPS, K, NORM)
            a = _matvec(x, w_a[0])
            b = _matvec(x, w_b[0])
        else:
            a = _matvec_rows(X, nw, w_a[0], R, EPS, K, PW, RP, NORM, READ_E == 2)
            b = a
        return a, b, e

    @triton.jit
    def _dots(X, NW, W, rows_a, rows_b, rows_ok, R, EPS: tl.constexpr, K: tl.constexpr, RP: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, PAIR: tl.constexpr, PDL: tl.constexpr,
              PREC: tl.constexpr, SPLIT: tl.constexpr):
        """The same on the tensor cores, K in BK chunks; RMSNorm's statistics in a first pass over X.
        With SPLIT > 1, program (i, s) sums only the s-th of SPLIT runs of chunks."""
        pdl_wait(PDL)
        KS: tl.constexpr = (K + BK * SPLIT - 1) // (BK * SPLIT) * BK  # K per split, whole chunks
        k_lo = tl.program_id(1) * KS
        offs_r = tl.arange(0, RP)
        offs_k = tl.arange(0, BK)
        r_ok = offs_r < R
        xs = X + offs_r[:, None] * K + offs_k[None, :]
        rstd = tl.zeros([RP], tl.float32)
        # RMSNorm's statistics unrolled, summed across threads once: every chunk's load in flight at once, and the
        # weights' first chunks (the pipeline's prologue) issued ahead of them. As a loop, each trip waited for its load
        # and its cross-thread sum, and the prologue for the whole loop.
        if NORM:
            squares = tl.zeros([RP, BK], tl.float32)
            for k0 in tl.static_range(0, K, BK):
                xf = tl.load(xs + k0, mask=r_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0).to(tl.float32)
                squares += xf * xf
            rstd = tl.rsqrt(tl.sum(squares, 1) / K + EPS)
        a = tl.zeros([RP, BN], tl.float32)
        b = tl.zeros([RP, BN], tl.float32)
        for k0 in range(k_lo, tl.minimum(k_lo + KS, K), BK):
            k_ok = k0 + offs_k < K
            x = tl.load(xs + k0, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            if NORM:
                x = _rmsnorm(x, rstd, tl.load(NW + k0 + offs_k, mask=k_ok, other=0.0)[None, :])
            w_ok = rows_ok[:, None] & k_ok[None, :]
            w = tl.load(W + rows_a[:, None] * K + (k0 + offs_k)[None, :], mask=w_ok, other=0.0)
            a = tl.dot(x, tl.trans(w.to(x.dtype)), a, input_precision=PREC)  # int8 weights are exact in x.dtype
            if PAIR:
                w = tl.load(W + rows_b[:, None] * K + (k0 + offs_k)[None, :], mask=w_ok, other=0.0)
                b = tl.dot(x, tl.trans(w.to(x.dtype)), b, input_precision=PREC)
        return a, b

    @triton.jit
    def _split_sum(PART, COUNT, a, b, RP: tl.constexpr, BN: tl.constexpr, PAIR: tl.constexpr, SPLIT: tl.constexpr):
        """Split-K: every program of tile i stores its partial sums; the last to finish (by an acq_rel count
        that it leaves at zero for the next call) adds all of them in split order, so the sum does not
        depend on which finishes last. Returns the sums (zeros elsewhere) and whether this one holds them."""
        tile = tl.program_id(0)
        offs = tl.arange(0, RP)[:, None] * BN + tl.arange(0, BN)[None, :]
        part = PART + tile * SPLIT * 2 * RP * BN + offs
        s = tl.program_id(1)
        tl.store(part + s * 2 * RP * BN, a)
        if PAIR:
            tl.store(part + s * 2 * RP * BN + RP * BN, b)
        tl.debug_barrier()  # every thread's partial is stored before the count releases them
        last = tl.atomic_add(COUNT + tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        tl.store(COUNT + tile, 0, mask=last)
        a = tl.zeros([RP, BN], tl.float32)
        b = tl.zeros([RP, BN], tl.float32)
        mine = offs < tl.where(last, RP * BN, 0)  # a tile mask (Triton's interpreter takes no scalar one)
        for j in range(SPLIT):  # from L2 (.cg): other SMs wrote them
            a += tl.load(part + j * 2 * RP * BN, mask=mine, other=0.0, cache_modifier=".cg")
            if PAIR:
                b += tl.load(part + j * 2 * RP * BN + RP * BN, mask=mine, other=0.0, cache_modifier=".cg")
        return a, b, last

    @triton.jit
    def _project(X, NW, W, S, PART, COUNT, rows_a, rows_b, rows_ok, R, E, e_at, e_ok, EPS: tl.constexpr,
                 K: tl.constexpr, PW: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 NORM: tl.constexpr, PAIR: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, PREC: tl.constexpr,
                 SPLIT: tl.constexpr, QUANT: tl.constexpr, READ_E: tl.constexpr, dt: tl.constexpr):
        """[RMSNorm](X) @ W[rows_a].T and, if PAIR, @ W[rows_b].T: (RP, BN) each, rounded to dt as the
        model's linear outputs are, returned in float32; the rows this program stores: R, or 0 where
        another program of its tile does (split-K: the last of them); and on the GEMV path E[e_at] where e_ok unless
        READ_E is 0 (float32, zeros elsewhere), read where _gemv says; zeros on the dot path, whose callers read it
        after the products. QUANT: W is int8 and the rounded products are scaled by S[row] and
        rounded again (model.int8_linear)."""
        s_a = tl.zeros([BN], tl.float32)
        s_b = s_a
        if QUANT:  # weights too: loaded before the wait
            s_a = tl.load(S + rows_a, mask=rows_ok, other=0.0).to(tl.float32)
            if PAIR:
                s_b = tl.load(S + rows_b, mask=rows_ok, other=0.0).to(tl.float32)
        live = R
        if DOT:
            a, b = _dots(X, NW, W, rows_a, rows_b, rows_ok, R, EPS, K, RP, BN, BK, NORM, PAIR, PDL, PREC, SPLIT)
            if SPLIT > 1:
                a, b, last = _split_sum(PART, COUNT, a, b, RP, BN, PAIR, SPLIT)
                live = tl.where(last, R, 0)
            e = tl.zeros(e_at.shape, tl.float32)
        else:
            a, b, e = _gemv(X, NW, W, rows_a, rows_b, rows_ok, R, E, e_at, e_ok, EPS, K, PW, RP, NORM, PAIR, PDL,
                            READ_E)
        pdl_trigger(PDL)
        a, b = a.to(dt).to(tl.float32), b.to(dt).to(tl.float32)
        if QUANT:
            a, b = (a * s_a[None, :]).to(dt).to(tl.float32), (b * s_b[None, :]).to(dt).to(tl.float32)
        return a, b, live, e

    @triton.jit
    def _linear_kernel(X, W, S, RES, ADD, OUT, PART, COUNT, PROGRESS, R, N, K: tl.constexpr, PW: tl.constexpr,
                       RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr,
                       PREC: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr, THEN: tl.constexpr,
                       BUMP: tl.constexpr):
        """OUT = RES + X @ W.T for X (R, K), W (N, K): the output and down projections; with THEN, + ADD (R, N)
        after that, rounded again (the next block's control rows, as the model adds them)."""
        bump(PROGRESS, BUMP)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rows_ok = rows < N
        dt = OUT.dtype.element_ty
        offs_r = tl.arange(0, RP)
        at = offs_r[:, None] * N + rows[None, :]
        r_ok = (offs_r < R)[:, None] & rows_ok[None, :]
        add = tl.zeros([RP, BN], tl.float32)
        # GEMV: the residual read by _gemv before the wait under EARLY (the kernel just before never writes it:
        # linear()); under FIRST at 4 rows right after it, with every row of X, at 2 after the products (PERF_NOTES
        # #90: n = 2 -1.4%, n = 1 +0.3%); the control rows before the wait under EARLY, else after the products
        READ_E: tl.constexpr = (2 if RP > 2 else 0) if PDL == 3 else 1
        if THEN and not DOT and PDL != 3:
            add = tl.load(ADD + at, mask=r_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        y, _, live, res = _project(X, X, W, S, PART, COUNT, rows, rows, rows_ok, R, RES, at, r_ok, 0.0, K, PW, RP, BN,
                                   BK, False, False, DOT, PDL, PREC, SPLIT, QUANT, READ_E, dt)
        ok = (offs_r < live)[:, None] & rows_ok[None, :]
        if DOT or READ_E == 0:  # after the products (the dot path: ahead of the wait, n = 4 and 8 ran ~1.3% slower)
            res = tl.load(RES + at, mask=ok, other=0.0).to(tl.float32)
        if THEN and (DOT or PDL == 3):
            add = tl.load(ADD + at, mask=ok, other=0.0).to(tl.float32)
        out = (y + res).to(dt)
        if THEN:
            out = (out.to(tl.float32) + add).to(dt)
        tl.store(OUT + at, out, mask=ok)

    @triton.jit
    def _head_kernel(X, NW, W, S, OUT, NOISE, POS, SEED, PART, COUNT, PROGRESS, R, N, EPS: tl.constexpr,
                     K: tl.constexpr, PW: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     DOT: tl.constexpr, PDL: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr,
                     QUANT: tl.constexpr, IMAGES: tl.constexpr, IP: tl.constexpr, VP: tl.constexpr,
                     CHUNK: tl.constexpr, BUMP: tl.constexpr):
        """OUT = RMSNorm(X) @ W.T, the logits; with IMAGES > 0 also the draw's race noise of these tokens for
        images 0..IMAGES-1 to NOISE (IMAGES, N) (draw_triton.race_noise): made before the wait from the
        seed and the position, which no kernel of the step writes, and stored after it."""
        bump(PROGRESS, BUMP)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rows_ok = rows < N
        dt = OUT.dtype.element_ty
        img = tl.arange(0, IP)[:, None]
        if IMAGES > 0:
            log_e = race_noise(tl.load(SEED), tl.load(POS, cache_modifier=".cg"), img, IMAGES, rows[None, :], VP,
                               CHUNK)
        y, _, live, _ = _project(X, NW, W, S, PART, COUNT, rows, rows, rows_ok, R, X, rows, rows_ok, EPS, K, PW, RP,
                                 BN, BK, True, False, DOT, PDL, PREC, SPLIT, QUANT, 0, dt)
        offs_r = tl.arange(0, RP)
        tl.store(OUT + offs_r[:, None] * N + rows[None, :], y.to(dt), mask=(offs_r < live)[:, None] & rows_ok[None, :])
        if IMAGES > 0:  # (a tile mask: the interpreter takes no scalar one)
            mine = (img < tl.where(live > 0, IMAGES, 0)) & rows_ok[None, :]
            tl.store(NOISE + img * N + rows[None, :], log_e, mask=mine)

    @triton.jit
    def _qkv_kernel(X, NW, W, S, FREQS, POS, Q, KC, VC, PART, COUNT, PROGRESS, R, stride_cr, stride_ch, stride_cn,
                    EPS: tl.constexpr, D: tl.constexpr, PW: tl.constexpr, HD: tl.constexpr, RP: tl.constexpr,
                    BP: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr, PDL: tl.constexpr, PREC: tl.constexpr,
                    SPLIT: tl.constexpr, QUANT: tl.constexpr, BUMP: tl.constexpr, WINDOW: tl.constexpr):
        """RMSNorm(X) @ Wqkv.T, RoPE on q and k, q to Q (R, D), k and v into the caches at POS.

        A program owns BP adjacent (even, odd) column pairs of one head, so the rotation is local. WINDOW > 0: rows at
        their own positions, WINDOW queries per cache row: row r is query r % WINDOW of cache row r // WINDOW, at
        position POS[r] with its own RoPE row FREQS[r]."""
        bump(PROGRESS, BUMP)
        first = tl.program_id(0) * BP * 2  # first column: BP pairs never straddle a head (HD / 2 % BP == 0)
        section, h = first // D, first % D // HD  # section 0, 1, 2: q, k, v
        col = first + 2 * tl.arange(0, BP)
        all_ok = col >= 0
        dt = Q.dtype.element_ty
        d = col % HD
        if not DOT and WINDOW == 0:  # GEMV: before the wait (the previous step wrote it)
            pos = tl.load(POS, cache_modifier=".cg")
        ye, yo, live, _ = _project(X, NW, W, S, PART, COUNT, col, col + 1, all_ok, R, X, col, all_ok, EPS, D, PW, RP,
                                   BP, BK, True, True, DOT, PDL, PREC, SPLIT, QUANT, 0, dt)
        offs_r = tl.arange(0, RP)
        r_ok = offs_r < live
        cache_r = offs_r[:, None]
        if WINDOW > 0:  # each row's own position (after the wait: the step's inputs wrote them)
            pos = tl.load(POS + offs_r, mask=r_ok, other=0)[:, None]
            cache_r = cache_r // WINDOW
        elif DOT:  # after it: ahead of the wait, n = 8 ran 0.3-0.6% slower
            pos = tl.load(POS)
        if section < 2:  # rotate pair j = d / 2 by this position's (cos, sin), in float32 as the model
            if WINDOW > 0:
                f = offs_r[:, None] * HD + d[None, :]  # row r's RoPE row: HD / 2 pairs of (cos, sin)
                c = tl.load(FREQS + f, mask=r_ok[:, None], other=0.0)
                s = tl.load(FREQS + f + 1, mask=r_ok[:, None], other=0.0)
            else:
                c = tl.load(FREQS + d)[None, :]
                s = tl.load(FREQS + d + 1)[None, :]
            ye, yo = ye * c - yo * s, yo * c + ye * s
        ok = r_ok[:, None] & all_ok[None, :]
        if section == 0:
            q = Q + offs_r[:, None] * D + h * HD + d[None, :]
            tl.store(q, ye.to(dt), mask=ok)
            tl.store(q + 1, yo.to(dt), mask=ok)
        else:
            at = cache_r * stride_cr + h * stride_ch + pos * stride_cn + d[None, :]
            if section == 1:
                tl.store(KC + at, ye.to(dt), mask=ok)
                tl.store(KC + at + 1, yo.to(dt), mask=ok)
            else:
                tl.store(VC + at, ye.to(dt), mask=ok)
                tl.store(VC + at + 1, yo.to(dt), mask=ok)

    @triton.jit
    def _gate_up_kernel(X, NW, W, S, OUT, PART, COUNT, PROGRESS, R, F, EPS: tl.constexpr, K: tl.constexpr,
                        PW: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                        PDL: tl.constexpr, PREC: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr,
                        BUMP: tl.constexpr):
        """OUT = SiLU(g) * u where [g | u] = RMSNorm(X) @ W13.T, W13 (2F, K) = [w1; w3]."""
        bump(PROGRESS, BUMP)
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rows_ok = rows < F
        dt = OUT.dtype.element_ty
        g, u, live, _ = _project(X, NW, W, S, PART, COUNT, rows, rows + F, rows_ok, R, X, rows, rows_ok, EPS, K, PW, RP,
                                 BN, BK, True, True, DOT, PDL, PREC, SPLIT, QUANT, 0, dt)
        silu = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        offs_r = tl.arange(0, RP)
        ok = (offs_r < live)[:, None] & rows_ok[None, :]
        tl.store(OUT + offs_r[:, None] * F + rows[None, :], (silu * u).to(dt), mask=ok)


def piece_width(name, weight):
    """GEMV path: the width of the K pieces in which kernel `name` holds its weight rows: for those in PIECES one
    warp's span of 16-byte loads (256 bf16 weights), halved while it does not divide K (GPT-XL's 1,280 and 3,584 are
    whole 256-wide pieces); otherwise, and at most, K padded to a power of two (one piece)."""
    K, whole = weight.shape[1], triton.next_power_of_2(weight.shape[1])
    if name not in PIECES:
        return whole
    width = min(32 * 16 // weight.element_size(), whole)
    while K % width and width > 32:
        width //= 2
    return width


def rows_per_program(rows, warps, tiles, weight, width):
    """GEMV path: `rows`, capped so a program's weight tiles (K in pieces of `width`) stay at <= 128 elements per
    thread (256 for int8, packed four to a register): GPT-XL's swept tilings sit at that cap; more spills, which
    wider models (GPT-7B's K = 11,008) would hit at the same setting. A power of two."""
    per_thread = 256 if weight.dtype == torch.int8 else 128
    cap = max(1, per_thread * 32 * warps // (tiles * triton.cdiv(weight.shape[1], width) * width))
    return min(rows, 1 << (cap.bit_length() - 1))


def tiling(name, x, weight, tiles, pdl, dot, progress=None, by_rows=True):
    """(weight rows per program, kernel arguments) of kernel `name` for x (R, K) and weight (N, K) on the GEMV path,
    or the dot path if dot (the plan's choice); `tiles` weight tiles (rows_a, rows_b) per program; pdl the launch mode.
    progress: an int32 count the kernel's first program adds one to as it starts (prefetch_triton.py), or None.
    by_rows: float tilings from DOT_CONFIG_ROWS where it has the rows."""
    (R, K), p2 = x.shape, triton.next_power_of_2
    kw = dict(PREC="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 (tests): exact dots
              PROGRESS=x if progress is None else progress, BUMP=progress is not None, **launch(pdl))
    if not dot:
        rows, warps = (CONFIG_INT8 if weight.dtype == torch.int8 else CONFIG)[name]
        width = piece_width(name, weight)
        return rows_per_program(rows, warps, tiles, weight, width), dict(kw, DOT=False, RP=max(2, p2(R)), PW=width,
                                                                    BK=16, SPLIT=1, num_warps=warps)
    table = DOT_CONFIG_INT8 if weight.dtype == torch.int8 else DOT_CONFIG_ROWS.get(p2(R), DOT_CONFIG) if by_rows \
        else DOT_CONFIG
    rows, bk, warps, stages, split = table[name]
    if x.element_size() > 2:  # float32 (tests): a quarter of the chunk, an eighth in the pair kernels, or they spill
        bk = max(16, bk // (4 * tiles))
    if tiles == 2 and R > 16:  # the pair kernels at a pass's rows (plan.pass_rows): half the chunk (256 at 32 rows
        bk = max(16, bk // 2)  # spilled 16 B in qkv and gate/up)
    return rows, dict(kw, DOT=True, RP=max(16, p2(R)), PW=16, BK=bk, num_warps=warps, num_stages=stages,
                      SPLIT=min(split, triton.cdiv(K, bk)))


def fits(head_dim, dot):
    """The kernels take heads of a power-of-two size, and on the dot path of >= 32 (16 pairs per dot)."""
    return head_dim & (head_dim - 1) == 0 and (not dot or head_dim >= 32)


_counts = {}  # per device: split-K tile counts, zero between kernels (the last program of a tile re-zeroes its own)


def tile_counts(device, tiles=4096):
    """Split-K's tile counts on device, made on first use: a first (warm-up) call of the fused block, before any
    graph capture, or the engine before it compiles a block that calls down() (a tensor made while tracing
    would not persist)."""
    counts = _counts.get(device)
    if counts is None or counts.numel() < tiles:
        counts = _counts[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counts


def split_buffers(x, tiles, kw, bn):
    """The launch grid (tiles, splits) and split-K's partial sums and tile counts (x itself, unused,
    where the kernel does not split)."""
    split = kw["SPLIT"]
    if split == 1:
        return (tiles, 1), x, x
    counts = tile_counts(x.device, tiles)
    return (tiles, split), torch.empty(tiles * split * 2 * kw["RP"] * bn, device=x.device), counts


def row_scales(linear):
    """The row scales of an int8 projection (model.Int8Linear), None for a float one."""
    return getattr(linear, "scales", None)


def _or(t, x):
    return x if t is None else t  # a kernel's unused pointer argument


def linear(x, weight, scales=None, residual=None, name="wo", pdl=False, dot=False, progress=None, then=None,
           by_rows=True):
    """residual + x @ weight.T for x (R, K) contiguous, with kernel `name`'s tiling (the dot path if dot); an int8
    weight with its row scales (quantize.py) as model.int8_linear; then + `then` (R, N) if given, rounded
    again. With pdl.EARLY, `residual` and `then` must not be written by the kernel just before (the GEMV path
    reads them before its wait then; in the block the residual is wo's input, 4 kernels back, or w2's, 2 back, and
    `then` the step's control rows); under FIRST and LATE it reads them after its wait."""
    R, K = x.shape
    N = weight.shape[0]
    bn, kw = tiling(name, x, weight, 1, pdl, dot, progress, by_rows)
    grid, part, counts = split_buffers(x, triton.cdiv(N, bn), kw, bn)
    out = torch.empty(R, N, device=x.device, dtype=x.dtype)
    _linear_kernel[grid](x, weight, _or(scales, x), residual, _or(then, x), out, part, counts, R=R, N=N, K=K, BN=bn,
                         QUANT=scales is not None, THEN=then is not None, **kw)
    return out


def qkv_rope(x, norm, weight, scales, freqs, input_pos, k_cache, v_cache, n_head, pdl=False, dot=False,
             progress=None, window=0):
    """q (R, H, 1, hd); k and v written into the caches at input_pos. window > 0: rows at their own positions,
    input_pos (R,) and freqs (R, hd/2, 2) a row's own, `window` rows per cache row (row r in cache row r // window)."""
    R, D = x.shape
    hd = D // n_head
    pairs, kw = tiling("qkv", x, weight, 2, pdl, dot, progress)  # each pair is two weight rows
    bp = min(pairs, hd // 2)  # a divisor of hd / 2 (both powers of two)
    grid, part, counts = split_buffers(x, 3 * D // (2 * bp), kw, bp)
    q = torch.empty(R, n_head, 1, hd, device=x.device, dtype=x.dtype)
    _qkv_kernel[grid](
        x, norm.weight, weight, _or(scales, x), freqs, input_pos, q, k_cache, v_cache, part, counts, R=R,
        stride_cr=k_cache.stride(0), stride_ch=k_cache.stride(1), stride_cn=k_cache.stride(2), EPS=norm.eps, D=D,
        HD=hd, BP=bp, QUANT=scales is not None, WINDOW=window, **kw)
    return q


def gate_up(x, norm, w13, scales=None, pdl=False, dot=False, progress=None):
    """SiLU(g) * u for [g | u] = RMSNorm(x) @ w13.T."""
    R, K = x.shape
    F = w13.shape[0] // 2
    bn, kw = tiling("gate_up", x, w13, 2, pdl, dot, progress)  # gate and up rows
    grid, part, counts = split_buffers(x, triton.cdiv(F, bn), kw, bn)
    out = torch.empty(R, F, device=x.device, dtype=x.dtype)
    _gate_up_kernel[grid](x, norm.weight, w13, _or(scales, x), out, part, counts, R=R, F=F, EPS=norm.eps, K=K, BN=bn,
                          QUANT=scales is not None, **kw)
    return out


def down(a, w2, h, progress=None, pdl=0):
    """h + w2(a) for a (R, 1, F) and h (R, 1, D): the dot path's down projection with the residual add, as
    TransformerBlock.forward's `down` (the compiled block's, past the fused rows), through down_op, which inductor
    calls as it is; launched in PDL mode pdl (inductor's own launcher takes none: #47); counted for a prefetcher
    (progress) as it starts."""
    R, _, D = h.shape
    count = progress is not None
    if not count:  # the op mutates it: a scratch count rather than an input
        progress = torch.empty(1, dtype=torch.int32, device=h.device)
    return down_op(a.view(R, -1), w2.weight, h.view(R, D), progress, count, int(pdl)).view(R, 1, D)


@torch.library.custom_op("fast_inference::down", mutates_args=("progress",))
def down_op(a: torch.Tensor, weight: torch.Tensor, h: torch.Tensor, progress: torch.Tensor, count: bool,
            pdl: int) -> torch.Tensor:
    return linear(a, weight, residual=h, name="w2", pdl=pdl, dot=True, progress=progress if count else None,
                  by_rows=False)  # as measured for the plain steps (#41)


@down_op.register_fake
def _(a, weight, h, progress, count, pdl):
    return h.new_empty(h.shape)


def logits(model, h, noise=None, pdl=0, dot=True):
    """model.logits(h) for h (R, 1, D), the final RMSNorm fused into the output projection, in the
    weights' dtype: model.logits' float32 cast is left to the reader (the fused draw reads them so).
    noise = (buffer (images, V) float32, input_pos, seed): also the race noise of the step's draw at
    input_pos into the buffer (draw_triton.draw's `noise`)."""
    R, _, D = h.shape
    x, weight, scales = h.view(R, D), model.output.weight, row_scales(model.output)
    N = weight.shape[0]
    bn, kw = tiling("output", x, weight, 1, pdl, dot)
    grid, part, counts = split_buffers(x, triton.cdiv(N, bn), kw, bn)
    out = torch.empty(R, N, device=x.device, dtype=x.dtype)
    buf, pos, seed = (out, x, x) if noise is None else noise  # unused pointers without noise
    images = 0 if noise is None else buf.shape[0]
    VP, chunk = draw_triton.layout(N)
    _head_kernel[grid](x, model.norm.weight, weight, _or(scales, x), out, buf, pos, seed, part, counts, R=R, N=N,
                       EPS=model.norm.eps, K=D, BN=bn, QUANT=scales is not None, IMAGES=images,
                       IP=triton.next_power_of_2(max(images, 1)), VP=VP, CHUNK=chunk, **kw)
    return out.view(R, 1, -1)
