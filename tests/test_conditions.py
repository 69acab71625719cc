"""Control-map extraction: annotator networks (key names, shapes, loading), per-type
preprocessing, drawn examples, and the one-line errors for user mistakes."""
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from fast_inference import conditions
from fast_inference.conditions import ConditionError, draw_example, extract_control, read_rgb, resize_to, write_examples
from fast_inference.hed import HED
from fast_inference.lineart import LineArt

# Official state dicts, read from ControlNetHED_Apache2 (ControlNetHED.pth) and ControlAR's
# condition/lineart.py LineArt (model.pth). "conv" rows stand for .weight (shape) and .bias
# (first dim; for ConvTranspose2d the second); "param" rows are bare parameters.
HED_TABLE = """
param norm 1 3 1 1
conv block1.convs.0 64 3 3 3
conv block1.convs.1 64 64 3 3
conv block1.projection 1 64 1 1
conv block2.convs.0 128 64 3 3
conv block2.convs.1 128 128 3 3
conv block2.projection 1 128 1 1
conv block3.convs.0 256 128 3 3
conv block3.convs.1 256 256 3 3
conv block3.convs.2 256 256 3 3
conv block3.projection 1 256 1 1
conv block4.convs.0 512 256 3 3
conv block4.convs.1 512 512 3 3
conv block4.convs.2 512 512 3 3
conv block4.projection 1 512 1 1
conv block5.convs.0 512 512 3 3
conv block5.convs.1 512 512 3 3
conv block5.convs.2 512 512 3 3
conv block5.projection 1 512 1 1
"""
LINEART_TABLE = """
conv model0.1 64 3 7 7
conv model1.0 128 64 3 3
conv model1.3 256 128 3 3
conv model2.0.conv_block.1 256 256 3 3
conv model2.0.conv_block.5 256 256 3 3
conv model2.1.conv_block.1 256 256 3 3
conv model2.1.conv_block.5 256 256 3 3
conv model2.2.conv_block.1 256 256 3 3
conv model2.2.conv_block.5 256 256 3 3
convT model3.0 256 128 3 3
convT model3.3 128 64 3 3
conv model4.1 1 64 7 7
"""


def expected(table):
    out = {}
    for line in table.strip().splitlines():
        kind, name, *dims = line.split()
        shape = tuple(int(d) for d in dims)
        if kind == "param":
            out[name] = shape
        else:
            out[name + ".weight"] = shape
            out[name + ".bias"] = (shape[1] if kind == "convT" else shape[0],)
    return out


def shapes(module):
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def rgb_image(H=64, W=64, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (H, W, 3), dtype=np.uint8)


def save_weights(module, path, dtype=None):
    sd = {k: (v.to(dtype) if dtype else v).clone() for k, v in module.state_dict().items()}
    torch.save(sd, path)
    return str(path)


# ------------------------------------------------------------------------------ networks

@pytest.mark.parametrize("cls,table,n_keys,n_params", [(HED, HED_TABLE, 37, 14_716_168),
                                                        (LineArt, LINEART_TABLE, 24, 4_290_945)])
def test_state_dict_matches_official(cls, table, n_keys, n_params):
    net = cls()
    assert shapes(net) == expected(table)
    assert list(net.state_dict()) == list(expected(table))  # same order as the official modules
    assert len(net.state_dict()) == n_keys
    assert sum(p.numel() for p in net.parameters()) == n_params


@pytest.mark.parametrize("cls", [HED, LineArt])
def test_loads_own_state_dict_weights_only(cls, tmp_path):
    torch.manual_seed(0)
    a, b = cls(), cls()
    path = save_weights(a, tmp_path / "w.pth")
    b.load_state_dict(torch.load(path, weights_only=True), strict=True)
    x = torch.rand(1, 3, 32, 32) * 255
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("cls", [HED, LineArt])
def test_output_shape_and_range(cls):
    torch.manual_seed(0)
    x = torch.from_numpy(rgb_image()).permute(2, 0, 1)[None]
    with torch.no_grad():
        y = cls()(x.float())
    assert y.shape == (1, 1, 64, 64) and y.dtype == torch.float32
    assert torch.isfinite(y).all() and y.min() >= 0 and y.max() <= 1


