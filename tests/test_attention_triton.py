"""The split-KV Triton decode kernel and the whole one (a program per (row, head), no merge) against SDPA with
the model's mask rule (several tile sizes, tiles of padding only, tiles past the position, leading padding
skipped, shorter and longer than the searched LEAD keys; with and without the PDL data path; with q and the
step's key before RoPE, the kernel rotating them and writing the key and value into the caches), in Triton's
CPU interpreter (TRITON_INTERPRET=1), so CI checks the kernels the GPU engine runs."""

import pytest

import early
import interpret
import sm90

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import itertools

import torch
import triton.language as tl
from fast_inference.kernels import attention_triton as da
from fast_inference.model import apply_rotary_emb, attention_mask, rotations

# The interpreter has no grid dependency control; without PDL launches the calls are no-ops anyway.
tl.extra.cuda.gdc_wait = tl.extra.cuda.gdc_launch_dependents = lambda *args, **kwargs: None

# Scratch as garbage: NaN in every float buffer the wrapper allocates, so a partial that a tile past the
# position did not write poisons the merge.
def poisoned(make):
    def make_nan(*args, **kwargs):
        t = make(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return make_nan


torch.empty, torch.empty_like = poisoned(torch.empty), poisoned(torch.empty_like)

def key_mask(R, L, T):  # row 0's text all padding, row 1's left-padded to its last 3 keys, other rows random
    key_valid = torch.ones(R, L, dtype=torch.bool)
    key_valid[:, :T] = torch.rand(R, T) > 0.5
    key_valid[0, :T] = False
    if R > 1:
        key_valid[1, :T - 3] = False
        key_valid[1, T - 3:T] = True
    return key_valid


torch.manual_seed(0)
worst = 0.0
# (rows, heads, cache length, position, tile, text prefix, leading keys searched); in each, row 0's
# text is all padding and row 1's is left-padded to its last 3 keys, other rows random
cases = [(2, 3, 40, 30, 16, 8, 128), (3, 2, 48, 47, 16, 8, 128), (2, 2, 40, 9, 32, 8, 128), (1, 2, 24, 3, 128, 8, 128),
         (2, 2, 72, 70, 64, 8, 128), (2, 2, 72, 5, 16, 8, 128), (3, 2, 72, 60, 16, 40, 128), (3, 2, 72, 60, 16, 40, 16),
         (2, 2, 72, 30, 16, 40, 128)]
# each case split-KV with the merge, and whole (one program per (row, head), its tiles in a loop, no merge)
for (R, H, L, pos, block, T, lead), whole in itertools.product(cases, (False, True)):
    da.LEAD = lead
    cfg = lambda pdl: (block, 2, 1) if whole else (block, 4, 1 + 3 * pdl)  # the whole form: (BLOCK, warps, stages)
    q = torch.randn(R, H, 1, 64)
    k = torch.randn(R, H, L, 64)
    v = torch.randn(R, H, L, 64)
    key_valid = key_mask(R, L, T)
    p = torch.tensor([pos])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(key_valid, p))
    for pdl in (False, True):  # PDL: the current key and value are read apart from the tile
        got = da.decode_attention(q, k, v, key_valid, p, config=cfg(pdl), pdl=pdl, whole=whole)
        worst = max(worst, (got - want).abs().nan_to_num(float("inf")).max().item())
    # The text as one partial: its keys zero (RoPE's zero rows), their values' sum and count made after the
    # prefill, the tiles from T on (poisoned keys and mask before T: read, they would show); row 0's text is
    # all padding (no text partial), row 1's a few keys
    k0 = k.clone()
    k0[:, :, :T] = 0.0
    want0 = torch.nn.functional.scaled_dot_product_attention(q, k0, v, attn_mask=attention_mask(key_valid, p))
    sums, counts = torch.full((R + 1, H, 64), float("nan")), torch.full((R + 1,), float("nan"))
    da.text_sums(v, key_valid, T, sums, counts)
    assert counts[:R].tolist() == key_valid[:, :T].sum(1).tolist()
    k0[:, :, :T] = float("nan")
    mask = key_valid.clone()
    mask[:, :T] = ~mask[:, :T]
    for pdl in (False, True) if pos >= T else ():  # (a decode step's position is past the text)
        got = da.decode_attention(q, k0, v, mask, p, config=cfg(pdl), pdl=pdl, whole=whole, text=(sums, counts, T))
        worst = max(worst, (got - want0).abs().nan_to_num(float("inf")).max().item())
    # With a prefetcher's count: the same output, one count per call, whatever the tiles
    count = torch.zeros(1, dtype=torch.int32)
    got = da.decode_attention(q, k, v, key_valid, p, config=cfg(False), progress=count, whole=whole)
    worst = max(worst, (got - want).abs().nan_to_num(float("inf")).max().item())
    assert count.item() == 1, count
    # fresh: q and the step's key before RoPE; the kernel rotates them and writes the key and value at pos
    # (NaN there before: read, they would poison the output) into caches with a spare row it must not touch
    q, k_new, v_new = torch.randn(3, R, H, 1, 64)
    freqs = torch.randn(1, 32, 2)
    k, v = torch.randn(2, R + 1, H, L, 64)
    k[:, :, pos] = v[:, :, pos] = float("nan")
    rotate = lambda t: apply_rotary_emb(t.transpose(1, 2), rotations(freqs)).transpose(1, 2)
    want_k, want_v = k.clone(), v.clone()
    want_k[:R, :, pos], want_v[:R, :, pos] = rotate(k_new)[:, :, 0], v_new[:, :, 0]
    want = torch.nn.functional.scaled_dot_product_attention(rotate(q), want_k[:R], want_v[:R],
                                                            attn_mask=attention_mask(key_valid, p))
    got = da.decode_attention(q, k, v, key_valid, p, config=cfg(False), whole=whole, fresh=(k_new, v_new, freqs))
    worst = max(worst, (got - want).abs().nan_to_num(float("inf")).max().item())
    for cache, cache_want in ((k, want_k), (v, want_v)):
        assert cache.isnan().sum() == cache_want.isnan().sum() == H * 64, "only the spare row's position stays NaN"
        worst = max(worst, (cache - cache_want).nan_to_num(0.0).abs().max().item())
