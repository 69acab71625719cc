"""The demo set (scenes.py), its text encoder (demo_text.py) and its evaluation split (demo_set.py)."""
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT
from fast_inference import data, demo_set, demo_text, scenes
from fast_inference.text import TextError, load_caption_emb

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import eval_demo  # noqa: E402


def test_scenes_are_a_function_of_split_and_index():
    a, b = scenes.scenes(range(20), "val"), scenes.scenes(range(20), "val")
    assert [s.caption for s in a] == [s.caption for s in b]
    assert [s.caption for s in a] != [s.caption for s in scenes.scenes(range(20), "test")]
    for s in scenes.scenes(range(200)):
        assert 1 <= len(s.shapes) <= 3 and len({x.kind for x in s.shapes}) == len(s.shapes)
        colours = {x.colour for x in s.shapes}
        assert len(colours) == len(s.shapes) and not colours & {s.top, s.bottom}
        assert set(demo_text.words(s.caption)) <= set(scenes.VOCABULARY)
    assert scenes.caption(scenes.Scene([scenes.Shape("circle", "orange", .5, .5, .2, 0)], "blue", "white", .5)) == \
        "an orange circle on a blue and white background"


def test_render_paints_the_named_colours_where_the_shapes_are():
    batch = scenes.scenes(range(8), "test")
    rgb = scenes.render(batch, 128)
    label, inside = scenes.labels(batch, 128)
    assert rgb.shape == (8, 3, 128, 128) and rgb.dtype == torch.uint8
    for b, s in enumerate(batch):
        for k, shape in enumerate(s.shapes):
            deep = inside[b, k] & (torch.nn.functional.avg_pool2d(inside[b, k][None].float(), 5, 1, 2)[0] == 1)
            assert (rgb[b][:, deep].T == torch.tensor(scenes.PALETTE[shape.colour], dtype=torch.uint8)).all()
            assert (label[b][inside[b, k]] == 2 + scenes.KINDS.index(shape.kind)).all()
    # Geometry is in units of the side: the 256 px scene is the 128 px one, finer.
    small, big = scenes.labels(batch, 128)[0], scenes.labels(batch, 256)[0]
    assert (big[:, ::2, ::2] == small).float().mean() > 0.99


@pytest.mark.parametrize("kind", scenes.CONTROL_TYPES)
def test_control_maps(kind):
    batch = scenes.scenes(range(4), "val")
    c = scenes.control(batch, kind, 64)
    assert c.shape == (4, 3, 64, 64) and c.dtype == torch.uint8 and c.float().std() > 0
    if kind == "seg":
        assert {tuple(p) for p in c.permute(0, 2, 3, 1).reshape(-1, 3).tolist()} <= set(scenes.SEG_COLOURS)
    else:
        assert torch.equal(c[:, 0], c[:, 1]) and torch.equal(c[:, 0], c[:, 2])


def test_canny_is_opencvs():
    """scenes.canny (torch, any device) gives OpenCV's Canny(100, 200) pixels on scenes and on smoothed noise."""
    cv2 = pytest.importorskip("cv2")
    g = torch.Generator().manual_seed(0)
    noise = torch.nn.functional.avg_pool2d(torch.rand(2, 3, 48, 80, generator=g) * 255, 3, 1, 1).to(torch.uint8)
    for images in (scenes.render(scenes.scenes(range(6), "val"), 128), noise):
        ours = scenes.canny(images)
        for img, e in zip(images, ours):
            want = cv2.Canny(np.ascontiguousarray(img.permute(1, 2, 0).numpy()), 100, 200) == 255
            assert np.array_equal(e.numpy(), want)
        assert ours.any()


def test_demo_text_encoder():
    enc = demo_text.DemoTextEncoder(16, 12)
    emb, mask = enc.encode_left_padded(["A red circle.", "a blue square on a white background"])
    assert emb.shape == (2, 12, 16) and mask.tolist()[0] == [0] * 9 + [1] * 3
    assert (emb[0, :9] == 0).all() and (emb[0, 9:].abs().sum(-1) > 0).all()
    # A word's vector depends on the word before it: "circle" after "red" is not "circle" after "blue".
    other, _ = enc.encode_left_padded(["a blue circle"])
    assert torch.equal(emb[0, 9], other[0, 9]) and not torch.equal(emb[0, 11], other[0, 11])
    assert torch.equal(demo_text.DemoTextEncoder(16, 12).word, enc.word)  # seeded: the same on every run
    with pytest.raises(TextError, match="no 'dog'.* circle square triangle diamond"):
        enc.encode_left_padded(["a red dog"])
    with pytest.raises(TextError, match="at most 12"):
        enc.encode_left_padded(["a red circle " * 5])


def test_demo_split_is_the_official_layout(tmp_path):
    root = demo_set.write_split(str(tmp_path / "split"), [0, 5], 64, caption_dim=16)
    samples = data.official_samples(root, "canny")
    assert [s.name for s in samples] == ["000000", "000005"]
    s = scenes.scene(5, "test")
    emb, mask, prompt = load_caption_emb(os.path.join(root, "caption_emb", "5.npz"), cls_token_num=24)
    want, want_mask = demo_text.DemoTextEncoder(16, 24).encode_left_padded([s.caption])
    assert prompt == s.caption and torch.equal(emb, want) and torch.equal(mask, want_mask)
    img = np.array(Image.open(os.path.join(root, "image", "5.png")))
    assert np.array_equal(img, scenes.render([s], 64)[0].permute(1, 2, 0).numpy())
    for folder in ("control", "control_depth", "label"):
        assert Image.open(os.path.join(root, folder, "5.png")).size == (64, 64)


def test_colour_check_can_fail():
    """eval_demo's text check passes on the scenes themselves and fails once the shapes' colours are swapped."""
    batch = [s for s in scenes.scenes(range(40), "test") if len(s.shapes) >= 2][:6]
    rgb = scenes.render(batch, 128)
    assert all(ok for ok, _, bg in eval_demo.colour_checks(rgb, batch, 128))
    swapped = [scenes.Scene([scenes.Shape(x.kind, s.shapes[(k + 1) % len(s.shapes)].colour, x.cx, x.cy, x.r, x.layer)
                             for k, x in enumerate(s.shapes)], s.top, s.bottom, s.horizon) for s in batch]
    assert not any(ok for ok, _, _ in eval_demo.colour_checks(scenes.render(swapped, 128), batch, 128))
