"""The official measures on inputs with known answers, and metrics over an output folder."""
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from fast_inference import conditions, fast_eval, metrics
from fast_inference.hed import HED
from fast_inference.images import save_image


def smooth_pair():
    """Two deterministic 180x200 pairs (no RNG, so the reference values below stay valid)."""
    y, x = torch.meshgrid(torch.arange(180, dtype=torch.float64), torch.arange(200, dtype=torch.float64), indexing="ij")
    a = (torch.sin(x / 9) * torch.cos(y / 13) + 1) / 2
    b = (torch.sin(x / 9 + 0.4) * torch.cos(y / 12) + 1) / 2 * 0.9 + 0.1 * ((x + 2 * y) % 7 == 0)
    return torch.stack([a, a]).float()[:, None], torch.stack([b, a * 0.5 + 0.25]).float()[:, None]


def test_ms_ssim_matches_torchmetrics_reference_values():
    # Values printed by torchmetrics' multiscale_structural_similarity_index_measure(data_range=1.0):
    # 1.4.0 (what ControlAR's evaluation ran) and 1.9.0 (SSIM term no longer cropped, since 1.5).
    p, t = smooth_pair()
    assert torch.allclose(metrics.ms_ssim(p, t), torch.tensor([0.7247810, 0.8104925]), atol=2e-6)
    assert torch.allclose(metrics.ms_ssim(p, t, crop_ssim=False), torch.tensor([0.7223966, 0.8105007]), atol=2e-6)
    assert torch.allclose(metrics.ms_ssim(p, p), torch.ones(2), atol=1e-5)


def test_ms_ssim_matches_installed_torchmetrics():
    tm = pytest.importorskip("torchmetrics")
    from torchmetrics.functional.image import multiscale_structural_similarity_index_measure as reference

    old = tuple(int(v) for v in tm.__version__.split(".")[:2]) < (1, 5)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 2, 176, 190, generator=g)
    y = (x + 0.4 * torch.rand(3, 2, 176, 190, generator=g)).clip(0, 1)
    want = reference(y, x, data_range=1.0, reduction="none")
    assert torch.allclose(metrics.ms_ssim(y, x, crop_ssim=old), want, atol=1e-6)


def test_ms_ssim_refuses_small_images():
    with pytest.raises(ValueError, match="160x160"):
        metrics.ms_ssim(torch.rand(1, 1, 160, 400), torch.rand(1, 1, 160, 400))


def test_tolerant_f1_counts_edges_within_the_tolerance():
    """A line moved by 2 px: strict F1 0, F1 1 at tolerance 2 (Euclidean), 0 at 1.9; a diagonal step of (2, 2) is
    2.83 px away; half a line: every predicted pixel right, the
    target's found up to 3 px past the half's end."""
    line = np.zeros((32, 32), int)
    line[10, 4:28] = 1
    moved = np.roll(line, 2, axis=0)
    assert metrics.binary_f1(moved, line) == 0.0
    assert metrics.tolerant_f1(moved, line, 2) == 1.0 and metrics.tolerant_f1(moved, line, 1.9) == 0.0
    dot, diagonal = np.zeros((32, 32), int), np.zeros((32, 32), int)
    dot[10, 10] = diagonal[12, 12] = 1
    assert metrics.tolerant_f1(diagonal, dot, 2.8) == 0.0 and metrics.tolerant_f1(diagonal, dot, 2.9) == 1.0
    half = line.copy()
    half[10, 16:] = 0
    recall = 15 / 24  # the kept 12 px and the 3 px beyond their end
    assert metrics.tolerant_f1(half, line, 3) == pytest.approx(2 * recall / (1 + recall))
    assert metrics.tolerant_f1(np.zeros((8, 8)), np.zeros((8, 8)), 3) == 0.0


def test_f1_and_rmse_on_known_values():
    assert metrics.binary_f1([1, 1, 0, 0, 1], [1, 0, 1, 0, 1]) == pytest.approx(4 / 6)  # tp 2, fp 1, fn 1
    assert metrics.binary_f1([0, 0], [0, 0]) == 0.0
    assert metrics.binary_f1(np.eye(3), np.eye(3)) == 1.0
    assert metrics.rmse(np.zeros((4, 4)), np.full((4, 4), 3.0)) == pytest.approx(3.0)
    assert metrics.rmse([0.0, 0.0], [3.0, 4.0]) == pytest.approx(np.sqrt(12.5))


def test_ade20k_miou_reproduces_the_shift_and_ignore_quirks():
    pred = np.array([[0, 1, 1], [5, 1, 1], [149, 2, 9]])  # segmenter classes 0..149, become 1..150
    gt = np.array([[1, 1, 2], [0, 2, 2], [150, 3, 3]], dtype=np.uint8)  # 0 = ignore, 150 falls into it
    # Pairs (pred+1, gt): (1,1) (2,1) (2,2)x3 (3,3) (10,3); (6, ignore) and (150, 150) leave the table.
    # IoU: class 1 1/2, class 2 3/4, class 3 1/2; classes seen: 1, 2, 3 and 10 (prediction only).
    conf = metrics.seg_confusion(pred, gt, "ade20k")
    assert conf.shape == (151, 151) and conf.sum() == 9
    assert metrics.mean_iou(conf) == pytest.approx((0.5 + 0.75 + 0.5) / 4)