# A position per row (a server's step: rows joined at other times): each row's keys up to its own position, fresh keys
# rotated by its own RoPE row and written at its own position; the rows' positions differ, so one row's position used
# for another's shows
for (block, whole, text), pdl in itertools.product(((16, False, False), (16, True, False), (64, True, True),
                                                     (32, False, True)), (False, True)):
    R, H, L, T = 4, 2, 72, 8
    cfg = (block, 2, 1) if whole else (block, 4, 1)
    p = torch.tensor([[9], [70], [30], [47]])
    key_valid = key_mask(R, L, T)
    q, k_new, v_new = torch.randn(3, R, H, 1, 64)
    freqs = torch.randn(R, 1, 32, 2)
    k, v = torch.randn(2, R + 1, H, L, 64)
    if text:  # the text's keys zero, its partial made after the prefill, its keys never read again
        k[:, :, :T] = 0.0
        sums, counts = torch.full((R + 1, H, 64), float("nan")), torch.full((R + 1,), float("nan"))
        da.text_sums(v, key_valid, T, sums, counts)
    rows = torch.arange(R)
    rotate = lambda t: torch.cat([apply_rotary_emb(t[i : i + 1].transpose(1, 2), rotations(freqs[i])).transpose(1, 2)
                                  for i in range(R)])
    want_k, want_v = k.clone(), v.clone()
    want_k[rows, :, p[:, 0]], want_v[rows, :, p[:, 0]] = rotate(k_new)[:, :, 0], v_new[:, :, 0]
    if pdl:  # the fused block's QKV wrote the step's key and value: q rotated, the caches hold them
        k, v, qq, fresh = want_k.clone(), want_v.clone(), rotate(q), None
    else:
        k[rows, :, p[:, 0]] = v[rows, :, p[:, 0]] = float("nan")
        qq, fresh = q, (k_new, v_new, freqs)
    want = torch.nn.functional.scaled_dot_product_attention(rotate(q), want_k[:R], want_v[:R],
                                                            attn_mask=attention_mask(key_valid, p))
    kw = dict(text=(sums, counts, T)) if text else {}
    got = da.decode_attention(qq, k, v, key_valid, p, config=cfg, pdl=pdl, whole=whole, fresh=fresh, **kw)
    worst = max(worst, (got - want).abs().nan_to_num(float("inf")).max().item())
    worst = max(worst, (k - want_k).abs().max().item(), (v - want_v).abs().max().item())
print(worst)
"""


ENV = interpret.ENV


def test_kernel_matches_sdpa_in_interpreter():
    out = early.result(SCRIPT, ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5


AOT_SCRIPT = r"""
import itertools

from fast_inference.kernels import attention_triton as da
from sm90 import build

ints = ["stride_qr", "stride_qh", "stride_kr", "stride_kh", "stride_kn", "stride_vr", "stride_vh", "stride_vn",
        "stride_valid", "stride_nr", "stride_nh", "n_heads", "n_splits", "text_len"]
sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KEY_VALID": "*i1", "POS": "*i64", "M_OUT": "*fp32",
       "L_OUT": "*fp32", "ACC_OUT": "*fp32", "K_NEW": "*bf16", "V_NEW": "*bf16", "FREQS": "*fp32",
       **{n: "i32" for n in ints}}
# As the JIT specialises them at GPT-XL shapes: 16-byte aligned buffers, cache strides that are multiples of 16
aligned = ["Q", "K", "V", "KEY_VALID", "POS", "M_OUT", "L_OUT", "ACC_OUT", "K_NEW", "V_NEW", "FREQS", "stride_kr",
           "stride_kh", "stride_kn", "stride_vr", "stride_vh", "stride_vn", "stride_nr", "stride_nh"]
