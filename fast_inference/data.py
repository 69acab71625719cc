"""Validation samples for fast_eval.py: where they come from and how one is read.

Two sources, both turned into a list of `Sample`s:
  the official extracted layout (SPEC 13.1), one file per sample, stem = dataset index:
      image/{i}.png          the RGB image (canny/hed/lineart controls are extracted from it)
      control/{i}.png        seg: the colour-coded map, used as is
      control_depth/{i}.png  depth: the precomputed depth map, used as is
      caption_emb/{i}.npz    'caption_emb' (1, v, C) and 'prompt'
      label/{i}.png          seg: class-index map (the annotation the official script saves)
      code/{i}.npy           VQ codes (training only; not read)
  a JSONL manifest, one object per line, paths relative to the manifest:
      {"id": 7, "control": "c/7.png", "caption_emb": "e/7.npz"}  or  {..., "prompt": "a cat"}
      optional: "class_label" (c2i), "label" (seg ground truth)
      The paths must stay inside the manifest's folder (symlinks resolved), unless the reader allows any
      (fast_eval.py --allow-outside-paths): a manifest from elsewhere cannot make us open /etc or ../../.

`read_sample` runs in DataLoader workers: CPU only, returns plain arrays, and reports a bad
file as an error string (a worker's exception would arrive as a multi-line traceback).
"""
import json
import os
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np
from PIL import Image

from fast_inference import conditions, text


class DataError(ValueError):
    """A problem with the validation data; the message names the file and the fix."""


@dataclass
class Sample:
    name: str  # output file stem: {index:06d} for integer ids, the id itself otherwise
    source: str  # the control image, or the image the control is extracted from
    is_map: bool  # source already is the control map (only rescaled to [-1, 1])
    caption: Optional[str] = None  # caption .npz
    prompt: Optional[str] = None
    label: Optional[str] = None  # seg class-index PNG, saved raw as the annotation
    class_label: Optional[int] = None
    fix: Optional[str] = None  # what a user fixes when one of its files is missing or unreadable


