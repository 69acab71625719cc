"""One transformer block of a one-token step at up to 16 rows (n = 1 under CFG is 2 rows, n = 8 is
16), in four Triton kernels plus the split-KV decode attention.

A decode step is memory- and launch-bound: the compiled block runs ~15 kernels per layer, and each
kernel boundary costs microseconds of ramp-up and tail. Here the element-wise work rides along with
the projections: RMSNorm in the projection that reads its output, RoPE and the KV-cache write in the
QKV projection, SiLU x up in the gate/up projection, the residual adds in the output and down
projections. Each result is rounded to the activation dtype where the model's op would round it.
The kernels launch with programmatic dependent launch (Hopper+): a kernel starts while the one
before it drains and fetches its weights before waiting for it, so the weight stream does not stop
at kernel boundaries. Two ways to multiply, one set of kernels:
  <= 4 rows (GEMV): a program holds whole rows of the weight (all of K) in registers, loaded before
                    the wait, and multiplies on the CUDA cores, the rows unrolled; with float weights
                    it lets the next kernel launch before its own wait (pdl.FIRST): two kernels ahead load;
  5..16 rows (dot): a program walks K in chunks on the tensor cores (tl.dot), with nothing to fetch
                    before the wait: the next kernel may launch once the results are computed
                    (pdl.LATE; right after the wait its programs slowed this one); a
                    projection may split K over several programs per tile (split-K), the last of
                    them to finish adding the partial sums in split order (the same bits every run).
int8 weights (quantize.py) load as int8 and become floats in registers; each projection's row scales
apply to its rounded output, as model.int8_linear.
Computes TransformerBlock.forward for S = 1 (tests/test_decode_block.py checks it against it). Past 16 rows, up to
64, the compiled block borrows the dot path's down projection with its residual add (`down`).
Before its wait a kernel reads what pdl.py allows: weights and earlier cache rows, and on the GEMV
path also the position (the previous step's, from L2: .cg). Under pdl.EARLY (int8 weights, GEMV_PDL_INT8) the
GEMV path reads the residual there too (wo's is 4 kernels back, w2's 2); under FIRST no kernel before the wait
is known to have finished, so it reads it after the wait, as the dot path does. Given a prefetcher (prefetch.py),
each projection's first program counts its start, which paces the prefetcher's pull of the next projection's
weights into L2.
"""
import functools

import torch

from fast_inference import decode_sampling, smem_gemv
from fast_inference.pdl import EARLY, FIRST, LATE, launch, use_pdl

try:
    import triton
    import triton.language as tl

    from fast_inference.decode_sampling import race_noise
    from fast_inference.pdl import pdl_trigger, pdl_wait
    from fast_inference.prefetch import bump
except ImportError:
    triton = None

