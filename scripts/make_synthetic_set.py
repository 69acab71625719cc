"""Write a synthetic validation split in the official extracted layout (SPEC 13.1), to try
fast_eval.py without the real data: drawn control maps, random caption embeddings and labels.

    python scripts/make_synthetic_set.py data/synthetic --num 64 --size 512 --caption-dim 2048
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from PIL import Image

from fast_inference import conditions


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
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--caption-dim", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    write_split(a.root, a.num, a.size, a.caption_dim, a.seed)
    print(f"wrote {a.num} samples to {a.root}")


if __name__ == "__main__":
    main()