def test_cocostuff_miou_ignores_255_without_shift():
    pred = np.array([[0, 0, 5], [5, 170, 3]])
    gt = np.array([[0, 255, 5], [6, 170, 170]], dtype=np.uint8)
    # IoU: class 0 1, class 5 1/2, class 6 0, class 170 1/2; classes seen: 0, 3, 5, 6, 170.
    assert metrics.mean_iou(metrics.seg_confusion(pred, gt, "cocostuff")) == pytest.approx(2.0 / 5)


def write_outputs(sample_dir, images, annotations):
    for i, (im, ann) in enumerate(zip(images, annotations)):
        for sub, arr in (("visualization", im), ("annotations", ann)):
            os.makedirs(os.path.join(sample_dir, sub), exist_ok=True)
            Image.fromarray(arr).save(os.path.join(sample_dir, sub, f"{i:06d}.png"))


def test_canny_f1_over_a_folder_and_metrics_only_cli(tmp_path, capsys):
    rgb = [conditions.draw_example("seg", 64, 64, seed=s) for s in (0, 1)]
    edges = conditions.canny(rgb[0])
    # Image 0's annotation is its own canny map (F1 1); image 1's has no edge at all (F1 0).
    write_outputs(tmp_path, rgb, [np.repeat(edges[..., None], 3, 2), np.zeros((64, 64, 3), np.uint8)])
    fast_eval.main(["--metrics-only", "--sample-dir", str(tmp_path), "--condition-type", "canny", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "f1: 0.5000 (2 images)" in out and "fid: skipped" in out
    result = json.load(open(tmp_path / "metrics.json"))
    assert result["f1"] == 0.5 and result["num_images"] == 2 and "fid" in result["skipped"]


def test_seg_miou_from_a_pred_dir(tmp_path):
    gt = np.array([[1, 1, 2], [0, 2, 2], [150, 3, 3]], dtype=np.uint8)
    pred = np.array([[0, 1, 1], [5, 1, 1], [149, 2, 9]], dtype=np.uint8)
    write_outputs(tmp_path / "s", [np.zeros((3, 3, 3), np.uint8)] * 2, [gt, gt])
    (tmp_path / "pred").mkdir()
    Image.fromarray(pred).save(tmp_path / "pred" / "000000.png")  # 000001 has none: skipped, as official
    result = metrics.evaluate(str(tmp_path / "s"), "seg", pred_dir=str(tmp_path / "pred"))
    assert result["miou"] == pytest.approx(0.4375)
    assert "pred-dir" in metrics.evaluate(str(tmp_path / "s"), "seg")["skipped"]["miou"]


def test_measures_without_their_weights_are_skipped(tmp_path):
    write_outputs(tmp_path, [np.zeros((64, 64, 3), np.uint8)], [np.zeros((64, 64, 3), np.uint8)])
    for kind, metric in (("depth", "rmse"), ("hed", "ssim"), ("lineart", "ssim")):
        result = metrics.evaluate(str(tmp_path), kind)
        assert metric not in result and "--condition-ckpt" in result["skipped"][metric]
    with pytest.raises(FileNotFoundError, match="generate first"):
        metrics.evaluate(str(tmp_path / "nothing"), "canny")
    (tmp_path / "empty" / "visualization").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no finished samples"):
        metrics.evaluate(str(tmp_path / "empty"), "canny")


def test_hed_ssim_over_a_folder(tmp_path):
    """With (random) HED weights: annotations made by that HED from the same images score ~1."""
    torch.manual_seed(0)
    torch.save(HED().state_dict(), tmp_path / "hed.pth")
    rgb = [conditions.draw_example("seg", 176, 176, seed=s) for s in (0, 1)]
    sample_dir = tmp_path / "s"
    write_outputs(sample_dir, rgb, rgb)  # annotations overwritten below
    for i, im in enumerate(rgb):
        edge = conditions.extract_control(im, "hed", ckpt=str(tmp_path / "hed.pth"))
        save_image(edge[0], str(sample_dir / "annotations" / f"{i:06d}.png"))  # as fast_eval writes them
    result = metrics.evaluate(str(sample_dir), "hed", condition_ckpt=str(tmp_path / "hed.pth"))
    assert result["ssim"] > 0.99


def test_metrics_only_never_overwrites_what_the_folder_holds(tmp_path, capsys):
    """A metrics-only run refuses in one line, leaving metrics.json as it was: another --condition-type than the
    folder's samples, a metric measured before that it would skip, a folder a generation run is writing."""
    import subprocess
    import sys

    rgb = [conditions.draw_example("seg", 64, 64, seed=s) for s in (0, 1)]
    write_outputs(tmp_path, rgb, [np.zeros((64, 64, 3), np.uint8)] * 2)
    (tmp_path / "settings.json").write_text(json.dumps({"condition_type": "canny"}))
    before = {"condition_type": "canny", "num_images": 2, "skipped": {}, "f1": 0.5, "fid": 12.5}
    (tmp_path / "metrics.json").write_text(json.dumps(before))

    def refused(*extra):
        with pytest.raises(SystemExit) as e:
            fast_eval.main(["--metrics-only", "--sample-dir", str(tmp_path), "--device", "cpu", *extra])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
        assert json.load(open(tmp_path / "metrics.json")) == before
        return err

    err = refused("--condition-type", "hed")
    assert "holds canny samples" in err and "pass --condition-type canny" in err
    err = refused("--condition-type", "canny", "--fid-ref", str(tmp_path / "nowhere"))
    assert "holds fid 12.5000 measured before, which this run skips" in err and "move" in err
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.lockf(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert "is being written by another fast_eval.py run" in refused("--condition-type", "canny")
    finally:
        holder.kill()
        holder.wait()