def output_name(sample_id):
    if isinstance(sample_id, int) or (isinstance(sample_id, str) and sample_id.isdigit()):
        return f"{int(sample_id):06d}"
    if not isinstance(sample_id, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", sample_id):
        raise DataError(f"sample id {sample_id!r} cannot name a file; use integers or [A-Za-z0-9._-] strings")
    return sample_id


def official_samples(root, condition_type, is_map=False):
    """Samples of an extracted validation folder, sorted by their integer index."""
    if not os.path.isdir(root):
        raise DataError(f"--data-path {root} is not a folder; pass the extracted validation split "
                        "(with image/, caption_emb/, control/ or control_depth/)")
    caption_dir = os.path.join(root, "caption_emb")
    stems = sorted(int(f[:-4]) for f in listdir(caption_dir) if f.endswith(".npz") and f[:-4].isdigit())
    if not stems:
        raise DataError(f"no caption_emb/<i>.npz files in {root}; is this an extracted split (extract_file_*.py)?")
    # seg and depth ship their maps; edge controls come from the image unless control/ holds ready maps.
    folder = {"seg": "control", "depth": "control_depth"}.get(condition_type, "control" if is_map else "image")
    samples = []
    for i in stems:
        source = os.path.join(root, folder, f"{i}.png")
        if not os.path.isfile(source):
            raise DataError(f"{source} is missing (caption_emb/{i}.npz exists); the {condition_type} "
                            f"control needs {folder}/<i>.png for every sample")
        label = os.path.join(root, "label", f"{i}.png")
        samples.append(Sample(name=f"{i:06d}", source=source, is_map=folder != "image",
                              caption=os.path.join(caption_dir, f"{i}.npz"),
                              label=label if condition_type == "seg" and os.path.isfile(label) else None,
                              fix=f"replace it in the --data-path split {root}"))
    return samples


def manifest_samples(path, condition_type, is_map=False, anywhere=False):
    """Samples of a JSONL manifest, in file order; anywhere: its paths may leave its folder."""
    if not os.path.isfile(path):
        raise DataError(f"--manifest {path} not found; pass a .jsonl file with one sample per line")
    base = os.path.dirname(os.path.abspath(path))
    samples, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or "id" not in row or "control" not in row:
                raise DataError(f"{path}:{n}: each line needs at least \"id\" and \"control\"")
            name = output_name(row["id"])
            if name in seen:
                raise DataError(f"{path}:{n}: duplicate id {row['id']!r}")
            seen.add(name)
            label = row.get("class_label")
            if label is not None and not isinstance(label, int):
                raise DataError(f"{path}:{n}: class_label must be an integer")
            where = f"{path}:{n}"
            paths = {k: manifest_path(row.get(k), k, base, where, anywhere) for k in ("control", "caption_emb", "label")}
            samples.append(Sample(name=name, source=paths["control"], is_map=is_map or condition_type == "seg",
                                  caption=paths["caption_emb"], prompt=row.get("prompt"), label=paths["label"],
                                  class_label=label, fix=f"fix line {n} of --manifest {path}"))
    if not samples:
        raise DataError(f"--manifest {path} has no samples")
    return samples


def manifest_path(p, key, base, where, anywhere):
    """A manifest's path, relative to its folder base; one that leaves base (absolute, ../, a symlink out) only
    if anywhere."""
    if p is None:
        return None
    if not isinstance(p, str) or not p:
        raise DataError(f"{where}: \"{key}\" must be a path (a string), got {p!r}")
    full = os.path.join(base, p)
    inside = os.path.commonpath([os.path.realpath(full), os.path.realpath(base)]) == os.path.realpath(base)
    if not inside and not anywhere:
        raise DataError(f"{where}: \"{key}\" {p!r} leaves the manifest's folder {base}; move the file inside it, "
                        "or pass --allow-outside-paths if you trust this manifest")
    return full


def listdir(d):
    return os.listdir(d) if os.path.isdir(d) else []


def check_text(samples, mode, num_classes=None):
    """mode: 'emb' (caption .npz), 't5' (prompt, or the .npz's prompt) or 'label' (c2i class, < num_classes)."""
    for s in samples:
        if mode == "label" and s.class_label is None:
            raise DataError(f"sample {s.name} has no class_label; c2i needs a --manifest with \"class_label\"")
        if mode == "label" and num_classes is not None and not 0 <= s.class_label < num_classes:
            raise DataError(f"sample {s.name}: class_label {s.class_label} is not in 0..{num_classes - 1}; "
                            "fix the manifest (or --num-classes)")
        if mode == "emb" and s.caption is None:
            raise DataError(f"sample {s.name} has no caption_emb; pass --t5-path to encode its prompt")
        if mode == "t5" and s.caption is None and s.prompt is None:
            raise DataError(f"sample {s.name} has neither prompt nor caption_emb")


# ---- reading one sample (DataLoader workers) ---------------------------------------------------

def read_sample(sample, condition_type, H, W, cls_token_num, text_mode):
    """-> dict(source uint8 (H, W, 3), ready, annotation uint8 or None, emb, mask, prompt), or
    dict(error=message). `ready`: source is the control map; otherwise the main process runs
    the hed/lineart/depth network on it. Canny is cheap and runs here."""
    try:
        rgb = conditions.read_rgb(sample.source, fix=sample.fix)
        check_size(rgb, sample.source, H, W)
        ready = sample.is_map
        if condition_type == "canny" and not ready:
            rgb, ready = np.repeat(conditions.canny(rgb)[..., None], 3, axis=2), True
        out = dict(source=rgb, ready=ready, annotation=None, emb=None, mask=None, prompt=sample.prompt)
        if sample.label is not None:
            out["annotation"] = read_label(sample.label, H, W)
        if text_mode == "emb" or (text_mode == "t5" and sample.prompt is None):
            emb, mask, prompt = text.load_caption_emb(sample.caption, cls_token_num)
            out.update(emb=emb, mask=mask, prompt=sample.prompt or prompt)
        return out
    except (DataError, conditions.ConditionError, text.TextError, OSError) as e:
        return dict(error=str(e))


def check_size(array, path, H, W):
    if array.shape[:2] != (H, W):
        raise DataError(f"{path} is {array.shape[1]}x{array.shape[0]}, expected {W}x{H}; "
                        "set --image-size (or --image-H/--image-W) to the data's size")


def read_label(path, H, W):
    try:
        with Image.open(path) as im:
            label = np.array(im)
    except Exception as e:  # noqa: BLE001 (PIL raises many kinds)
        raise DataError(f"cannot read label map {path} ({e})") from None
    if label.ndim != 2:
        raise DataError(f"{path}: a label map must be single-channel class ids, got shape {label.shape}")
    check_size(label, path, H, W)
    return label.astype(np.uint8)