def test_hed_side_outputs_and_uint8_input():
    torch.manual_seed(0)
    net = HED()
    x = torch.from_numpy(rgb_image()).permute(2, 0, 1)[None]
    with torch.no_grad():
        sides = net.side_outputs(x)
        assert [s.shape[-1] for s in sides] == [64, 32, 16, 8, 4]
        assert torch.equal(net(x), net(x.float()))  # the official script feeds uint8


# ------------------------------------------------------------------------------ extraction

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # ControlNetHED.pth is fp16
def test_hed_extract_with_checkpoint(tmp_path, dtype):
    torch.manual_seed(0)
    net = HED()
    path = save_weights(net, tmp_path / "ControlNetHED.pth", dtype)
    net.load_state_dict({k: v.to(dtype).float() for k, v in net.state_dict().items()})
    rgb = rgb_image()
    c = extract_control(rgb, "hed", ckpt=path)
    assert c.shape == (3, 64, 64) and c.dtype == torch.float32
    assert torch.equal(c[0], c[1]) and torch.equal(c[0], c[2])
    with torch.no_grad():
        edge = net(torch.from_numpy(rgb).permute(2, 0, 1)[None].float())[0, 0]
    assert torch.equal(c[0], 2 * ((edge * 255).clamp(0, 255) / 255 - 0.5))


def test_lineart_inversion(tmp_path):
    torch.manual_seed(0)
    path = save_weights(LineArt(), tmp_path / "model.pth")
    rgb = rgb_image()
    inv = extract_control(rgb, "lineart", ckpt=path)  # sample_t2i: white lines on black
    raw = extract_control(rgb, "lineart", ckpt=path, invert_lineart=False)  # test_t2i
    assert inv.shape == raw.shape == (3, 64, 64)
    assert inv.min() >= -1 and inv.max() <= 1
    assert torch.allclose(inv, -raw, atol=1e-5)


