# Control encoders: checkpoint key parity with the manifests, numerical parity with
# transformers 4.x Dinov2Model / ViTModel, to_patch14, and the pos-interp version switch.
import json
import os

import pytest
import torch
import torch.nn.functional as F

from fast_inference.dinov2 import DINOV2_CONFIGS, Dinov2Adapter, Dinov2Model, interp_pos_table, to_patch14
from fast_inference.vit import ViTAdapter

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def manifest_adapter_entries(name):
    with open(os.path.join(DATA, name)) as f:
        m = json.load(f)
    entries = [(k, list(s)) for k, s, _ in m["params"]]
    entries += [(k, list(s)) for k, s, _, in_sd in m["buffers"] if in_sd]
    return [e for e in entries if e[0].startswith("adapter.")]


def our_entries(module):
    return [("adapter." + k, list(v.shape)) for k, v in module.state_dict().items()]


@pytest.mark.parametrize("make,manifest", [
    (lambda: Dinov2Adapter("small"), "manifest_gpt_xl_t2i_small.json"),
    (lambda: Dinov2Adapter("base"), "manifest_gpt_xl_t2i_base.json"),
    (lambda: ViTAdapter(), "manifest_gpt_l_c2i.json"),
])
def test_state_dict_matches_manifest(make, manifest):
    with torch.device("meta"):  # shapes only, no allocation
        m = make()
    assert our_entries(m) == manifest_adapter_entries(manifest)


def randomize_(model, seed=0):
    # HF init leaves layer scales at 1 and biases at 0; randomise everything so every
    # parameter (incl. lambda1, biases and the position table) is exercised
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name or "lambda1" in name:
                p.copy_(1 + 0.1 * r)
            elif "position_embeddings" in name or "cls_token" in name:
                p.copy_(r)
            else:
                p.copy_(0.05 * r)


@pytest.fixture(scope="module")
def hf_dinov2_small():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Dinov2Config(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4, patch_size=14,
        image_size=518, num_channels=3, layerscale_value=1.0, layer_norm_eps=1e-6, hidden_act="gelu",
        qkv_bias=True, use_swiglu_ffn=False, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, apply_layernorm=True)
    cfg._attn_implementation = "eager"
    hf = transformers.Dinov2Model(cfg).eval()
    randomize_(hf)
    ours = Dinov2Model("small", pos_interp="v444").eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


