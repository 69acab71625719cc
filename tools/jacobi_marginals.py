"""Speculative Jacobi decoding against the plain fast engine at GPT-XL's shapes on one GPU (issue 70's GPU proof):
per-position token histograms of many images from both engines, compared by a two-sample chi-square test at each
position, and the share of greedy tokens the two agree on.

    python tools/jacobi_marginals.py --images 1024 --tokens 64 --entropy 2.0

Random GPT-XL (bf16) with its output layer scaled to --entropy nats (workload.scale_to_entropy), so that each position's
tokens gather on a few hundred values and a histogram of some hundred images can tell two distributions apart; the
first --tokens image tokens of each image (two grid rows at 512 px) at n = --batch images per call. Under the null
(same distribution) each position's statistic exceeds its p = 0.001 bound with probability 0.001: the script prints
how many positions do, and fails (exit 1) where more than 1% of them do. Greedy (top-k 1) over --batch images: bf16
near-ties may turn a few tokens (the exact identity is tests/test_speculative.py's, in float32).
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference.workload import inputs, random_gpt_xl, scale_to_entropy
from fast_inference.engine import Engine
from fast_inference.speculative import DEFAULT_INIT


def sample(engine, model, args, kw, seed):
    torch.manual_seed(seed)
    out = []
    for _ in range(args.images // args.batch):
        cond, mask, condition = inputs(model, args.batch, 512, "cuda")
        out.append(engine.generate(cond, args.tokens, emb_masks=mask, condition=condition, **kw))
    return torch.cat(out).cpu()


def chi_square(a, b):
    """Two-sample chi-square of two equal-size samples of tokens, over the tokens either drew -> (statistic, bound at
    p = 0.001 by Wilson-Hilferty)."""
    values = torch.unique(torch.cat([a, b]))
    ca, cb = ((t[:, None] == values).sum(0).double() for t in (a, b))
    dof = max(len(values) - 1, 1)
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    return (((ca - cb) ** 2) / (ca + cb)).sum().item(), bound


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--entropy", type=float, default=2.0)
    p.add_argument("--draft-window", type=int, default=16)
    p.add_argument("--draft-init", default=DEFAULT_INIT)
    p.add_argument("--plan", action="append", default=[], metavar="KEY=VALUE",
                   help="plan overrides of the speculative engine (e.g. window_attention=triton)")
    args = p.parse_args()
    model = random_gpt_xl()
    kw = dict(cfg_scale=4.0, top_k=2000, temperature=1.0, top_p=1.0)
    with torch.no_grad():
        scale, entropy = scale_to_entropy(model, args.entropy, argparse.Namespace(image_size=512), kw, "cuda")
    print(f"{torch.cuda.get_device_name()} | GPT-XL bf16, output x {scale:.3g} (mean entropy {entropy:.2f} nats) | "
          f"{args.images} images x {args.tokens} tokens at n = {args.batch} | jacobi L={args.draft_window} "
          f"({args.draft_init}{', ' + ', '.join(args.plan) if args.plan else ''})", flush=True)
    plain = Engine(model)
    jacobi = Engine(model, speculative="jacobi", draft_window=args.draft_window, draft_init=args.draft_init,
                    overrides=list(args.plan) + ["jacobi=on"])  # the passes, where the plan would run plain steps
    a, b = sample(plain, model, args, kw, 1), sample(jacobi, model, args, kw, 2)
    stats = [chi_square(a[:, j], b[:, j]) for j in range(args.tokens)]
    over = [j for j, (s, bound) in enumerate(stats) if s > bound]
    print(f"positions over their p = 0.001 bound: {len(over)} of {args.tokens} {over[:10]}; "
          f"tokens per pass {jacobi.last_speculation['tokens_per_pass']:.2f}")
    greedy = dict(kw, top_k=1)
    g_plain, g_jacobi = (sample(e, model, argparse.Namespace(**dict(vars(args), images=args.batch)), greedy, 3)
                         for e in (plain, jacobi))
    same = (g_plain == g_jacobi).double().mean().item()
    print(f"greedy: {100 * same:.2f}% of {g_plain.numel()} tokens equal; whole images equal: "
          f"{int((g_plain == g_jacobi).all(1).sum())} of {args.batch}")
    sys.exit(1 if len(over) > max(1, args.tokens // 100) else 0)


if __name__ == "__main__":
    main()
