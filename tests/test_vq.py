"""VQ-16 tokenizer vs the official manifest and fixtures; PNG saving vs torchvision's rules."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import DATA
from fast_inference import images
from fast_inference.images import make_grid, save_image, save_png_uint8, to_uint8
from fast_inference.vq import AttnBlock, GroupNorm, VQ_models, VQConfig, VQModel
from weights import recipe_state_dict

FIXTURES = json.load(open(os.path.join(DATA, "fixtures.json")))


@pytest.fixture(scope="module")
def vq():
    m = VQModel().eval()
    m.load_state_dict(recipe_state_dict(m))
    return m


# ----------------------------------------------------------------------------- VQ model

def test_state_dict_matches_manifest():
    man = json.load(open(os.path.join(DATA, "manifest_vq16.json")))
    m = VQ_models["VQ-16"]()
    want = {k: (tuple(s), d) for k, s, d in man["params"]}
    want.update({k: (tuple(s), d) for k, s, d, in_sd in man["buffers"] if in_sd})
    got = {k: (tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in m.state_dict().items()}
    assert got == want
    assert len(got) == man["state_dict_num_keys"] == 344
    assert [k for k, _ in m.named_parameters()] == [p[0] for p in man["params"]]
    assert sum(p.numel() for p in m.parameters()) == man["total_params"]
    dec = sum(p.numel() for n, p in m.named_parameters()
              if n.startswith(("decoder.", "post_quant_conv.", "quantize.")))
    assert dec == man["decode_path_params"]


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_decode_matches_official(vq, name):
    f = load_file(os.path.join(DATA, f"{name}.safetensors"))
    tokens, side = f["tokens"], FIXTURES[name]["image_size"] // 16
    assert tokens.tolist() == FIXTURES[name]["tokens"]
    out = vq.decode_code(tokens, (tokens.shape[0], 8, side, side))
    assert out.dtype == torch.float32 and out.shape == f["images"].shape
    assert (out - f["images"]).abs().max().item() <= 1e-4


def test_decode_chunking_is_exact(vq):
    f = load_file(os.path.join(DATA, "tiny_cfg4_hed.safetensors"))
    full = vq.decode_code(f["tokens"], (2, 8, 4, 4))
    old, vq.max_decode_pixels = vq.max_decode_pixels, 1  # forces one image per chunk
    try:
        chunked = vq.decode_code(f["tokens"], (2, 8, 4, 4))
    finally:
        vq.max_decode_pixels = old
    torch.testing.assert_close(chunked, full, rtol=0, atol=1e-5)


def test_decoder_convolutions_stay_channels_last(vq):
    """The decoder's convolutions keep channels-last weights through loading (no per-call transposes),
    and decode_code still returns a contiguous NCHW image."""
    convs = [m for m in vq.decoder.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) > 30 and all(m.weight.is_contiguous(memory_format=torch.channels_last) for m in convs)
    out = vq.decode_code(torch.zeros(1, 4, dtype=torch.long), (1, 8, 2, 2))
    assert out.shape == (1, 3, 32, 32) and out.is_contiguous()


@pytest.mark.parametrize("shape", [(1, 128, 24, 20), (3, 64, 5, 7)])
def test_group_norm_equals_torch(shape):
    """The var_mean GroupNorm against nn.GroupNorm: per (image, group) statistics, per channel affine."""
    torch.manual_seed(0)
    ours, ref = GroupNorm(32, shape[1], eps=1e-6), torch.nn.GroupNorm(32, shape[1], eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_(), ours.bias.normal_()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(shape) * torch.rand(shape[0], shape[1], 1, 1) * 4 + torch.randn(shape[0], shape[1], 1, 1)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-5)


def test_attention_equals_explicit_softmax():
    torch.manual_seed(0)
    blk = AttnBlock(64)
    x = torch.randn(2, 64, 5, 3)
    hn = blk.norm(x)
    q, k, v = (m(hn).flatten(2) for m in (blk.q, blk.k, blk.v))  # (b, c, hw)
    w = torch.softmax(q.transpose(1, 2) @ k * 64 ** -0.5, dim=-1)  # (b, hw_q, hw_k)
    ref = x + blk.proj_out((v @ w.transpose(1, 2)).reshape(x.shape))
    torch.testing.assert_close(blk(x), ref, rtol=0, atol=1e-5)


def test_nearest_inverts_lookup(vq):
    # codebook rows placed on a grid come back as the same raster-order indices
    idx = torch.randint(0, 16384, (2, 12), generator=torch.Generator().manual_seed(1))
    z = vq.quantize.lookup(idx, (2, 8, 3, 4))
    assert torch.equal(vq.quantize.nearest(z * 3.0), idx)  # scale-free: l2-normalised distance
    assert vq.encode(torch.zeros(1, 3, 32, 48)).shape == (1, 6)


# ----------------------------------------------------------------------------- images

def ref_uint8(x):
    """Independent numpy float32 version of torchvision's normalize + mul/add/clamp/truncate."""
    y = ((np.clip(np.float32(x), -1, 1) + np.float32(1)) / np.float32(2)).astype(np.float32)
    return np.clip(y * np.float32(255) + np.float32(0.5), 0, 255).astype(np.uint8)


