"""The transformer's checkpoint layout against the official manifests, its RoPE table and configs.

Models are built on the meta device: shapes only, no memory, instant even for GPT-XL.
"""
import json
import math
import os

import pytest
import torch

from conftest import DATA
from fast_inference.model import GPT_CONFIGS, ModelArgs, Transformer, precompute_freqs_cis_2d

MANIFESTS = {
    "manifest_gpt_xl_t2i_small.json": dict(name="GPT-XL", block_size=1024, cls_token_num=120, adapter_size="small"),
    "manifest_gpt_xl_t2i_base.json": dict(name="GPT-XL", block_size=1024, cls_token_num=120, adapter_size="base"),
    "manifest_gpt_l_c2i.json": dict(name="GPT-L", block_size=256, cls_token_num=1, model_type="c2i"),
}


def meta_model(name, **kw):
    with torch.device("meta"):
        return Transformer(ModelArgs.from_name(name, **kw))


@pytest.mark.parametrize("manifest", sorted(MANIFESTS))
def test_state_dict_matches_manifest(manifest):
    with open(os.path.join(DATA, manifest)) as f:
        m = json.load(f)
    kw = dict(MANIFESTS[manifest])
    model = meta_model(kw.pop("name"), **kw)
    expected = {k: list(s) for k, s, _ in m["params"]}
    expected.update({k: list(s) for k, s, _, in_sd in m["buffers"] if in_sd})
    ours = {k: list(t.shape) for k, t in model.state_dict().items()}
    assert sorted(set(ours) - set(expected)) == [] and sorted(set(expected) - set(ours)) == []
    assert ours == expected
    assert len(ours) == m["state_dict_num_keys"]
    assert {k: list(p.shape) for k, p in model.named_parameters()} == {k: list(s) for k, s, _ in m["params"]}
    assert sum(p.numel() for p in model.parameters()) == m["total_params"]
    assert all(t.dtype == torch.float32 for t in model.state_dict().values())
    assert list(model.freqs_cis.shape) == m["config"]["freqs_cis_shape"]
    config = m["config"]
    assert (model.args.ffn_hidden, model.args.layer_internal) == (config["ffn_hidden"], config["layer_internal"])


def test_total_params_by_top_module():
    with open(os.path.join(DATA, "manifest_gpt_xl_t2i_small.json")) as f:
        m = json.load(f)
    model = meta_model("GPT-XL", block_size=1024)
    ours = {}
    for k, p in model.named_parameters():
        top = "adapter.model" if k.startswith("adapter.model.") else k.split(".")[0]
        ours[top] = ours.get(top, 0) + p.numel()
    assert ours == m["total_params_by_top_module"]


def test_rope_table_xl():
    args = ModelArgs.from_name("GPT-XL", block_size=1024, cls_token_num=120)
    table = precompute_freqs_cis_2d(args)
    assert table.shape == (1144, 32, 2) and table.dtype == torch.float32
    assert torch.count_nonzero(table[:120]) == 0  # zero rows, not identity
    # Cell (r, c) of the 32x32 grid: pairs 0..15 rotate by r * f_m, pairs 16..31 by c * f_m.
    f = 10000.0 ** (-torch.arange(16, dtype=torch.float64) / 16)
    for r, c in [(0, 0), (3, 7), (31, 30)]:
        angles = torch.cat([r * f, c * f])
        row = table[120 + r * 32 + c].double()
        assert torch.allclose(row[:, 0], torch.cos(angles), atol=1e-6)
        assert torch.allclose(row[:, 1], torch.sin(angles), atol=1e-6)


