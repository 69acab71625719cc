"""tools/demo_colour_trace.py: its token classes partition the codebook as documented, its colour table reads the
VQ's codes, and a traced sample's distributions are the ones its tokens were drawn from (the shipped CPU demo)."""
import os
import sys

import pytest
import torch

from conftest import ROOT
from fast_inference import scenes

sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import demo_colour_trace as trace  # noqa: E402
import eval_demo  # noqa: E402
import train_demo  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEMO = os.path.join(ROOT, "checkpoints", "demo")
RED, BLUE, GREEN, WHITE, BLACK = (scenes.COLOURS.index(c) for c in ("red", "blue", "green", "white", "black"))


def test_classes_of_shape():
    """A red shape among a blue one on white: codes showing red are named (even beside blue), blue alone a swap,
    green other, white (or too little of a colour) background only; every code in exactly one class."""
    shares = torch.zeros(6, len(scenes.COLOURS))
    shares[0, RED] = 1
    shares[1, [RED, BLUE]] = 0.5
    shares[2, [BLUE, WHITE]] = 0.5
    shares[3, [GREEN, WHITE]] = 0.5
    shares[4, WHITE] = 1
    shares[5, [WHITE, RED]] = torch.tensor([1 - trace.SHOW / 2, trace.SHOW / 2])
    masks = trace.classes_of_shape(shares, RED, [RED, BLUE], {WHITE})
    assert masks.sum(0).tolist() == [1] * 6
    assert [trace.CLASSES[int(i)] for i in masks.float().argmax(0)] == ["named", "named", "swap", "other", "bg", "bg"]
    # a black background is background only for a black-background scene
    assert trace.classes_of_shape(shares, RED, [RED], {BLACK})[:, 4].tolist() == [False, False, True, False]


@pytest.fixture(scope="module")
def demo():
    margs = eval_demo.parse_args(["--gpt-model", os.path.join(DEMO, "gpt.json"), "--gpt-ckpt",
                                  os.path.join(DEMO, "gpt.safetensors"), "--vq-model", os.path.join(DEMO, "vq.json"),
                                  "--vq-ckpt", os.path.join(DEMO, "vq.safetensors"), "--device", "cpu"]).model
    device, _, backend, model, size, vq = eval_demo.load(margs)
    return margs, device, backend, model, size, vq


def test_code_shares(demo, tmp_path):
    """Each used code's shares sum to 1; the top-left token of a plain scene is its top colour; the cache reloads."""
    _, device, _, _, size, vq = demo
    cache = str(tmp_path / "shares.pt")
    shares = trace.code_shares(vq, size, device, n=4, cache=cache)
    used = shares.sum(1) > 0
    assert used.any() and torch.allclose(shares[used].sum(1), torch.ones(int(used.sum())))
    s = scenes.scenes(range(1), "train")
    first = int(vq.encode(scenes.to_model_range(scenes.render(s, size)).to(device))[0, 0])
    assert shares[first, scenes.COLOURS.index(s[0].top)] > 0.5
    assert torch.equal(trace.code_shares(vq, size, device, n=0, cache=cache), shares)


def test_trace_records_the_drawing_distribution(demo, tmp_path):
    """Every token drawn has mass under the traced (CFG-merged, top-k filtered) distribution, which sums to 1 over
    the classes at each position; with top-k 1 the drawn token holds all of it (the logits are the sampler's); the
    teacher-forced contexts' distributions too."""
    margs, device, backend, model, size, vq = demo
    cache = str(tmp_path / "shares.pt")
    trace.code_shares(vq, size, device, n=4, cache=cache)
    batch = [s for s in scenes.scenes(range(8), "test") if len(s.shapes) >= 2][:2]
    engine = eval_demo.make_engine(margs, model, backend)
    shapes, backgrounds, images = trace.trace(model, engine, vq, margs, batch, size, device, cache)
    assert len(shapes) == sum(len(s.shapes) for s in batch) and len(backgrounds) == 2
    for r in shapes:
        assert r["mass"] and all(abs(sum(m) - 1) < 1e-4 for m in r["mass"].values())
        assert all(p > 0 for p in r["p_drawn"].values())
        assert r["right"] == (r["final"] == r["named"])
    text, summary = trace.report(shapes, backgrounds)
    assert "| onset" in text and 0 <= summary["shapes_right"] <= 1
    forced = trace.teacher_forced(model, vq, margs, batch, size, device, cache)
    assert len(forced) == 5 and all(abs(sum(m) - 1) < 1e-4 for v in list(forced.values())[1:] for m in v.values())
    # hiding the tokens before the onset leaves e1's context after the onset as it was; before e1, it changes
    hidden = forced["tokens before the onset without the shape"]
    assert hidden["onset"] == pytest.approx(forced["tokens before e1 without the shape"]["onset"], abs=1e-5)
    assert hidden["e1"] != pytest.approx(forced["tokens before e1 without the shape"]["e1"], abs=1e-5)
    margs.top_k = 1
    shapes, _, _ = trace.trace(model, engine, vq, margs, batch, size, device, cache)
    assert all(abs(p - 1) < 1e-4 for r in shapes for p in r["p_drawn"].values())