def test_to_uint8_rounding_and_clamping():
    x = torch.tensor([-3.0, -1.0, 0.0, 1.0, 2.5, 2 * 10.6 / 255 - 1, 2 * 10.4 / 255 - 1])
    u = to_uint8(x.view(1, 1, 7).expand(3, 1, 7))
    assert u.shape == (1, 7, 3)
    # 0 -> 127.5 rounds half UP to 128 (truncation would give 127); 10.6 -> 11, 10.4 -> 10
    assert u[0, :, 0].tolist() == [0, 0, 128, 255, 255, 11, 10]
    # every float32 input that lands exactly on k + 0.5 goes to k + 1
    xs = torch.linspace(-1, 1, 200001)
    v = ((xs.clamp(-1, 1) + 1) / 2 * 255).numpy()
    half = v - np.floor(v) == 0.5
    assert half.sum() > 0
    got = to_uint8(xs.view(1, 1, -1).expand(3, 1, -1))[0, :, 0]
    assert (got[half] == np.floor(v[half]) + 1).all()
    assert (got == ref_uint8(xs.numpy())).all()


def test_to_uint8_shapes_and_grey():
    x = torch.rand(2, 3, 4, 5) * 2 - 1
    assert to_uint8(x).shape == (2, 4, 5, 3) and to_uint8(x[0]).shape == (4, 5, 3)
    g = to_uint8(torch.rand(4, 5) * 2 - 1)
    assert g.shape == (4, 5, 3) and (g[..., 0] == g[..., 1]).all() and (g[..., 1] == g[..., 2]).all()
    assert (to_uint8(torch.zeros(1, 4, 5)) == 128).all()  # 1-channel 3-D input too


def hand_grid(x, nrow, pad, fill):
    b, c, h, w = x.shape
    cols = min(nrow, b)
    rows = -(-b // cols)
    g = np.full((c, rows * (h + pad) + pad, cols * (w + pad) + pad), fill, np.float32)
    for k in range(b):
        r, cl = divmod(k, cols)
        g[:, pad + r * (h + pad):pad + r * (h + pad) + h, pad + cl * (w + pad):pad + cl * (w + pad) + w] = x[k]
    return g


@pytest.mark.parametrize("b,nrow,pad", [(5, 3, 2), (3, 8, 2), (4, 2, 0), (7, 4, 1), (8, 8, 2)])
def test_make_grid_layout(b, nrow, pad):
    x = torch.rand(b, 3, 4, 6)
    g = make_grid(x, nrow=nrow, padding=pad, pad_value=0.25)
    cols = min(nrow, b)
    rows = -(-b // cols)
    assert g.shape == (3, rows * (4 + pad) + pad, cols * (6 + pad) + pad)
    np.testing.assert_array_equal(g.numpy(), hand_grid(x.numpy(), nrow, pad, 0.25))


def test_make_grid_single_and_grey():
    x = torch.rand(1, 3, 4, 6)
    assert torch.equal(make_grid(x), x[0])  # torchvision returns a lone image unpadded
    g = make_grid(torch.rand(2, 1, 4, 6), nrow=2, padding=1)
    assert g.shape == (3, 6, 15) and torch.equal(g[0], g[2])


def test_save_image_roundtrip(tmp_path):
    x = torch.rand(3, 3, 4, 6) * 2.4 - 1.2
    path = tmp_path / "a" / "b" / "grid.png"
    save_image(x, path, nrow=2, padding=2)
    im = Image.open(path)
    assert im.mode == "RGB"
    want = hand_grid(np.moveaxis(to_uint8(x), -1, 1), 2, 2, 0).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(im), np.moveaxis(want, 0, -1))
    # single image / 2-D grey
    save_image(x[0], tmp_path / "one.png")
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "one.png")), to_uint8(x[0]))
    save_image(x[0, 0], tmp_path / "grey.png")
    gi = Image.open(tmp_path / "grey.png")
    assert gi.mode == "RGB" and np.asarray(gi).shape == (4, 6, 3)
    lab = np.arange(24, dtype=np.uint8).reshape(4, 6) * 10
    save_png_uint8(lab, tmp_path / "lab" / "l.png")
    li = Image.open(tmp_path / "lab" / "l.png")
    assert li.mode == "L" and np.array_equal(np.asarray(li), lab)
    names = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert names == ["grey.png", "grid.png", "l.png", "one.png"]  # no temp files left


def test_atomic_write_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "x.png"
    save_image(torch.zeros(3, 2, 2), path)
    before = path.read_bytes()

    def boom(self, fp, *a, **k):
        fp.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(images.Image.Image, "save", boom)
    with pytest.raises(OSError):
        save_image(torch.ones(3, 2, 2), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.png"]


def test_vq_json_config(tmp_path):
    """--vq-model FILE.json: VQConfig fields, or the official ModelArgs' names (ch_mult twice, training fields);
    the default norm_groups keeps the official module; a narrow VQ keeps 4 channels per group with norm_groups."""
    path = tmp_path / "vq.json"
    path.write_text(json.dumps(dict(codebook_size=64, encoder_ch_mult=[1, 1, 2, 2, 4], decoder_ch_mult=[1, 1, 2, 2, 4],
                                    commit_loss_beta=0.25, codebook_show_usage=True)))
    cfg = VQConfig.from_json(str(path), codebook_embed_dim=None)
    assert (cfg.codebook_size, cfg.ch_mult, cfg.ch, cfg.norm_groups) == (64, (1, 1, 2, 2, 4), 128, 32)
    assert str(VQModel(cfg)) == str(VQ_models["VQ-16"](codebook_size=64))
    narrow = VQModel(VQConfig(ch=32, z_channels=64, norm_groups=8))
    assert {m.num_groups for m in narrow.modules() if isinstance(m, torch.nn.GroupNorm)} == {8}
    path.write_text(json.dumps(dict(encoder_ch_mult=[1, 2], decoder_ch_mult=[1, 1])))
    with pytest.raises(ValueError, match="encoder_ch_mult"):
        VQConfig.from_json(str(path))
    with pytest.raises(ValueError, match="multiples of norm_groups 32"):
        VQConfig(ch=16)
