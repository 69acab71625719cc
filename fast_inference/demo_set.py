"""The demo set on disk: a split of procedural scenes (scenes.py) in the official extracted layout (SPEC 13.1), so
fast_eval.py evaluates the demo model as it evaluates a real one.

    image/{i}.png          the scene (canny controls are extracted from it, as test_t2i.py does)
    control/{i}.png        its colour-coded segmentation map
    control_depth/{i}.png  its layered depth map
    label/{i}.png          class ids: 1 top background, 2 bottom background, 3.. the shape kinds (0 unused)
    caption_emb/{i}.npz    'prompt' (the caption) and 'caption_emb' (1, words, caption_dim): the demo text
                           encoder's rows for its words, as the official files hold T5's valid tokens
File stems are the scene indices of the split.
"""
import os

import numpy as np

from fast_inference import scenes
from fast_inference.demo_text import DemoTextEncoder
from fast_inference.images import save_png_uint8

FOLDERS = ("image", "control", "control_depth", "label", "caption_emb")


def write_split(root, indices, size, caption_dim, split="test", chunk=64):
    """Write scenes `indices` of `split` at size x size under root (each file atomically); returns root."""
    for d in FOLDERS:
        os.makedirs(os.path.join(root, d), exist_ok=True)
    encoder = DemoTextEncoder(caption_dim, length=120)
    indices = list(indices)
    for start in range(0, len(indices), chunk):
        part = indices[start:start + chunk]
        batch = scenes.scenes(part, split)
        rgb = scenes.render(batch, size)
        maps = {k: scenes.control(batch, k, size) for k in ("seg", "depth")}
        label, _ = scenes.labels(batch, size)
        for b, (i, s) in enumerate(zip(part, batch)):
            hwc = lambda x: x[b].permute(1, 2, 0).numpy()
            save_png_uint8(hwc(rgb), os.path.join(root, "image", f"{i}.png"))
            save_png_uint8(hwc(maps["seg"]), os.path.join(root, "control", f"{i}.png"))
            save_png_uint8(hwc(maps["depth"]), os.path.join(root, "control_depth", f"{i}.png"))
            save_png_uint8((label[b] + 1).numpy().astype(np.uint8), os.path.join(root, "label", f"{i}.png"))
            emb, mask = encoder.encode_left_padded([s.caption])
            valid = emb[:, mask[0].bool()].numpy()
            path = os.path.join(root, "caption_emb", f"{i}.npz")
            np.savez(path + ".tmp.npz", prompt=np.array([s.caption]), caption_emb=valid)
            os.replace(path + ".tmp.npz", path)
    return root


def ensure_split(root, n, size, caption_dim, split="test"):
    """write_split of scenes 0..n-1 unless root already holds all their caption files."""
    have = os.path.join(root, "caption_emb")
    if not all(os.path.isfile(os.path.join(have, f"{i}.npz")) for i in range(n)):
        write_split(root, range(n), size, caption_dim, split)
    return root
