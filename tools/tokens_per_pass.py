"""Tokens per speculative pass at GPT-XL's shape with random weights, on any device: a shortened run where no GPU is
lent (issue 78). Only acceptance is measured here, not time (bench.py times passes, on a GPU).

    python tools/tokens_per_pass.py --entropy 3 --tokens 32 --images 1 16:gumbel:none 16:pathwise:4x3

Random GPT-XL t2i for 512 px images (float32 on the CPU, bf16 on CUDA), its output layer scaled to --entropy nats
(workload.scale_to_entropy over the first --tokens tokens, cfg 4, top-k 2000), then each configuration WINDOW:COUPLING:TREE (left drafts) samples the
first --tokens image tokens of --images images (bench.inputs, seed 0) and prints its tokens per pass.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference.workload import inputs, scale_to_entropy
from fast_inference.draft_tree import parse_tree
from fast_inference.engine import Engine
from fast_inference.model import ModelArgs, Transformer


def random_gpt_xl(device):
    """GPT-XL t2i for 512 px with random weights: bf16 on CUDA, float32 elsewhere."""
    with torch.device(device):
        model = Transformer(ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed"))
    return model.to(torch.bfloat16 if device == "cuda" else torch.float32).eval().requires_grad_(False)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("configs", nargs="+", help="WINDOW:COUPLING:TREE, e.g. 16:pathwise:4x3 or 16:gumbel:none")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--entropy", type=float, default=3.0)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--images", type=int, default=2)
    args = p.parse_args()
    torch.manual_seed(0)
    model = random_gpt_xl(args.device)
    kw = dict(cfg_scale=4.0, top_k=2000, temperature=1.0, top_p=1.0)
    t0 = time.perf_counter()
    with torch.no_grad():
        scale, entropy = scale_to_entropy(model, args.entropy, argparse.Namespace(image_size=512), kw, args.device,
                                          steps=args.tokens, rounds=2)  # over the tokens the run covers
    print(f"GPT-XL random on {args.device}, output x {scale:.3g} (mean entropy {entropy:.2f} nats, "
          f"{time.perf_counter() - t0:.0f} s) | {args.images} images x {args.tokens} tokens, left drafts", flush=True)
    print("| L | coupling | tree | rows per image | tokens per pass | passes per image | s |\n|---|---|---|---|---|---|---|")
    cond, mask, condition = inputs(model, args.images, 512, args.device)
    for config in args.configs:
        window, coupling, tree = config.split(":")
        engine = Engine(model, backend="eager", speculative="jacobi", draft_window=int(window), draft_init="left",
                        draft_coupling=coupling, draft_tree=parse_tree(tree), overrides=("jacobi=on",))
        torch.manual_seed(1)
        t0 = time.perf_counter()
        engine.generate(cond, args.tokens, emb_masks=mask, condition=condition, **kw)
        s = engine.last_speculation
        print(f"| {window} | {coupling} | {tree} | {engine.plan.jacobi.nodes} | {s['tokens_per_pass']:.2f} | "
              f"{sum(s['passes']) / len(s['passes']):.1f} | {time.perf_counter() - t0:.0f} |", flush=True)
        model.clear_caches()


if __name__ == "__main__":
    main()