GEMV_ROWS = 4  # up to here rows are unrolled in registers (GEMV); more run tensor-core dots
MAX_ROWS = 16  # more rows run the compiled block (faster there from 32 rows: docs/PERF_NOTES.md)
# ... whose down projection and residual add run as the dot path's w2 kernel up to here (`down`): at 64 rows (n = 32)
# cuBLAS's split-K GEMM, its reduce kernel and inductor's add took 9.8 us per layer (H200, position 700); in the
# model 3.09 -> 3.05 ms/step. The dot path's gate/up and wo lost there (3.43 and 3.06 ms/step), and w2 at 128 rows
# (n = 64: 5.30 against 5.10 ms/step).
DOWN_ROWS = 64
# GEMV path: rows of W per program (all of K, padded to a power of two) and warps, per kernel.
# scripts/bench_decode_block.py on the H200 (GPT-XL, 2 rows, position 700, with PDL): 29.3 us per
# block vs 32.2 for (4, 4) everywhere with w2 at (2, 4), and 41.9 for the compiled block; the other
# tilings within 1 us of these.
# The head's float weights take the dot path at any row count (DOT_ALWAYS): at 2 rows its GEMV took ~25 us of a 0.97 ms
# step for 42 MB (scripts/step_timeline.py), where the dot path's 256 programs stream them in fewer waves. H200,
# `scripts/engine_ab.py --batch-sizes 1 --process-per-setting`, n = 1: 0.970 / 0.971 -> 0.966 / 0.966 ms/step, the same
# tokens (at #22's 1.14 ms steps the two had tied); n = 2 (4 rows, PERF_NOTES #65's rows): 1.485 / 1.484 -> 1.467 /
# 1.465. The head's GEMV tiling stays for int8 weights (not measured there) and for A/Bs (`DOT_ALWAYS = ()`).
CONFIG = dict(qkv=(8, 8), wo=(4, 4), gate_up=(4, 4), w2=(4, 4), output=(4, 4))
# (These and CONFIG_INT8 were swept with every kernel multiplying as one (rows, BN, K) product; the one-tile kernels
# row by row, _gemv, were measured at them and not swept again.)
# int8 weights, the same script with --quantize int8: 25.4-25.9 us per block with these, 27.5 with CONFIG
# (27.5 for bf16 in the same run)
CONFIG_INT8 = dict(qkv=(4, 4), wo=(4, 4), gate_up=(4, 4), w2=(4, 4), output=(4, 4))
# GEMV kernels that hold K in pieces (_gemv_pieces) rather than padded to a power of two. H200, `python
# scripts/engine_ab.py --batch-sizes 1 --process-per-setting`, ms/step against every kernel padded (0.997): gate/up in
# pieces 0.970 (n = 2: 1.488 -> 1.489), and with it qkv 0.980, the head 0.970, wo 0.977; all five 1.036 (the one-tile
# kernels alone 1.065). gate/up in pieces at (8, 8) 1.036, at (2, 2) 0.972.
PIECES = ("gate_up",)
# dot path: rows of W per program (>= 16; pairs for qkv), K chunk, warps, pipeline stages, and
# split-K (programs per row tile, each a run of K chunks; the last to finish adds the partials).
# scripts/bench_decode_block.py on the H200 (GPT-XL, 16 rows, position 700, no PDL): 51.9 us per
# block vs 57.7 for the compiled block (at 32 rows 75.7 vs 71.4: the compiled block wins there);
# K chunks of 128 were 4-6 us slower unsplit; split-K gains only in w2 (K = 3,584, 3 splits: 54.1 ->
# 52.2 us; 52.0 with 128-wide chunks, which leave a 16 B stack frame at sm_90), elsewhere it lost
# up to 9 us.
# The output projection (16,384 x 1,280 for GPT-XL, the final norm fused), alone, 4 weights in turn: 13.7 us
# at 16 rows against 24.8 with wo's tiling; in the model n = 8 1.837 / 1.838 -> 1.828 / 1.827 ms/step.
# Re-swept with PDL's late trigger (the same script, 16 rows: the block 49.6 -> 48.8 us), wo and w2 with
# 128-wide K chunks split 4 and 3 ways: n = 8 1.791 -> 1.779 ms/step, n = 4 1.541 -> 1.533 in the model.
# With the L2 prefetcher, in the model (scripts/engine_ab.py, n = 8, one setting changed at a time): wo with 3
# stages instead of 6 (each split is 3 chunks) 1.586-1.589 -> 1.576-1.577 ms/step; the other 10 tried lost.
# With RMSNorm's statistics pass unrolled (_dots): n = 8 1.491 -> 1.435, n = 4 1.280 -> 1.200 ms/step; then qkv at
# (16, 256, 4, 3, 1) or split 2 (1.49-1.51) and gate/up at (16, 256, 4, 4, 1) or split 2 (1.54-1.56) lost again.
DOT_CONFIG = dict(qkv=(32, 256, 4, 3, 1), wo=(16, 128, 4, 3, 4), gate_up=(32, 256, 4, 4, 1), w2=(16, 128, 4, 4, 3),
                  output=(64, 128, 8, 4, 1))
# int8 weights: wo and w2 as swept before the dot path had PDL; re-swept with it (`--quantize int8 --rows 16`), the
# best was within noise (43.7 against 44.1 us per block). The head at wo's (int8 64-row tiles spill).
DOT_CONFIG_INT8 = dict(DOT_CONFIG, wo=(16, 256, 4, 3, 1), w2=(16, 256, 4, 6, 3), output=(16, 256, 4, 3, 1))
DOT_ALWAYS = ("output",)  # kernels whose float weights take the dot path at <= GEMV_ROWS rows too (CONFIG's comment)


