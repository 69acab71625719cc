"""The official ControlAR evaluation measures (SPEC 13.3), over a fast_eval output folder.

    <sample-dir>/visualization/{name}.png   generated images
    <sample-dir>/annotations/{name}.png     control maps (channel 0) / seg label maps

  hed, lineart  MS-SSIM between the annotator run on the generated image and the annotation
                (torchmetrics' definition, written out below; mean over batches of 16, as official)
  canny         binary F1 between Canny(generated) and the annotation, per image, mean
  depth         RMSE between DPT(generated) x255/max and the annotation, per image, mean
  seg           mIoU from predicted label maps (--pred-dir: the segmenter is not part of this
                project), with the official ADE20K shift / COCO-Stuff ignore conventions
  FID           clean-fid against the real images, when clean-fid and its Inception weights are
                on this machine
A measure that lacks its weights or library is skipped with a one-line reason.
"""
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from fast_inference.data import DataError

MS_SSIM_BETAS = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
SSIM_BATCH = 16  # the official scripts average per-batch MS-SSIM over batches of 16
# (number of classes, shift added to predictions, ground-truth id that means "ignore")
SEG_DATASETS = {"ade20k": (150, 1, 0), "cocostuff": (171, 0, 255)}
CLEANFID_WEIGHTS = "/tmp/inception-2015-12-05.pt"  # where clean-fid looks (it would download otherwise)


class Skipped(Exception):
    """A measure that cannot run here; the message says what it needs."""


# ---- MS-SSIM (torchmetrics MultiScaleStructuralSimilarityIndexMeasure defaults) -----------------

def gaussian_window(channels, sigma=1.5, dtype=torch.float32, device="cpu"):
    size = int(3.5 * sigma + 0.5) * 2 + 1  # 11 for sigma 1.5
    x = torch.arange((1 - size) / 2, (1 + size) / 2, 1, dtype=dtype, device=device)
    g = torch.exp(-((x / sigma) ** 2) / 2)
    g = (g / g.sum())[None]
    return (g.T @ g).expand(channels, 1, size, size)


def ssim_and_cs(x, y, data_range=1.0, k1=0.01, k2=0.03, crop_ssim=True):
    """Per-image mean SSIM and contrast-sensitivity, (B,) each: reflect padding, then the border
    of half a window cropped off the result again, as torchmetrics does. crop_ssim=False: SSIM
    averaged over the whole image, as torchmetrics >= 1.5 does (it still crops the contrast term);
    ControlAR (Oct 2024) predates that change."""
    window = gaussian_window(x.shape[1], dtype=x.dtype, device=x.device)
    pad = (window.shape[-1] - 1) // 2
    x, y = (F.pad(t, (pad,) * 4, mode="reflect") for t in (x, y))
    stats = F.conv2d(torch.cat([x, y, x * x, y * y, x * y]), window, groups=x.shape[1]).split(x.shape[0])
    mu_x, mu_y = stats[0], stats[1]
    var_x = (stats[2] - mu_x ** 2).clamp(min=0)
    var_y = (stats[3] - mu_y ** 2).clamp(min=0)
    cov = stats[4] - mu_x * mu_y
    c1, c2 = (k1 * data_range) ** 2, (k2 * data_range) ** 2
    upper, lower = 2 * cov + c2, var_x + var_y + c2
    ssim = ((2 * mu_x * mu_y + c1) * upper) / ((mu_x ** 2 + mu_y ** 2 + c1) * lower)
    cs = upper / lower
    crop = lambda t: t[..., pad:-pad, pad:-pad].flatten(1).mean(-1)
    return crop(ssim) if crop_ssim else ssim.flatten(1).mean(-1), crop(cs)


def ms_ssim(x, y, data_range=1.0, betas=MS_SSIM_BETAS, crop_ssim=True):
    """(B, C, H, W) pairs -> (B,) MS-SSIM with ReLU normalisation; H and W must exceed 160."""
    if min(x.shape[-2:]) // (len(betas) - 1) ** 2 <= 10:
        raise ValueError(f"MS-SSIM with {len(betas)} scales needs images larger than 160x160, got {tuple(x.shape[-2:])}")
    values = []
    for _ in betas:
        ssim, cs = (t.relu() for t in ssim_and_cs(x, y, data_range, crop_ssim=crop_ssim))
        values.append(cs)
        x, y = F.avg_pool2d(x, 2), F.avg_pool2d(y, 2)
    values[-1] = ssim  # the coarsest scale contributes its full SSIM
    weights = torch.tensor(betas, device=x.device).view(-1, 1)
    return (torch.stack(values) ** weights).prod(0)


# ---- per-image measures on known arrays -------------------------------------------------------

