"""The eager model's Triton kernels (kernels/eager_ops_triton.py: RoPE + cache write, SwiGLU) and the text partials of
all layers in one kernel (attention_triton.layer_text_sums) against the ops they replace, in Triton's CPU interpreter
(TRITON_INTERPRET=1), and compiled ahead of time for sm_90."""
import pytest

import early
import interpret
import sm90

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
import torch.nn.functional as F

from fast_inference.kernels import attention_triton as da, eager_ops_triton
from fast_inference.model import Context, EagerOps, KVCache, ModelArgs, Transformer, rope_and_cache, rotations

torch.manual_seed(0)
# RoPE + cache write, bit for bit: q, k, v as the QKV projection's split (B, S, H, hd views of one (B, S, 3D)), a
# cache with a spare row and NaN everywhere it must not write, heads and head dims that are not powers of two
for B, S, H, hd, dtype in ((2, 5, 4, 16, torch.bfloat16), (1, 3, 3, 12, torch.float32), (3, 7, 20, 64, torch.bfloat16)):
    qkv = (torch.randn(B, S, 3 * H * hd) * 4).to(dtype)
    q, k, v = (t.view(B, S, H, hd) for t in qkv.split(H * hd, dim=-1))
    freqs = torch.randn(S, hd // 2, 2)
    freqs[0] = 0.0  # a prefix row: RoPE's zero rows
    pos = torch.randperm(2 * S)[:S]
    caches = [KVCache(B + 1, H, 2 * S, hd, dtype) for _ in range(2)]
    for c in caches:
        c.k_cache.fill_(float("nan"))
        c.v_cache.fill_(float("nan"))
    want = rope_and_cache(q, k, v, rotations(freqs), caches[0], pos)
    got = eager_ops_triton.rope_and_cache(q, k, v, freqs, caches[1], pos)
    # the interpreter truncates float32 to bfloat16 where the GPU rounds to nearest: bit for bit in float32 only
    ulp = 2 ** -7 if dtype == torch.bfloat16 else 0.0
    for w, g in zip(want, got):
        w, g = w.float().nan_to_num(7.0), g.float().nan_to_num(7.0)
        assert w.shape == g.shape and ((w - g).abs() <= ulp * w.abs()).all(), (B, S, H, hd, dtype)
    assert torch.equal(caches[0].k_cache.isnan(), caches[1].k_cache.isnan())
    assert torch.equal(caches[0].v_cache.isnan(), caches[1].v_cache.isnan())
# SwiGLU: float32 to its roundings of the exact value, and in bfloat16 SiLU rounded before the product, as torch's ops
# (the interpreter's exp is numpy's, not CUDA's expf, and it truncates to bfloat16: within a unit of the last place)
for shape, dtype, tol in (((3, 5, 2 * 2500), torch.float32, 3e-7), ((4, 2 * 96), torch.bfloat16, 2 ** -6)):
    x = (torch.randn(shape) * 6).to(dtype)
    gate, up = x.double().chunk(2, dim=-1)
    # float32: two roundings and exp's of the exact value; bfloat16: torch's roundings of it
    want = (gate * torch.sigmoid(gate) * up if dtype == torch.float32
            else (F.silu(gate.to(dtype)) * up.to(dtype)).double())
    got = eager_ops_triton.silu_mul(x)
    assert got.shape == want.shape and got.dtype == dtype
    assert ((got.double() - want).abs() <= tol * want.abs() + 1e-30).all(), dtype
# The model's forward with the kernels where it runs eagerly (a prefill): float32 logits and caches as torch's ops
args = ModelArgs(dim=48, n_layer=2, n_head=3, vocab_size=64, block_size=16, cls_token_num=4, caption_dim=8,
                 model_type="c2i", num_classes=5)
model = Transformer(args).eval()
model.fuse_projections()
model.setup_caches(2, args.prefix_len + 16, torch.float32)
x, pos = torch.randn(2, 6, 48), torch.arange(6)
key_valid = torch.ones(2, model.max_seq, dtype=torch.bool)
key_valid[1, :2] = False
with torch.no_grad():
    want = model(x, pos, key_valid)
    kv = lambda: [t.clone() for layer in model.layers for t in (layer.attention.kv_cache.k_cache,
                                                                  layer.attention.kv_cache.v_cache)]
    want_kv = kv()
    ops = EagerOps(silu_mul=eager_ops_triton.silu_mul, rope_and_cache=eager_ops_triton.rope_and_cache)
    got = model(x, pos, key_valid, ctx=Context(ops=ops))
    got_kv = kv()
assert (got - want).abs().max().item() < 1e-5
assert torch.equal(got_kv[0], want_kv[0]) and torch.equal(got_kv[1], want_kv[1])  # block 0: the same inputs
assert all((g - w).abs().max().item() < 1e-5 for g, w in zip(got_kv[2:], want_kv[2:]))  # after SwiGLU's ulps
# The text partials of all layers in one kernel: as text_sums layer by layer (a row whose text is all padding)
R, H, L, hd, T = 3, 4, 20, 16, 11
caches = [KVCache(R + 1, H, L, hd, torch.bfloat16) for _ in range(3)]
key_valid = torch.rand(R, L) > 0.3
key_valid[0, :T] = False
for c in caches:
    c.v_cache.normal_()
    c.text = (torch.zeros(R + 1, H, hd), torch.zeros(R + 1), T)
want = [(s.clone(), n.clone()) for s, n, _ in (c.text for c in caches)]
for c, (s, n) in zip(caches, want):
    da.text_sums(c.v_cache, key_valid, T, s, n)
    c.text[0].fill_(float("nan"))
da.layer_text_sums(caches, key_valid, da.text_table(caches))
for c, (s, n) in zip(caches, want):
    assert torch.equal(c.text[1], n) and (c.text[0][:R] - s[:R]).abs().max().item() < 1e-5
    assert c.text[0][R].isnan().all()  # the spare row untouched
print("ok")
"""


def test_eager_ops_match_torch_in_interpreter():
    """RoPE + the cache write against model.rope_and_cache: bit for bit in float32, bf16 to the interpreter's
    truncation; heads and head dims that are not powers of two, a zero RoPE row, nothing written outside the
    positions. SwiGLU to a unit of the last place; the model's eager forward with them; the text partials of three
    layers in one kernel against text_sums."""
    out = early.result(SCRIPT, interpret.ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


AOT_SCRIPT = r"""
from fast_inference.kernels import attention_triton as da, eager_ops_triton
from sm90 import build

ints = {n: "i32" for n in ("S", "sq_b", "sq_s", "sk_b", "sk_s", "sv_b", "sv_s", "sc_b", "sc_h", "sc_s")}
sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "FREQS": "*fp32", "POS": "*i64", "QOUT": "*bf16", "KC": "*bf16",
       "VC": "*bf16", **ints}
