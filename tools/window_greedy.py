"""Greedy tokens of a speculative run on the window kernels against the plain engine's, at GPT-XL's shapes on one GPU
(issue 75's GPU proof): random GPT-XL t2i in float32 (so that no near tie turns), 512 px (1,024 tokens), CFG 4,
top-k 1, a few images; the speculative engine with each set of plan overrides given, the plain engine once.

    python tools/window_greedy.py --images 2 --plans "window_attention=triton,window_inputs=triton" \
        "window_attention=triton,window_inputs=triton,window_block=fused"

Prints, per set, the share of tokens equal to the plain engine's and the first position that differs; exits 1 where
any differs.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference.workload import inputs
from fast_inference.engine import Engine
from fast_inference.model import ModelArgs, Transformer


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--draft-window", type=int, default=16)
    p.add_argument("--plans", nargs="+", default=["window_attention=triton,window_inputs=triton"],
                   help="plan overrides of the speculative engine, one comma-separated set per run")
    args = p.parse_args()
    with torch.device("cuda"):  # workload.random_gpt_xl's model, in float32
        model = Transformer(ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed"))
    model.eval().requires_grad_(False)
    cond, mask, condition = inputs(model, args.images, 512, "cuda")
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1)
    with torch.no_grad():
        want = Engine(model).generate(cond, args.tokens, **kw)
    print(f"{torch.cuda.get_device_name()} | GPT-XL float32, {args.images} images x {args.tokens} tokens, greedy, "
          f"jacobi L={args.draft_window}", flush=True)
    failed = False
    for overrides in args.plans:
        t0 = time.perf_counter()
        engine = Engine(model, speculative="jacobi", draft_window=args.draft_window,
                        overrides=tuple(o for o in overrides.split(",") if o) + ("jacobi=on",))
        with torch.no_grad():
            got = engine.generate(cond, args.tokens, **kw)
        same = got == want
        first = int((~same).flatten().nonzero()[0]) if not same.all() else None
        j = engine.plan.jacobi
        print(f"{overrides or '(none)'}: pass {j.block} block, attention {j.attention}, inputs {j.inputs}: "
              f"{100 * same.double().mean().item():.3f}% of tokens equal, first difference at "
              f"{'none' if first is None else divmod(first, args.tokens)}; tokens per pass "
              f"{engine.last_speculation['tokens_per_pass']:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
        failed = failed or first is not None
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