def test_rope_table_stays_float32_in_a_bf16_model():
    """SPEC 2.5 and 14: the table is float32 whatever the model's dtype (official setup_caches rebuilds it); a
    model cast by .to(bfloat16) gets it back, exact, from setup_caches."""
    args = ModelArgs.from_name("GPT-B", block_size=256, cls_token_num=120, n_layer=1)
    model = Transformer(args).to(torch.bfloat16)
    assert model.freqs_cis.dtype == torch.bfloat16  # what .to() does to any float buffer
    model.setup_caches(2, 120 + 256, torch.bfloat16)
    assert model.freqs_cis.dtype == torch.float32
    assert torch.equal(model.freqs_cis, precompute_freqs_cis_2d(args))


def test_rotary_emb_rounds_as_the_official_formula():
    """apply_rotary_emb by rotation matrices gives the official pairwise formula's bits (x cast to float32,
    each product rounded, the two subtracted or added, cast back), in float32 and bf16, on the real table."""
    from fast_inference.model import apply_rotary_emb, rotations

    args = ModelArgs.from_name("GPT-B", block_size=256, cls_token_num=120)
    freqs = precompute_freqs_cis_2d(args)[torch.tensor([3, 119, 120, 200, 375])]  # prefix (zero) rows too
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(2, 5, 4, args.head_dim) * 4).to(dtype)
        xs = x.float().reshape(2, 5, 4, -1, 2)
        f = freqs.view(1, 5, 1, -1, 2)
        want = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                            xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], dim=-1).flatten(3).to(dtype)
        got = apply_rotary_emb(x, rotations(freqs))
        assert got.dtype == dtype and torch.equal(got, want)


def test_rope_and_cache_rotates_one_projections_q_and_k_together():
    """q and k split from one qkv projection are rotated as one (B,S,2H,hd) view, with the bits of rotating each;
    separate tensors take the two rotations."""
    from fast_inference.model import KVCache, heads_together, rope_and_cache, rotations

    args = ModelArgs.from_name("GPT-B", block_size=256, cls_token_num=120)
    B, S, H, hd = 2, 5, 4, args.head_dim
    rot = rotations(precompute_freqs_cis_2d(args)[torch.tensor([3, 119, 120, 200, 375])])
    pos = torch.arange(S)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = (torch.randn(B, S, 3 * H * hd) * 4).to(dtype)
        q, k, v = (t.view(B, S, H, hd) for t in qkv.split(H * hd, dim=-1))
        assert heads_together(q, k) is not None and heads_together(k, q) is None and heads_together(q, v) is None
        assert heads_together(q.clone(), k.clone()) is None
        outs = []
        for args_ in ((q, k, v), (q.clone(), k.clone(), v.clone())):
            cache = KVCache(B, H, 8, hd, dtype)
            outs.append(rope_and_cache(*args_, rot, cache, pos))
        for got, want in zip(*outs):
            assert torch.equal(got, want)
        assert not torch.equal(outs[0][0], q.transpose(1, 2))  # rotated


def test_rope_table_is_computed_on_the_cpu():
    """The official table is made on the CPU (its setup_caches rebuilds it there); a model built under another
    default device (the CLI builds on the GPU) gets the CPU's values, moved there."""
    args = ModelArgs.from_name("GPT-B", block_size=256, cls_token_num=120, n_layer=1)
    want = precompute_freqs_cis_2d(args)
    with torch.device("meta"):
        table = precompute_freqs_cis_2d(args)  # would be a meta tensor, values unknown, if made on the default device
        model = Transformer(args)
    assert table.device.type == "cpu" and torch.equal(table, want)
    assert model.freqs_cis.device.type == "meta"


def test_rmsnorm_eager_and_compiled_forms_agree():
    """RMSNorm eager (PyTorch's fused rms_norm) and as inductor reads it (the official formula spelled out):
    float32 statistics, rounded to x's dtype, then scaled by the weight."""
    from fast_inference.model import RMSNorm

    norm = RMSNorm(64)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    for dtype in (torch.float32, torch.bfloat16):
        n = norm.to(dtype)
        x = (torch.randn(5, 3, 64) * 3).to(dtype)
        xf = x.float()
        want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + n.eps)).to(dtype) * n.weight
        traced = []

        def record(gm, example_inputs):  # the ops dynamo traced, for inductor to fuse
            traced.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return gm

        compiled = torch.compile(n, backend=record, fullgraph=True)
        for got in (n(x), compiled(x)):
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, rtol=0 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
        assert traced and not any("rms_norm" in t for t in traced), traced  # the spelled-out branch