build(eager_ops_triton._rope_cache_kernel, sig, {"H": 20, "HP": 32, "HD": 64, "HDP": 64},
      {"num_warps": 4, "enable_fp_fusion": False})
build(eager_ops_triton._silu_mul_kernel, {"X": "*bf16", "OUT": "*bf16", "F": "i32"}, {"BLOCK": 1024, "EXACT": True},
      {"num_warps": 4})
sig = {"V": "*bf16", "SUMS": "*fp32", "COUNTS": "*fp32", "TABLE": "*i64", "KEY_VALID": "*i1",
       **{n: "i32" for n in ("text_len", "sv_r", "sv_h", "sv_t", "ss_r", "ss_h", "skv")}}
build(da._text_sums_kernel, sig, {"HD": 64, "HDP": 64, "BLOCK_T": 64}, {"num_warps": 2})
print("compiled")
"""


def test_eager_ops_compile_for_sm90():
    """The GPU's builds (CUDA's expf from libdevice, fused multiply-adds off for RoPE) for an H100/H200, no GPU
    needed."""
    sm90.run(AOT_SCRIPT)


EARLY = {"test_eager_ops_match_torch_in_interpreter": (SCRIPT, interpret.ENV),
         "test_eager_ops_compile_for_sm90": (AOT_SCRIPT, sm90.env())}