attrs = {(list(sig).index(name),): [["tt.divisibility", 16]] for name in aligned}
merge_sig = {"M": "*fp32", "L": "*fp32", "ACC": "*fp32", "OUT": "*bf16", "PROGRESS": "*i32", "TEXT_SUM": "*fp32",
             "TEXT_COUNT": "*fp32", "n_splits": "i32", "n_heads": "i32"}
# every entry of the table; the compiled block launches without PDL, the fused block with it. A K/V tile spilled
# to local memory would halve the kernel's speed.
# K and V with and without the evict-first hint; the merge with a prefetcher's count (the compiled block, no PDL);
# the compiled block's fresh keys (RoPE and the cache write in the kernel), without PDL; the text as a partial.
for (block, warps, merge_warps), pdl in itertools.product([config for _, config in da.CONFIGS], (False, True)):
    for evict, fresh, text, row_pos in itertools.product((False, True), (False, True) if not pdl else (False,),
                                                         (False, True), (False, True)):
        consts = {"SCALE": 0.125, "BLOCK": block, "HEAD_DIM": 64, "LEAD": da.LEAD, "PDL": pdl, "EVICT": evict,
                  "FRESH": fresh, "TEXT": text, "ROW_POS": row_pos}
        build(da._partial_kernel, sig, consts, {"num_warps": warps, "launch_pdl": pdl}, attrs=attrs)
    # the merge with PDL's late trigger (2) after a partial kernel without PDL: the dot path (plan.merge_pdl)
    for splits, counted, text, merge_pdl in itertools.product((1, 16), (False, True) if not pdl else (False,),
                                                              (False, True), (pdl,) if pdl else (False, 2)):
        build(da._merge_kernel, merge_sig, {"SPLITS": splits, "HEAD_DIM": 64, "PDL": merge_pdl, "BUMP": counted,
                                            "TEXT": text}, {"num_warps": merge_warps, "launch_pdl": bool(merge_pdl)})
# the whole kernel as the compiled block launches it (no PDL, fresh keys, the text, a prefetcher's count), and under
# PDL with the cache written before (the fused block's QKV)
whole_sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "KEY_VALID": "*i1", "POS": "*i64", "OUT": "*bf16",
             "K_NEW": "*bf16", "V_NEW": "*bf16", "FREQS": "*fp32", "PROGRESS": "*i32", "TEXT_SUM": "*fp32",
             "TEXT_COUNT": "*fp32",
             **{n: "i32" for n in ints if n != "n_splits"}}
whole_attrs = {(list(whole_sig).index(name),): [["tt.divisibility", 16]] for name in aligned if name in whole_sig}
block, warps, stages = da.WHOLE
for pdl, evict, text, row_pos in itertools.product((False, True), (False, True), (False, True), (False, True)):
    consts = {"SCALE": 0.125, "BLOCK": block, "HEAD_DIM": 64, "LEAD": da.LEAD, "PDL": pdl, "EVICT": evict,
              "FRESH": not pdl, "TEXT": text, "BUMP": not pdl, "STAGES": stages, "ROW_POS": row_pos}
    # (64, 1, 1): 168 registers with Triton 3.9, no stack (unaligned builds, which never run, spilled ~80 B at 255).
    # Under PDL without the text, Triton 3.6's ptxas (the H200's) keeps two values on an 8 B stack at 168 registers
    # (stored before the key loop, reloaded for the output's store); no kernel of the engine launches that form unless
    # the plan's WHOLE_ROWS reaches the fused block's rows (an A/B); with a position per row and no text (a c2i
    # server's steps at 64-96 rows) the same 8 B
    build(da._whole_kernel, whole_sig, consts, {"num_warps": warps, "num_stages": stages, "launch_pdl": pdl},
          attrs=whole_attrs, stack=8 if (pdl or row_pos) and not text else 0)
    # with stages, Triton's pipeliner stages the tiles through shared memory (its loop has no dot, which it pipelines
    # only where the loop asks, tl.range's num_stages)
    piped = build(da._whole_kernel, whole_sig, dict(consts, BLOCK=64, STAGES=2),
                  {"num_warps": 1, "num_stages": 2, "launch_pdl": pdl}, attrs=whole_attrs)
    assert "cp.async" in piped.asm["ptx"] and piped.metadata.shared >= 2 * 64 * 64 * 2, piped.metadata.shared
print("compiled")
"""


def test_kernels_compile_for_sm90():
    """Ahead-of-time compile to an H100/H200 cubin with Triton's bundled ptxas (no GPU needed), so a
    kernel that only the interpreter accepts fails here rather than on the first GPU run; and the whole kernel with
    stages must stage its tiles through shared memory (cp.async), or its loop is not pipelined."""
    sm90.run(AOT_SCRIPT, TRITON_DEFAULT_FP_FUSION="1")


# A minute or so each: run beside the other tests (early.py)
EARLY = {"test_kernel_matches_sdpa_in_interpreter": (SCRIPT, ENV),
         "test_kernels_compile_for_sm90": (AOT_SCRIPT, sm90.env(TRITON_DEFAULT_FP_FUSION="1"))}