def test_canny_equals_opencv():
    cv2 = pytest.importorskip("cv2")
    rgb = draw_example("seg", 64, 96)  # colour edges, so per-channel gradients matter
    c = extract_control(rgb, "canny")
    edges = cv2.Canny(rgb, 100, 200)
    assert c.shape == (3, 64, 96)
    assert set(c.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(c[0] > 0, torch.from_numpy(edges == 255))
    assert torch.equal(c[0], c[2])


def test_seg_and_is_map_round_trip():
    rgb = np.array([[[0, 255, 51], [204, 128, 1]]], dtype=np.uint8)  # (1, 2, 3)
    want = torch.from_numpy(2 * (rgb.astype(np.float32) / np.float32(255) - np.float32(0.5))).permute(2, 0, 1)
    for kind, is_map in [("seg", False), ("hed", True), ("depth", True), ("canny", True)]:
        c = extract_control(rgb, kind, is_map=is_map)
        assert c.dtype == torch.float32 and torch.equal(c, want)
    c = extract_control(rgb, "seg")
    assert c[0, 0, 0] == -1 and c[1, 0, 0] == 1 and abs(c[2, 0, 0] + 0.6) < 1e-6


def test_depth_with_tiny_dpt(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DPTConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                                 image_size=64, backbone_out_indices=[0, 1, 2, 3], neck_hidden_sizes=[8, 16, 32, 32],
                                 fusion_hidden_size=16)
    torch.manual_seed(0)
    model = transformers.DPTForDepthEstimation(cfg).eval()
    processor = transformers.DPTImageProcessor(image_mean=[0.5] * 3, image_std=[0.5] * 3)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    rgb = rgb_image()
    c = extract_control(rgb, "depth", ckpt=str(tmp_path))
    # The official steps: processor at the target size, predicted_depth * 255 / max.
    with torch.no_grad():
        d = model(**processor(images=Image.fromarray(rgb), return_tensors="pt", size=(64, 64))).predicted_depth
    assert c.shape == (3, 64, 64)
    assert torch.allclose(c[0], 2 * (d[0] * 255 / d.max() / 255 - 0.5), atol=1e-6)
    assert c.max() == 1.0
    raises_one_line("square", extract_control, rgb_image(64, 96), "depth", ckpt=str(tmp_path))
    raises_one_line("multiple of 32", extract_control, rgb_image(48, 48), "depth", ckpt=str(tmp_path))
    raises_one_line("--condition-ckpt", extract_control, rgb, "depth")
    raises_one_line("--condition-ckpt", extract_control, rgb, "depth", ckpt=str(tmp_path / "nope"))


def test_resize_to_is_pil_bicubic():
    rgb = rgb_image(40, 50)
    out = resize_to(rgb, 64, 32)
    assert out.shape == (64, 32, 3) and out.dtype == np.uint8
    assert np.array_equal(out, np.array(Image.fromarray(rgb).resize((32, 64), Image.BICUBIC)))


# ------------------------------------------------------------------------------ examples

@pytest.mark.parametrize("kind", conditions.CONDITION_TYPES)
def test_draw_example(kind):
    img = draw_example(kind, 48, 80, seed=1)
    assert img.shape == (48, 80, 3) and img.dtype == np.uint8
    assert img.min() < img.max()
    assert np.array_equal(img, draw_example(kind, 48, 80, seed=1))
    if kind == "canny":
        assert set(np.unique(img)) <= {0, 255}
    if kind == "seg":
        assert len(np.unique(img.reshape(-1, 3), axis=0)) < 16  # flat regions, no blending


def test_write_examples(tmp_path):
    paths = write_examples(str(tmp_path / "ex"), 32, 48)
    assert [os.path.basename(p) for p in paths] == [f"{k}.png" for k in conditions.CONDITION_TYPES]
    for p, kind in zip(paths, conditions.CONDITION_TYPES):
        assert np.array_equal(read_rgb(p), draw_example(kind, 32, 48))
    assert sorted(os.listdir(tmp_path / "ex")) == sorted(os.path.basename(p) for p in paths)  # no temp files


# ------------------------------------------------------------------------------ errors

def raises_one_line(match, fn, *args, **kw):
    with pytest.raises(ConditionError, match=match) as e:
        fn(*args, **kw)
    assert "\n" not in str(e.value)


def test_errors(tmp_path, monkeypatch):
    raises_one_line("--condition-path", read_rgb, str(tmp_path / "missing.png"))
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    raises_one_line("cannot read", read_rgb, str(bad))
    rgb = rgb_image(32, 32)
    raises_one_line("--condition-ckpt", extract_control, rgb, "hed")
    raises_one_line("--condition-ckpt", extract_control, rgb, "hed", ckpt=str(tmp_path / "nope.pth"))
    lineart_file = save_weights(LineArt(), tmp_path / "model.pth")
    raises_one_line("does not fit", extract_control, rgb, "hed", ckpt=lineart_file)
    raises_one_line("unknown condition type", extract_control, rgb, "sketch")
    raises_one_line("unknown condition type", draw_example, "sketch")
    raises_one_line("uint8", extract_control, rgb.astype(np.float32), "seg")
    with_opencv = extract_control(rgb, "canny")
    monkeypatch.setitem(sys.modules, "cv2", None)  # as if OpenCV were not installed: Canny in torch, the same map
    assert torch.equal(extract_control(rgb, "canny"), with_opencv)


def test_an_annotator_output_that_is_not_finite_is_refused(monkeypatch):
    """A depth map whose maximum is 0 (x 255 / 0) would feed NaN control tokens into sampling."""
    monkeypatch.setattr(conditions, "depth", lambda rgb, ckpt, device: torch.zeros(1, 32, 32) * 255 / 0.0)
    with pytest.raises(ConditionError, match="depth annotator gave NaN or infinite values.*--condition-is-map"):
        extract_control(np.zeros((32, 32, 3), np.uint8), "depth")


def test_read_size_reads_the_header_and_errors_name_the_fix(tmp_path):
    Image.new("RGB", (48, 32)).save(tmp_path / "a.png")
    assert conditions.read_size(str(tmp_path / "a.png")) == (32, 48)
    with pytest.raises(ConditionError, match="not found; fix line 3"):
        conditions.read_size(str(tmp_path / "b.png"), fix="fix line 3")
    (tmp_path / "c.png").write_bytes(b"no image")
    with pytest.raises(ConditionError, match="cannot read .*c.png as an image .*--condition-path"):
        read_rgb(str(tmp_path / "c.png"))