def binary_f1(pred, target):
    """F1 of two {0, 1} maps; 0 when neither has a positive (torchmetrics' zero_division)."""
    pred, target = np.asarray(pred).ravel() == 1, np.asarray(target).ravel() == 1
    tp = np.count_nonzero(pred & target)
    denom = 2 * tp + np.count_nonzero(pred & ~target) + np.count_nonzero(~pred & target)
    return 2 * tp / denom if denom else 0.0


def tolerant_f1(pred, target, tol):
    """Edge F1 with a distance tolerance, as edge benchmarks score (BSDS: tol = 0.0075 of the image diagonal): a
    predicted edge pixel counts as right within tol px (Euclidean) of a target one, and a target pixel as found
    within tol px of a predicted one. pred, target: {0, 1} maps (H, W); 0 when neither has a positive."""
    pred, target = (torch.as_tensor(np.asarray(m) == 1)[None, None].float() for m in (pred, target))
    r = int(tol)
    yy, xx = torch.meshgrid(torch.arange(-r, r + 1), torch.arange(-r, r + 1), indexing="ij")
    disk = ((yy**2 + xx**2) <= tol**2).float()[None, None]
    near = lambda m: F.conv2d(m, disk, padding=r) > 0
    hit_p, hit_t = (pred.bool() & near(target)).sum().item(), (target.bool() & near(pred)).sum().item()
    n_p, n_t = pred.sum().item(), target.sum().item()
    precision, recall = hit_p / n_p if n_p else 0.0, hit_t / n_t if n_t else 0.0
    return 2 * precision * recall / (precision + recall) if precision + recall else 0.0


def rmse(pred, target):
    return float(torch.sqrt(F.mse_loss(torch.as_tensor(pred).float(), torch.as_tensor(target).float())))


def seg_confusion(pred, gt, dataset="ade20k"):
    """Counts [pred, gt] of one image, (n+1, n+1). ADE20K: predictions 0..149 become 1..150 and
    ground truth 0 (ignore) becomes 150 -- so real class 150 lands in the ignore bucket too."""
    n, shift, ignore = SEG_DATASETS[dataset]
    pred = np.asarray(pred).astype(np.int64) + shift
    gt = np.asarray(gt).astype(np.int64)
    gt[gt == ignore] = n
    if pred.shape != gt.shape:
        raise DataError(f"predicted label map {pred.shape} and ground truth {gt.shape} differ in size")
    return np.bincount((n + 1) * pred.ravel() + gt.ravel(), minlength=(n + 1) ** 2).reshape(n + 1, n + 1)


def mean_iou(conf):
    """Official formula: IoU over classes 0..n-1 that occur in the ground truth, summed, divided
    by the number of classes present in ground truth OR prediction."""
    tp = conf.diagonal()[:-1].astype(np.float64)
    pos_gt = conf[:-1, :-1].sum(0).astype(np.float64)
    pos_pred = conf[:-1, :-1].sum(1).astype(np.float64)
    present = pos_gt > 0
    iou = tp[present] / (pos_gt + pos_pred - tp)[present]
    counted = np.count_nonzero(pos_gt + pos_pred > 0)
    return float(iou.sum() / counted) if counted else float("nan")


# ---- over an output folder --------------------------------------------------------------------

def output_names(sample_dir):
    """Stems with both a generated image and an annotation, sorted."""
    vis = os.path.join(sample_dir, "visualization")
    if not os.path.isdir(vis):
        raise FileNotFoundError(f"{vis} not found; generate first (or pass the right --sample-dir)")
    names = sorted(f[:-4] for f in os.listdir(vis) if f.endswith(".png") and not f.startswith("."))
    names = [n for n in names if os.path.isfile(os.path.join(sample_dir, "annotations", n + ".png"))]
    if not names:
        raise FileNotFoundError(f"no finished samples in {sample_dir}")
    return names


def read_png(path):
    with Image.open(path) as im:
        return np.array(im)


def pairs(sample_dir, names):
    """(generated RGB uint8, annotation channel 0 as uint8) for each name."""
    for n in names:
        ann = read_png(os.path.join(sample_dir, "annotations", n + ".png"))
        yield read_png(os.path.join(sample_dir, "visualization", n + ".png"))[..., :3], ann if ann.ndim == 2 else ann[..., 0]


@torch.no_grad()
def edge_ssim(sample_dir, names, kind, ckpt, device):
    from fast_inference.conditions import ConditionError, load_annotator

    if ckpt is None:
        raise Skipped(f"needs the {kind} annotator weights: pass --condition-ckpt")
    try:
        net = load_annotator(kind, ckpt, torch.device(device))
    except ConditionError as e:
        raise Skipped(str(e)) from None
    items, scores = list(pairs(sample_dir, names)), []
    for i in range(0, len(items), SSIM_BATCH):
        images = torch.from_numpy(np.stack([im for im, _ in items[i:i + SSIM_BATCH]])).permute(0, 3, 1, 2).to(device)
        ann = torch.from_numpy(np.stack([a for _, a in items[i:i + SSIM_BATCH]]))[:, None].to(device).float()
        pred = net(images.float()) * 255  # (B, 1, H, W), as the official detectors return it
        if kind == "hed":
            pred = pred.clamp(0, 255)
        try:
            scores.append(ms_ssim((pred / 255).clip(0, 1), (ann / 255).clip(0, 1)).mean())
        except ValueError as e:  # too small for five scales
            raise Skipped(str(e)) from None
    return torch.stack(scores).mean().item()