@pytest.mark.parametrize("H,W", [(64, 64), (512, 512), (64, 112), (518, 518), (518, 532)])
def test_dinov2_matches_hf_444(hf_dinov2_small, H, W):
    hf, ours = hf_dinov2_small
    # 64/512/64x112 are to_patch14 outputs' sources (4x4, 32x32, 4x7 grids); 518 hits the
    # no-interpolation early-out, 518x532 (37x38) a near-identity resize
    x = torch.rand(2, 3, H, W, generator=torch.Generator().manual_seed(H * W)) * 2 - 1
    if H not in (518,):
        x = to_patch14(x, "hed")
    with torch.no_grad():
        ref = hf(pixel_values=x).last_hidden_state
        out = ours(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-5


def test_dinov2_adapter_drops_cls(hf_dinov2_small):
    hf, ours = hf_dinov2_small
    ad = Dinov2Adapter("small", condition_type="seg")
    ad.model.load_state_dict(ours.state_dict())
    x = torch.rand(1, 3, 80, 48) * 2 - 1
    with torch.no_grad():
        out = ad(x)
        ref = hf(pixel_values=to_patch14(x, "seg")).last_hidden_state[:, 1:]
    assert out.shape == (1, 5 * 3, 384) and ad.out_dim == 384
    assert (out - ref).abs().max().item() <= 1e-5
    assert Dinov2Adapter("base").out_dim == 768 == DINOV2_CONFIGS["base"]["hidden"]


def test_vit_matches_hf():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.ViTConfig(
        hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536,
        hidden_act="gelu", image_size=224, patch_size=16, num_channels=3, layer_norm_eps=1e-12,
        qkv_bias=True, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    hf = transformers.ViTModel(cfg).eval()  # add_pooling_layer=True, as in ControlAR
    randomize_(hf, seed=1)
    ad = ViTAdapter().eval()
    ad.model.load_state_dict(hf.state_dict(), strict=True)
    for H, W in [(256, 256), (224, 224), (256, 320)]:
        x = torch.rand(2, 3, H, W) * 2 - 1
        with torch.no_grad():
            ref = hf(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
            full = ad.model(x)
            out = ad(x)
        assert (full - ref).abs().max().item() <= 1e-5
        assert out.shape == (2, (H // 16) * (W // 16), 384)
        assert torch.equal(out, full[:, 1:])


@pytest.mark.parametrize("H,W", [(512, 512), (64, 64), (768, 512), (100, 70)])
@pytest.mark.parametrize("ctype", ["canny", "seg", "hed", "canny_base", "depth", "segmentation"])
def test_to_patch14(H, W, ctype):
    x = torch.rand(1, 3, H, W) * 2 - 1
    y = to_patch14(x, ctype)
    size = ((H // 16) * 14, (W // 16) * 14)
    assert y.shape[-2:] == size
    if ctype in ("canny", "seg"):
        ref = F.interpolate(x, size=size, mode="nearest")
    else:
        ref = F.interpolate(x, size=size, mode="bicubic", align_corners=True)
    assert torch.equal(y, ref)
    assert to_patch14(torch.zeros(1, 3, 512, 512), "hed").shape[-2:] == (448, 448)
    assert to_patch14(torch.zeros(1, 3, 64, 64), "canny").shape[-2:] == (56, 56)


@pytest.mark.parametrize("make", [lambda: Dinov2Model("small", "v444"), lambda: ViTAdapter().model])
def test_resized_position_table_is_made_again_when_the_table_or_size_changes(make):
    m = make().eval()
    randomize_(m, seed=3)
    table = m.embeddings.position_embeddings
    with torch.no_grad():
        first = m.pos_embed(448, 448)
        assert m.pos_embed(448, 448) is first  # made once per size and table
        table.mul_(2)  # an in-place write (a checkpoint's load): the table's version changes
        again = m.pos_embed(448, 448)
        assert m.pos_embed(448, 336).shape[1] < first.shape[1]  # another size
    assert torch.allclose(again[:, 1:], 2 * first[:, 1:], rtol=1e-2, atol=1e-4)
    assert torch.equal(again[:, 0], table[0, :1])


def test_to_patch14_modes_differ():
    x = torch.rand(1, 3, 64, 64)
    assert not torch.allclose(to_patch14(x, "canny"), to_patch14(x, "canny_base"))


def test_pos_interp_switch():
    table = torch.randn(1, 1 + 37 * 37, 16)
    a = interp_pos_table(table, 32, 32, "v444")
    b = interp_pos_table(table, 32, 32, "v445")
    assert a.shape == b.shape == (1, 1 + 32 * 32, 16)
    assert torch.equal(a[:, 0], table[:, 0]) and torch.equal(b[:, 0], table[:, 0])
    rel = ((a - b)[:, 1:].abs().mean() / b[:, 1:].abs().mean()).item()
    assert rel > 0.02  # materially different, not rounding noise
    grid = table[:, 1:].reshape(1, 37, 37, 16).permute(0, 3, 1, 2)
    ref = F.interpolate(grid, size=(32, 32), mode="bicubic", align_corners=False)
    assert torch.equal(b[:, 1:], ref.permute(0, 2, 3, 1).reshape(1, -1, 16))

    # through the model: same weights, non-37 grid -> different features; 37x37 -> identical
    m444 = Dinov2Model("small", "v444").eval()
    randomize_(m444, seed=2)
    m445 = Dinov2Model("small", "v445").eval()
    m445.load_state_dict(m444.state_dict())
    x = torch.rand(1, 3, 56, 84) * 2 - 1
    with torch.no_grad():
        assert (m444(x) - m445(x)).abs().max().item() > 1e-3
        assert torch.equal(m444.pos_embed(518, 518), m445.pos_embed(518, 518))
    with pytest.raises((ValueError, AssertionError)):
        Dinov2Model("small", "v446")
