"""Write a synthetic validation split in the official extracted layout (SPEC 13.1), to try
fast_eval.py without the real data: drawn control maps, random caption embeddings and labels; or,
with --scenes, a split of the demo set (the procedural scenes the demo model learnt, with their
captions through the demo text encoder; fast_inference/demo_set.py).

    python scripts/make_synthetic_set.py data/synthetic --num 64 --size 512 --caption-dim 2048
    python scripts/make_synthetic_set.py data/demo_test --scenes --num 1000 --size 256   # the demo model's size
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from PIL import Image

from fast_inference import conditions, demo_set
from fast_inference.components import DEMO_DIR

DEMO_GPT = os.path.join(DEMO_DIR, "gpt.json")


def write_split(root, n, size=512, caption_dim=2048, seed=0):
    """image/ (flat-colour scenes: clean canny edges), control/ (seg), control_depth/, label/,
    caption_emb/ (1, v, caption_dim) float32 with 'prompt', code/ (1, 1, (size/16)^2)."""
    rng = np.random.default_rng(seed)
    for d in ("image", "control", "control_depth", "label", "caption_emb", "code"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for i in range(n):
        seg = conditions.draw_example("seg", size, size, seed=i)
        Image.fromarray(seg).save(os.path.join(root, "image", f"{i}.png"))
        Image.fromarray(seg).save(os.path.join(root, "control", f"{i}.png"))
        depth = conditions.draw_example("depth", size, size, seed=i)
        Image.fromarray(depth).save(os.path.join(root, "control_depth", f"{i}.png"))
        Image.fromarray(rng.integers(0, 151, (size, size), dtype=np.uint8)).save(os.path.join(root, "label", f"{i}.png"))
        v = int(rng.integers(2, 12))
        np.savez(os.path.join(root, "caption_emb", f"{i}.npz"), prompt=np.array([f"caption {i}"]),
                 caption_emb=rng.standard_normal((1, v, caption_dim)).astype(np.float32))
        np.save(os.path.join(root, "code", f"{i}.npy"), rng.integers(0, 16384, (1, 1, (size // 16) ** 2)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("root")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--size", type=int, default=None, help="default 512; --scenes: the demo model's")
    p.add_argument("--caption-dim", type=int, default=None, help="default 2048; --scenes: the demo model's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scenes", action="store_true", help="scenes 0..num-1 of the demo set instead")
    p.add_argument("--split", choices=["train", "val", "test"], default="test", help="--scenes: which split")
    a = p.parse_args()
    if a.scenes:
        with open(DEMO_GPT) as f:
            demo = json.load(f)
        size = a.size or int(round(demo["block_size"] ** 0.5)) * 16
        demo_set.write_split(a.root, range(a.num), size, a.caption_dim or demo["caption_dim"], a.split)
    else:
        write_split(a.root, a.num, a.size or 512, a.caption_dim or 2048, a.seed)
    print(f"wrote {a.num} samples to {a.root}")


if __name__ == "__main__":
    main()
