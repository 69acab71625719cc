"""A persistent chain of GPT-XL's four projections against decode_block's kernels (docs/PERF_NOTES.md, "A persistent
chain of the projections" and "The persistent chain taken further"). Needs an sm_90 GPU.

    LAYERS=8 [ROWS=2] [STAGES=7] [W2P=2] [VARIANTS="[('ll', 8, 0, 1, 16, 0, 0, 1)]"] [TIMELINE="[...]"] \
        python scripts/persistent_chain_probe.py

scripts/persistent_chain.cu compiled by NVRTC (smem_gemv's loader), one program per SM, ROWS rows (2: one image with
its classifier-free guidance; up to 16, n = 8, on the tensor-core consumers: x takes 7 KB of shared memory per row,
so ROWS=16 needs W2P=3 STAGES=4), LAYERS blocks of random weights. A variant is `run`'s (COPY, BARRIERS, AHEAD,
XREG), `run_mma`'s ('m', COPY, BARRIERS[, FLAGS]) or `run_ll`'s ('ll', NW, COPY, WAIT[, POLL, CNT, DBG, L16, EPI]; EPI 1-5),
see the .cu; STAGES stages in the ring, w2's rows in W2P pieces of K (3: stages of 20 KB instead of 28, so 10 of them fit).
Prints each full variant's largest difference from a float reference at LAYERS blocks (check at LAYERS=1: the random
activations vanish over 8), then each variant's time per block in a CUDA graph, the stamps of SM 0 and the last SM
in the second block of the first full run_mma or run_ll variant (or of those TIMELINE lists; a run_ll variant with
DBG 32 also every SM's end of each phase: the spread and the last five SMs), the same four
projections as decode_block's kernels at ROWS rows (their epilogues, no attention) and a device copy of the weights.
"""
import ctypes
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as Fn

from fast_inference import decode_block as B
from fast_inference import smem_gemv as S
from graph_timing import launch, require_sm90, timed

require_sm90("persistent_chain_probe.py")