def canny_f1(sample_dir, names):
    from fast_inference.conditions import canny

    return float(np.mean([binary_f1(canny(np.ascontiguousarray(im)) == 255, ann == 255)
                          for im, ann in pairs(sample_dir, names)]))


@torch.no_grad()
def depth_rmse(sample_dir, names, ckpt, device):
    from fast_inference.conditions import ConditionError, depth

    if ckpt is None:
        raise Skipped("needs DPT weights: pass --condition-ckpt with a local Intel/dpt-large folder")
    try:
        return float(np.mean([rmse(depth(np.ascontiguousarray(im), ckpt, device)[0].cpu(), ann)
                              for im, ann in pairs(sample_dir, names)]))
    except ConditionError as e:
        raise Skipped(str(e)) from None


def seg_miou(sample_dir, names, pred_dir, dataset):
    if pred_dir is None:
        raise Skipped("needs the segmenter's label maps: run it on visualization/ and pass --pred-dir "
                      "(one {name}.png of class ids per image)")
    n = SEG_DATASETS[dataset][0]
    conf = np.zeros((n + 1, n + 1), dtype=np.int64)
    used = 0
    for name in names:
        pred = os.path.join(pred_dir, name + ".png")
        if not os.path.isfile(pred):
            continue  # as the COCO-Stuff script skips images whose inference failed
        try:
            conf += seg_confusion(read_png(pred), read_png(os.path.join(sample_dir, "annotations", name + ".png")), dataset)
        except DataError as e:
            raise DataError(f"{pred}: {e}") from None
        used += 1
    if not used:
        raise Skipped(f"no predicted label maps for these samples in {pred_dir}")
    return mean_iou(conf)


def clean_fid(sample_dir, ref_dir):
    try:
        from cleanfid import fid
    except ImportError:
        raise Skipped("needs clean-fid: pip install clean-fid") from None
    if not os.path.isfile(CLEANFID_WEIGHTS):
        raise Skipped(f"needs clean-fid's Inception weights at {CLEANFID_WEIGHTS} (no downloads here)")
    if ref_dir is None or not os.path.isdir(ref_dir):
        raise Skipped("needs the real images: --data-path with image/, or --fid-ref DIR")
    return float(fid.compute_fid(os.path.join(sample_dir, "visualization"), ref_dir))


CONTROL_METRIC = {"hed": "ssim", "lineart": "ssim", "canny": "f1", "depth": "rmse", "seg": "miou"}


def evaluate(sample_dir, condition_type, device="cpu", condition_ckpt=None, pred_dir=None, seg_dataset="ade20k",
             fid_ref=None, keep_measured=False):
    """Run the measures of this condition type and FID; print them and write metrics.json (keep_measured: never
    replacing a metric measured before on the same images with a skip, check_kept)."""
    names = output_names(sample_dir)
    control = CONTROL_METRIC[condition_type]
    runs = {
        "ssim": lambda: edge_ssim(sample_dir, names, condition_type, condition_ckpt, device),
        "f1": lambda: canny_f1(sample_dir, names),
        "rmse": lambda: depth_rmse(sample_dir, names, condition_ckpt, device),
        "miou": lambda: seg_miou(sample_dir, names, pred_dir, seg_dataset),
    }
    result = {"condition_type": condition_type, "num_images": len(names), "skipped": {}}
    for metric, fn in ((control, runs[control]), ("fid", lambda: clean_fid(sample_dir, fid_ref))):
        try:
            result[metric] = fn()
            print(f"{metric}: {result[metric]:.4f} ({len(names)} images)")
        except Skipped as e:
            result["skipped"][metric] = str(e)
            print(f"{metric}: skipped, {e}")
    if keep_measured:
        check_kept(os.path.join(sample_dir, "metrics.json"), result)
    write_json(result, os.path.join(sample_dir, "metrics.json"))
    return result


def check_kept(path, result):
    """Refuse to replace a metric measured before on the same images with a skip (what it needs was not given)."""
    try:
        with open(path) as f:
            before = json.load(f)
    except (OSError, ValueError):
        return
    if (before.get("condition_type"), before.get("num_images")) != (result["condition_type"], result["num_images"]):
        return  # other images: the old values no longer hold
    for metric, reason in result["skipped"].items():
        if isinstance(before.get(metric), (int, float)):
            raise DataError(f"{path} holds {metric} {before[metric]:.4f} measured before, which this run skips "
                            f"({reason}); give it what it needs, or move {path} away to replace it")


def write_json(obj, path):
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, path)