# The GEMV path's kernels let the next one launch before their own wait (pdl.FIRST), not right after it (EARLY): the
# next kernel's programs then load their weights while this one's still wait, so two kernels ahead load rather than
# one. H200, `python scripts/engine_ab.py --batch-sizes 1 --process-per-setting` (docs/PERF_NOTES.md #65): n = 1
# 0.966 / 0.965 -> 0.948 / 0.948 ms/step, n = 2 1.467 / 1.465 -> 1.466 / 1.466 (flat), the same tokens; the
# prefetcher is worth more under it (without it 0.983). The inputs kernel and the draw's kernels FIRST too: flat.
# int8 weights lose under it (an untracked probe, one process, alternating: 0.913 / 0.912 -> 0.930 / 0.930 ms/step at
# n = 1, the same tokens): their GEMVs keep EARLY. The dot path under FIRST: n = 8 1.433 -> 1.892 ms/step.
GEMV_PDL = FIRST
GEMV_PDL_INT8 = EARLY


def pdl_for(rows, device, int8=False):
    """How the kernels of a block at `rows` rows launch: GEMV_PDL (GEMV_PDL_INT8 for int8 weights) on the GEMV path
    (the weights are fetched before the wait), pdl.LATE on the dot path: the next kernel may launch once the results are
    computed. Right after the wait made the 16-row block slower (53 -> 57-59 us): the next kernel's
    early programs hold SM resources the running ones need. GPT-XL in the model, no PDL -> LATE (the
    attention without it), ms/step: n = 6 1.689 / 1.686 -> 1.668 / 1.668, n = 8 1.831 / 1.828 -> 1.794 / 1.794."""
    if not use_pdl(device):
        return False
    if rows > GEMV_ROWS:
        return LATE
    return GEMV_PDL_INT8 if int8 else GEMV_PDL


# The attention's merge with PDL's late trigger on the dot path, its partial kernel without PDL: the merge launches
# during the partials' tail. H200, `python scripts/engine_ab.py --batch-sizes 8 --process-per-setting`: n = 8 1.515 /
# 1.516 -> 1.507 / 1.509 ms/step (the keys' prefetch at 24 MB), tokens identical.
MERGE_PDL = True


def merge_pdl(rows, device, int8=False):
    """How the decode attention's merge launches: as its partial kernel (attention_pdl), or with MERGE_PDL on the
    dot path under PDL's late trigger after a partial kernel without PDL (its launch during the partials' tail)."""
    pdl = attention_pdl(rows, device, int8)
    return pdl_for(rows, device, int8) if MERGE_PDL and not pdl else pdl


def attention_pdl(rows, device, int8=False):
    """How the decode attention between the block's kernels launches: with PDL as the GEMV path, else without. At
    5-16 rows its PDL data path (the current key and value read apart, after the wait) cost more than
    the overlap saved: n = 8 1.845 ms/step with it, 1.794 without (the block's kernels LATE)."""
    pdl = pdl_for(rows, device, int8)
    return pdl if pdl in (EARLY, FIRST) else False


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
        images 0..IMAGES-1 to NOISE (IMAGES, N) (decode_sampling.race_noise): made before the wait from the
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
                    SPLIT: tl.constexpr, QUANT: tl.constexpr, BUMP: tl.constexpr):
        """RMSNorm(X) @ Wqkv.T, RoPE on q and k, q to Q (R, D), k and v into the caches at POS.

        A program owns BP adjacent (even, odd) column pairs of one head, so the rotation is local."""
        bump(PROGRESS, BUMP)
        first = tl.program_id(0) * BP * 2  # first column: BP pairs never straddle a head (HD / 2 % BP == 0)
        section, h = first // D, first % D // HD  # section 0, 1, 2: q, k, v
        col = first + 2 * tl.arange(0, BP)
        all_ok = col >= 0
        dt = Q.dtype.element_ty
        d = col % HD
        if not DOT:  # GEMV: before the wait (the previous step wrote it)
            pos = tl.load(POS, cache_modifier=".cg")
        ye, yo, live, _ = _project(X, NW, W, S, PART, COUNT, col, col + 1, all_ok, R, X, col, all_ok, EPS, D, PW, RP,
                                   BP, BK, True, True, DOT, PDL, PREC, SPLIT, QUANT, 0, dt)
        offs_r = tl.arange(0, RP)
        r_ok = offs_r < live
        if DOT:  # after it: ahead of the wait, n = 8 ran 0.3-0.6% slower
            pos = tl.load(POS)
        if section < 2:  # rotate pair j = d / 2 by this position's (cos, sin), in float32 as the model
            c = tl.load(FREQS + d)[None, :]
            s = tl.load(FREQS + d + 1)[None, :]
            ye, yo = ye * c - yo * s, yo * c + ye * s
        ok = r_ok[:, None] & all_ok[None, :]
        if section == 0:
            q = Q + offs_r[:, None] * D + h * HD + d[None, :]
            tl.store(q, ye.to(dt), mask=ok)
            tl.store(q + 1, yo.to(dt), mask=ok)
        else:
            at = offs_r[:, None] * stride_cr + h * stride_ch + pos * stride_cn + d[None, :]
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