D, F, H, HD = 1280, 3584, 20, 64  # GPT-XL width, MLP width, heads, head size
R = int(os.environ.get("ROWS", 2))
L = int(os.environ.get("LAYERS", 8))
STAGES = int(os.environ.get("STAGES", 7))
W2P = int(os.environ.get("W2P", 2))
STAGE = max(8 * D * 2, 8 * ((F // W2P + 255) // 256 * 256) * 2)  # bytes, as persistent_chain.cu's STAGE
VARIANTS = eval(os.environ.get("VARIANTS", "[(0, 1, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0), (2, 0, 0, 0), ('m', 0, 1, 1), "
                                           "('m', 3, 1, 1), ('ll', 1, 0, 1), ('ll', 2, 0, 1), ('ll', 4, 0, 1), "
                                           "('ll', 8, 0, 1), ('ll', 4, 3, 1), ('ll', 4, 2, 0), ('ll', 4, 1, 1), "
                                           "('ll', 8, 0, 1, 16, 0, 0, 1)]"))
EXCH = 16 * 2 * min(4 * R, 32) * (4 if R > 8 else 2) * 4  # bytes, as the .cu's exch_bytes
EPI = R * D * 2 + 16 * R * 4 + HD * 4 if R <= 8 else 0  # bytes, as the .cu's epi_bytes
SMEM = 128 + STAGES * STAGE + R * F * 2 + EXCH + EPI  # as the .cu's smem_bytes
STAMPS = ["producer issued", "start", "barrier passed", "x staged", "x synced", "first unit in", "units done", "signalled"]
STAMP_SLOTS = (7, 0, 5, 1, 2, 6, 3, 4)
dev, bf = "cuda", torch.bfloat16
nsm = torch.cuda.get_device_properties(0).multi_processor_count


def name(v):
    return "persist_" + "_".join(map(str, v))


def instance(v):
    kind = {"m": "run_mma", "ll": "run_ll"}.get(v[0], "run")
    return f"{kind}<{R}, {', '.join(map(str, v[1:] if kind != 'run' else v))}>"


def is_full(v):
    """Whether the variant computes the chain (copies, products and every wait)."""
    return {"m": lambda: v[1:3] == (0, 1), "ll": lambda: v[2:4] == (0, 1)}.get(v[0], lambda: v[:2] == (0, 1))()


def load_kernels():
    here = os.path.dirname(os.path.abspath(__file__))
    src = open(os.path.join(here, "persistent_chain.cu")).read().replace("S = 7,", f"S = {STAGES},").replace("W2P = 2;", f"W2P = {W2P};")
    src += "".join(f'extern "C" __global__ void __launch_bounds__(544, 1) {name(v)}(const PArgs a) {{ {instance(v)}(a); }}\n'
                   for v in dict.fromkeys(VARIANTS))  # a variant may be listed twice, to time it twice
    fns = S.functions(src, "90", [name(v) for v in dict.fromkeys(VARIANTS)], SMEM)
    return {v: fns[name(v)] for v in VARIANTS}


class PArgs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("wqkv", "wo", "w13", "w2", "x", "qkv", "h", "gu", "counters")] + \
               [("layers", ctypes.c_int), ("nsm", ctypes.c_int), ("stamps", ctypes.c_void_p)] + \
               [(n, ctypes.c_void_p) for n in ("xll", "qkvll", "hll", "gull", "nw", "freqs", "kc", "vc")] + \
               [("eps", ctypes.c_float), ("sqll", ctypes.c_void_p), ("ends", ctypes.c_void_p)]


torch.manual_seed(0)
wqkv = torch.randn(L, 3 * D, D, device=dev, dtype=bf) / D ** .5
wo = torch.randn(L, D, D, device=dev, dtype=bf) / D ** .5
w13 = torch.randn(L, 2 * F, D, device=dev, dtype=bf) / D ** .5
w2 = torch.randn(L, D, F, device=dev, dtype=bf) / F ** .5
x0 = torch.randn(R, D, device=dev, dtype=bf)
x = x0.clone()
qkv, h, gu = (torch.empty(R, n, device=dev, dtype=bf) for n in (3 * D, D, F))
counters = torch.zeros(L * 4 + 4, device=dev, dtype=torch.int32)
stamps = torch.zeros(2, L, 4, 16, device=dev, dtype=torch.int64)
ends = torch.zeros(L, 4, nsm, device=dev, dtype=torch.int64)  # run_ll: when each SM is done with each phase
ll = torch.zeros(R * (5 * D + F) // 2, device=dev, dtype=torch.int64)  # run_ll's x, qkv, h, gu as (pair, flag)
xll, qkvll, hll, gull = ll.split([R * D // 2, R * 3 * D // 2, R * D // 2, R * F // 2])
x0ll = torch.stack([x0.view(torch.int32).flatten(), torch.ones(R * D // 2, device=dev, dtype=torch.int32)], 1)
nw = (1 + torch.randn(L, 2, D, device=dev) / 8).to(bf)  # EPI: attention_norm's and ffn_norm's weights
angle = torch.rand(HD // 2, device=dev) * 6.28
cos_sin = torch.stack([angle.cos(), angle.sin()], 1)  # EPI: the step's (cos, sin) per pair, as decode_block reads them
keys_out, values_out = (torch.zeros(L, R, D, device=dev, dtype=bf) for _ in range(2))  # EPI: k and v as written
sqll = torch.zeros(2, 16, D // 8, 4, device=dev, dtype=torch.int32)  # EPI 3: per warp, unit {row 0's sum, flag, row 1's, flag}
x0sq = x0.float().view(R, D // 8, 8).pow(2).sum(-1)  # EPI 3: the first input's, flagged 1 as the input itself
x0sq = torch.stack([x0sq[0], x0sq[-1] if R > 1 else torch.zeros_like(x0sq[0])], 1).contiguous().view(torch.int32)
wqkv_f, w13_f = ((w.float() * nw[:, i, None, :].float()).to(bf) for i, w in ((0, wqkv), (1, w13)))  # EPI 4: folded
args = PArgs(wqkv.data_ptr(), wo.data_ptr(), w13.data_ptr(), w2.data_ptr(), x.data_ptr(), qkv.data_ptr(),
             h.data_ptr(), gu.data_ptr(), counters.data_ptr(), L, nsm, stamps.data_ptr(),
             xll.data_ptr(), qkvll.data_ptr(), hll.data_ptr(), gull.data_ptr(), nw.data_ptr(), cos_sin.data_ptr(),
             keys_out.data_ptr(), values_out.data_ptr(), 1e-5, sqll.data_ptr(), ends.data_ptr())
kernels = load_kernels()
params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))


def epi(v):
    return v[8] if v[0] == "ll" and len(v) > 8 else 0


def persist(v):
    folded = epi(v) >= 4  # EPI 4 and 5 multiply by the weights with the norms' folded in
    args.wqkv, args.w13 = ((wqkv_f if folded else wqkv).data_ptr(), (w13_f if folded else w13).data_ptr())
    counters.zero_()
    if v[0] == "ll":  # every flag 0, the input's 1
        ll.zero_()
        xll.view(torch.int32).view(-1, 2).copy_(x0ll)
        sqll.zero_()
        sqll[0, :, :, 0::2] = x0sq
        sqll[0, :, :, 1::2] = 1
    launch(kernels[v], nsm, 544, SMEM, params)


def rms(xr, w):
    """decode_block's RMSNorm: float32 statistics, x * rstd rounded, times the weight, rounded."""
    rstd = torch.rsqrt(xr.float().pow(2).mean(1, keepdim=True) + 1e-5)
    return ((xr.float() * rstd).to(bf).float() * w.float()).to(bf)


def rope(y):
    """Each (even, odd) pair of a head's columns rotated by cos_sin, in float32 from the rounded projection."""
    e, o = y.float().view(R, -1, HD // 2, 2).unbind(-1)
    c, s = cos_sin[:, 0], cos_sin[:, 1]
    return torch.stack([e * c - o * s, o * c + e * s], -1).view(R, -1).to(bf)


def folded(xr, w):
    """EPI 4's norm and product: raw x times the weight with the norm's folded in, scaled by the row's rstd, rounded."""
    rstd = torch.rsqrt(xr.float().pow(2).mean(1, keepdim=True) + 1e-5)
    return ((xr.float() @ w.float().T) * rstd).to(bf)


def reference(xr, epi, fold=False):
    """The chain in float32 with the model's roundings; epi: with the block's other work, as run_ll's EPI (fold: as
    EPI 4, the norms folded into the weights)."""
    keys = []
    for l in range(L):
        xn = rms(xr, nw[l, 0]) if epi else xr
        y = folded(xr, wqkv_f[l]) if fold else (xn.float() @ wqkv[l].float().T).to(bf)
        q = rope(y[:, :D]) if epi else y[:, :D]
        if epi:
            keys.append((rope(y[:, D:2 * D]), y[:, 2 * D:]))
        hh = (q.float() @ wo[l].float().T).to(bf)
        hh = (hh.float() + xr.float()).to(bf) if epi else hh
        g = folded(hh, w13_f[l]) if fold else ((rms(hh, nw[l, 1]) if epi else hh).float() @ w13[l].float().T).to(bf)
        a = (Fn.silu(g[:, :F].float()).to(bf).float() * g[:, F:].float()).to(bf)
        out = (a.float() @ w2[l].float().T).to(bf)
        xr = (out.float() + hh.float()).to(bf) if epi else out
    return xr, keys


ref, _ = reference(x0, False)
ref_epi, keys = reference(x0, True)
ref_fold, keys_fold = reference(x0, True, True)
for v in VARIANTS:
    if is_full(v):
        x.copy_(x0)
        persist(v)
        torch.cuda.synchronize()
        flagged = v[0] == "ll" and not (len(v) > 5 and v[5])  # run_ll's CNT 1 writes plain bf16
        out = xll.view(torch.int32).view(R, D // 2, 2)[..., 0].contiguous().view(bf) if flagged else x
        e = epi(v)
        want, want_kv = (ref_fold, keys_fold) if e >= 4 else (ref_epi, keys) if e else (ref, None)
        d = (out.float() - want.float()).abs().max().item()
        print(f"{v}, {L} blocks: max abs diff {d:.4g} (reference's largest {want.float().abs().max().item():.3g})", flush=True)
        if e >= 4:  # and how far the folded norm is from the model's roundings
            print(f"{v}: from the model's roundings {(out.float() - ref_epi.float()).abs().max().item():.4g}", flush=True)
        if e:
            dk = max((keys_out[l].float() - k.float()).abs().max().item() for l, (k, _) in enumerate(want_kv))
            dv = max((values_out[l].float() - vv.float()).abs().max().item() for l, (_, vv) in enumerate(want_kv))
            print(f"{v}: keys and values written, max abs diff {dk:.4g} / {dv:.4g}", flush=True)
for v in VARIANTS:
    print(f"{v}, {R} rows, {STAGES} stages, w2 in {W2P} pieces: {timed(lambda: persist(v), L):.2f} us per block", flush=True)

timeline = [v for v in VARIANTS if v[0] in ("m", "ll") and is_full(v)]
timeline = eval(os.environ.get("TIMELINE", "timeline[:1]"))  # the variants whose stamps are printed
for tv in (timeline if L > 1 else []):
    persist(tv)
    torch.cuda.synchronize()
    st = stamps.cpu().double()
    for i, who in enumerate(("SM 0", "last SM")):
        for p in range(4):
            us = "  ".join(f"{n} {(st[i, 1, p, k] - st[0, 0, 0, 0]) / 1e3:6.2f}" for n, k in zip(STAMPS, STAMP_SLOTS))
            cyc = st[i, 1, p].tolist()
            read = (f"; run_ll's cycles reading x {cyc[13] - cyc[12]:.0f}, then all consumers' barrier "
                    f"{cyc[14] - cyc[13]:.0f}") if tv[0] == "ll" else ""
            print(f"{tv} {who}, block 1, phase {p}, us: {us}; cycles from the first unit's data to its products "
                  f"{cyc[9] - cyc[8]:.0f}, to the phase's end {cyc[11] - cyc[8]:.0f}{read}")
    if tv[0] == "ll" and len(tv) > 6 and tv[6] & 32:  # DBG 32: every SM's end of each phase of block 1
        e = (ends[1].cpu().double() - st[0, 0, 0, 0]) / 1e3
        for p in range(4):
            late = e[p].argsort(descending=True)[:5].tolist()
            print(f"{tv} block 1, phase {p}, SMs done: first {e[p].min():.2f} median {e[p].median():.2f} last "
                  f"{e[p].max():.2f} us; the last five: {', '.join(f'SM {i} {e[p, i]:.2f}' for i in late)}")

norm = torch.nn.RMSNorm(D, eps=1e-5).to(dev, bf)
freqs = torch.randn(D // H // 2, 2, device=dev)
pos = torch.tensor([37], device=dev)
kc, vc = (torch.zeros(R, H, 64, D // H, device=dev, dtype=bf) for _ in range(2))
pdl = B.pdl_for(R, dev)


def chain():
    hx = x0
    for l in range(L):
        q = B.qkv_rope(hx, norm, wqkv[l], None, freqs, pos, kc, vc, H, pdl=pdl)
        h1 = B.linear(q.view(R, D), wo[l], residual=hx, name="wo", pdl=pdl)
        a = B.gate_up(h1, norm, w13[l], pdl=pdl)
        hx = B.linear(a, w2[l], residual=h1, name="w2", pdl=pdl)


print(f"decode_block's kernels at {R} rows: {timed(chain, L):.2f} us per block", flush=True)
big = torch.cat([w.flatten() for w in (wqkv, wo, w13, w2)])
dst = torch.empty_like(big)
t = timed(lambda: dst.copy_(big), 1)
print(f"device copy of the {big.numel() * 2 / 1e6:.0f} MB of weights: {t:.1f} us, "
      f"{2 * big.numel() * 2 / t / 1e6:.2f} TB/s read + write", flush=True)