# SPEC section 1: name -> (head_dim, FFN hidden, layer_internal).
SPEC_TABLE = {
    "GPT-B": (64, 2048, 4), "GPT-L": (64, 2816, 8), "GPT-XL": (64, 3584, 12), "GPT-XXL": (64, 4096, 16),
    "GPT-XXXL": (64, 6912, 16), "GPT-1B": (64, 5632, 7), "GPT-3B": (100, 8704, 8), "GPT-7B": (128, 11008, 10),
}


@pytest.mark.parametrize("name", sorted(GPT_CONFIGS))
def test_named_configs(name):
    a = ModelArgs.from_name(name)
    assert (a.head_dim, a.ffn_hidden, a.layer_internal) == SPEC_TABLE[name]
    # The rule itself: two thirds of 4D, rounded up to a multiple of 256.
    assert a.ffn_hidden == 256 * math.ceil(int(2 * 4 * a.dim / 3) / 256)
    assert (a.vocab_size, a.rope_base, a.norm_eps, a.caption_dim, a.n_kv_head) == (16384, 10000, 1e-5, 2048, a.n_head)


def test_from_name_json(tmp_path):
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({"n_layer": 3, "n_head": 2, "dim": 64, "block_size": 16, "caption_dim": 32}))
    a = ModelArgs.from_name(str(cfg))
    assert (a.n_layer, a.n_head, a.dim, a.block_size, a.caption_dim, a.model_type) == (3, 2, 64, 16, 32, "t2i")
    b = ModelArgs.from_name(str(cfg), block_size=64, adapter_size=None)  # overrides win; None = keep
    assert (b.block_size, b.adapter_size) == (64, "small")
    model = meta_model(str(cfg))
    assert model.layers[0].feed_forward.w1.weight.shape == (256, 64)  # 2/3 * 256 = 170 -> 256


def test_from_name_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"n_layer": 3, "n_heads": 2}))
    with pytest.raises(ValueError, match=r"unknown model argument.*n_heads"):
        ModelArgs.from_name(str(bad))
    with pytest.raises(FileNotFoundError, match="not found"):
        ModelArgs.from_name(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown model 'GPT-XS'"):
        ModelArgs.from_name("GPT-XS")
    with pytest.raises(ValueError, match="perfect square"):
        ModelArgs.from_name("GPT-B", block_size=200)


@pytest.mark.parametrize("field,value,needle", [
    ("dim", 66, "dim 66 must split into n_head 2 heads of a multiple of 4"),
    ("dim", 68, "dim 68 must split into n_head 2 heads"),  # 34 per head: RoPE's quarters would not be whole
    ("n_head", 0, "n_head must be an integer >= 1"), ("dim", "64", "dim must be an integer >= 1, got '64'"),
    ("n_layer", 2.5, "n_layer must be an integer"), ("vocab_size", -1, "vocab_size must be an integer >= 1"),
    ("norm_eps", -1e-5, "norm_eps must be a positive number"), ("rope_base", float("nan"), "rope_base must be"),
    ("condition_token_num", -1, "condition_token_num must be an integer >= 0"),
    ("adapter_size", "large", "adapter_size must be small, base or tiny"), ("pos_interp", "v9", "pos_interp must be")])
def test_config_is_validated_up_front(field, value, needle):
    """A JSON config that would fail deep inside the model (or allocate absurdly) fails at ModelArgs."""
    with pytest.raises(ValueError) as e:
        ModelArgs(**{**dict(n_layer=3, n_head=2, dim=64, block_size=16), field: value})
    assert needle in str(e.value)