def plan(name, x, weight, tiles, pdl, progress=None):
    """(weight rows per program, kernel arguments) of kernel `name` for x (R, K) and weight (N, K): the
    GEMV path at <= GEMV_ROWS rows (but DOT_ALWAYS' float weights), else the dot path; `tiles` weight tiles (rows_a,
    rows_b) per program.
    progress: an int32 count the kernel's first program adds one to as it starts (prefetch.py), or None."""
    (R, K), p2 = x.shape, triton.next_power_of_2
    kw = dict(PREC="ieee" if x.dtype == torch.float32 else "tf32",  # fp32 (tests): exact dots
              PROGRESS=x if progress is None else progress, BUMP=progress is not None, **launch(pdl))
    if R <= GEMV_ROWS and (name not in DOT_ALWAYS or weight.dtype == torch.int8):
        rows, warps = (CONFIG_INT8 if weight.dtype == torch.int8 else CONFIG)[name]
        width = piece_width(name, weight)
        return rows_per_program(rows, warps, tiles, weight, width), dict(kw, DOT=False, RP=max(2, p2(R)), PW=width,
                                                                    BK=16, SPLIT=1, num_warps=warps)
    rows, bk, warps, stages, split = (DOT_CONFIG_INT8 if weight.dtype == torch.int8 else DOT_CONFIG)[name]
    if x.element_size() > 2:  # float32 (tests): a quarter of the chunk, an eighth in the pair kernels, or they spill
        bk = max(16, bk // (4 * tiles))
    return rows, dict(kw, DOT=True, RP=max(16, p2(R)), PW=16, BK=bk, num_warps=warps, num_stages=stages,
                      SPLIT=min(split, triton.cdiv(K, bk)))


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


def linear(x, weight, scales=None, residual=None, name="wo", pdl=False, progress=None, then=None, kernels=None):
    """residual + x @ weight.T for x (R, K) contiguous, R <= MAX_ROWS, with kernel `name`'s tiling; an int8
    weight with its row scales (quantize.py) as model.int8_linear; then + `then` (R, N) if given, rounded
    again. With pdl.EARLY, `residual` and `then` must not be written by the kernel just before (the GEMV path
    reads them before its wait then; in the block the residual is wo's input, 4 kernels back, or w2's, 2 back, and
    `then` the step's control rows); under FIRST and LATE it reads them after its wait. kernels: the projections
    smem_gemv's CUDA kernels run where they can (smem_gemv.KERNELS if None)."""
    out = smem_gemv.linear(x, weight, scales, residual, name, pdl, then, progress, kernels)
    if out is not None:
        return out
    R, K = x.shape
    N = weight.shape[0]
    bn, kw = plan(name, x, weight, 1, pdl, progress)
    grid, part, counts = split_buffers(x, triton.cdiv(N, bn), kw, bn)
    out = torch.empty(R, N, device=x.device, dtype=x.dtype)
    _linear_kernel[grid](x, weight, _or(scales, x), residual, _or(then, x), out, part, counts, R=R, N=N, K=K, BN=bn,
                         QUANT=scales is not None, THEN=then is not None, **kw)
    return out


def qkv_rope(x, norm, weight, scales, freqs, input_pos, k_cache, v_cache, n_head, pdl=False, progress=None,
             kernels=None):
    """q (R, H, 1, hd); k and v written into the caches at input_pos."""
    q = smem_gemv.qkv_rope(x, norm, weight, scales, freqs, input_pos, k_cache, v_cache, n_head, pdl, progress, kernels)
    if q is not None:
        return q
    R, D = x.shape
    hd = D // n_head
    pairs, kw = plan("qkv", x, weight, 2, pdl, progress)  # each pair is two weight rows
    bp = min(pairs, hd // 2)  # a divisor of hd / 2 (both powers of two)
    grid, part, counts = split_buffers(x, 3 * D // (2 * bp), kw, bp)
    q = torch.empty(R, n_head, 1, hd, device=x.device, dtype=x.dtype)
    _qkv_kernel[grid](
        x, norm.weight, weight, _or(scales, x), freqs, input_pos, q, k_cache, v_cache, part, counts, R=R,
        stride_cr=k_cache.stride(0), stride_ch=k_cache.stride(1), stride_cn=k_cache.stride(2), EPS=norm.eps, D=D,
        HD=hd, BP=bp, QUANT=scales is not None, **kw)
    return q


def gate_up(x, norm, w13, scales=None, pdl=False, progress=None, kernels=None):
    out = smem_gemv.gate_up(x, norm, w13, scales, pdl, progress, kernels)
    if out is not None:
        return out
    R, K = x.shape
    F = w13.shape[0] // 2
    bn, kw = plan("gate_up", x, w13, 2, pdl, progress)  # gate and up rows
    grid, part, counts = split_buffers(x, triton.cdiv(F, bn), kw, bn)
    out = torch.empty(R, F, device=x.device, dtype=x.dtype)
    _gate_up_kernel[grid](x, norm.weight, w13, _or(scales, x), out, part, counts, R=R, F=F, EPS=norm.eps, K=K, BN=bn,
                          QUANT=scales is not None, **kw)
    return out


def decode_block(layer, x, freqs, attend, input_pos, prefetcher=None, control=None, kernels=None):
    """TransformerBlock.forward(x, freqs, attend) for x (R, 1, D), usable as model block_fn; + control (R, 1, D),
    the next block's control rows, if given (adds_control: model.forward passes them).

    attend should launch with PDL where attention_pdl says: decode_attention(..., pdl=attention_pdl(R, device, int8)).
    prefetcher (prefetch.Prefetcher): its count is bumped by each of the 4 projections as it starts.
    kernels: the projections that run as smem_gemv's CUDA kernels where they can (smem_gemv.KERNELS if None); with
    smem_gemv.ALL, where smem_gemv.builds_block says so, no Triton kernel runs (the cudagraph backend, whose attend is
    smem_attention's or SDPA's)."""
    attn, ff = layer.attention, layer.feed_forward
    R, _, D = x.shape
    x = x.view(R, D)
    cache = attn.kv_cache
    pdl = pdl_for(R, x.device, row_scales(attn.wqkv) is not None)
    progress = None if prefetcher is None else prefetcher.progress
    q = qkv_rope(x, layer.attention_norm, attn.wqkv.weight, row_scales(attn.wqkv), freqs, input_pos, cache.k_cache,
                 cache.v_cache, attn.n_head, pdl, progress, kernels)
    # q rotated, the step's key and value in the cache: attend's other arguments go unused
    y = attend(q.transpose(1, 2), None, None, freqs, cache)  # (R, H, 1, hd): its flat rows are heads side by side
    h = linear(y.view(R, D), attn.wo.weight, row_scales(attn.wo), residual=x, name="wo", pdl=pdl, progress=progress,
               kernels=kernels)
    a = gate_up(h, layer.ffn_norm, ff.w13, ff.w13_scales, pdl, progress, kernels)
    then = None if control is None else control.reshape(R, D)
    return linear(a, ff.w2.weight, row_scales(ff.w2), residual=h, name="w2", pdl=pdl, progress=progress,
                  then=then, kernels=kernels).view(R, 1, D)


# The control rows added before blocks L and 2L (model.forward), in the down projection of the block before: a
# PyTorch add between two blocks was a kernel outside the PDL chain, which the next QKV kernel could not fetch its
# weights ahead of.
decode_block.adds_control = True


# `down` as an op that inductor calls as it is (down_op), launched under PDL's late trigger: inductor launches a
# user-defined Triton kernel through its own launcher, which takes no launch_pdl, and without PDL at n = 32 the down
# projection waits for SiLU x up to finish before it launches. H200, `python scripts/engine_ab.py --batch-sizes 32
# --process-per-setting` (docs/PERF_NOTES.md #47): 2.775 -> 2.756 ms/step. The decode attention the same way lost:
# its partial kernel under PDL 2.735 -> 2.958, its merge alone +0.01 ms.
DOWN_PDL = True


def down(a, w2, h, progress=None):
    """h + w2(a) for a (R, 1, F) and h (R, 1, D): the down projection's kernel with the residual add, as
    TransformerBlock.forward's `down`, through down_op (under PDL with DOWN_PDL); counted for a prefetcher
    (progress) as it starts."""
    R, _, D = h.shape
    count = progress is not None
    if not count:  # the op mutates it: a scratch count rather than an input
        progress = torch.empty(1, dtype=torch.int32, device=h.device)
    pdl = pdl_for(R, h.device) if DOWN_PDL else False
    return down_op(a.view(R, -1), w2.weight, h.view(R, D), progress, count, int(pdl)).view(R, 1, D)


@torch.library.custom_op("fast_inference::down", mutates_args=("progress",))
def down_op(a: torch.Tensor, weight: torch.Tensor, h: torch.Tensor, progress: torch.Tensor, count: bool,
            pdl: int) -> torch.Tensor:
    return linear(a, weight, residual=h, name="w2", pdl=pdl, progress=progress if count else None)


@down_op.register_fake
def _(a, weight, h, progress, count, pdl):
    return h.new_empty(h.shape)


def serves_down(layer, rows, steps=1, cuda=True):
    """Whether `down` serves the compiled block: one-token steps of MAX_ROWS < rows <= DOWN_ROWS rows on a CUDA
    device, w2 in floats."""
    return (triton is not None and cuda and steps == 1 and MAX_ROWS < rows <= DOWN_ROWS
            and row_scales(layer.feed_forward.w2) is None)


def down_for(layer, x, progress=None):
    """`down` where it serves the compiled block at x (R, S, D), else None (the model's w2 and add). progress: a
    prefetcher's count."""
    R, S, _ = x.shape
    if not serves_down(layer, R, S, x.is_cuda):
        return None
    return down if progress is None else functools.partial(down, progress=progress)


def logits(model, h, noise=None):
    """model.logits(h) for h (R, 1, D), the final RMSNorm fused into the output projection, in the
    weights' dtype: model.logits' float32 cast is left to the reader (the fused draw reads them so).
    noise = (buffer (images, V) float32, input_pos, seed): also the race noise of the step's draw at
    input_pos into the buffer (decode_sampling.draw's `noise`)."""
    R, _, D = h.shape
    x, weight, scales = h.view(R, D), model.output.weight, row_scales(model.output)
    N = weight.shape[0]
    bn, kw = plan("output", x, weight, 1, pdl_for(R, h.device, scales is not None))
    grid, part, counts = split_buffers(x, triton.cdiv(N, bn), kw, bn)
    out = torch.empty(R, N, device=x.device, dtype=x.dtype)
    buf, pos, seed = (out, x, x) if noise is None else noise  # unused pointers without noise
    images = 0 if noise is None else buf.shape[0]
    VP, chunk = decode_sampling.layout(N)
    _head_kernel[grid](x, model.norm.weight, weight, _or(scales, x), out, buf, pos, seed, part, counts, R=R, N=N,
                       EPS=model.norm.eps, K=D, BN=bn, QUANT=scales is not None, IMAGES=images,
                       IP=triton.next_power_of_2(max(images, 1)), VP=VP, CHUNK=chunk, **kw)
    return out.view(R, 1, -1)


def supported(model, rows):
    """The fused block needs Triton, a CUDA model, fused gate/up weights, at most MAX_ROWS rows, a
    power-of-two head size, and on the dot path (> GEMV_ROWS rows) heads of >= 32 (16 pairs per dot)."""
    hd = model.args.head_dim
    return (triton is not None and model.output.weight.is_cuda and rows <= MAX_ROWS
            and model.layers[0].feed_forward.w13 is not None and hd & (hd - 1) == 0
            and (rows <= GEMV_ROWS or hd >= 32))
