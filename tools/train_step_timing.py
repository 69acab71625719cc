"""Where one training step of the demo GPT spends its time: each part of scripts/train_demo.py's step timed with
the device synchronised around it, then the kernels of a few steps summed by name (CUDA) under torch.profiler.

    python tools/train_step_timing.py --device cuda --steps 20          # the GPU preset, as gpu_session.sh demo runs it
"""
import argparse
import math
import os
import sys
import time
from collections import defaultdict

import numpy as np
import torch
import torch.nn.functional as F

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")]
import train_demo as td  # noqa: E402
from fast_inference import demo_text, scenes  # noqa: E402
from fast_inference.model import ModelArgs, Transformer  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="gpu", choices=sorted(td.PRESETS))
    p.add_argument("--batch", type=int, default=None, help="default: the preset's")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--pool", type=int, default=1024, help="scenes tokenised for the timed steps")
    p.add_argument("--entry-weight", type=float, default=8.0)
    return p.parse_args(argv)


def step_parts(model, encoder, vq, opt, table, preset, rng, device, args, timer):
    """One training step as train_demo.train_gpt takes it, cut into the parts timed."""
    with timer("batch: indices, scenes"):
        indices, types, drop = td.gpt_step_batch(0, preset, rng)
        batch = td.cached_scenes(indices, "train")
    with timer("render"):
        rgb = scenes.render(batch, preset["size"], device)
    with timer("control maps"):
        maps = td.control_maps(batch, types, rgb, preset["size"], device)
    with timer("tokens from the pool"):
        tokens = td.tokens_of([i % table.shape[0] for i in indices], table, preset, vq, device)
    with timer("entry weights"):
        w = td.entry_weights(batch, preset["size"], math.isqrt(tokens.shape[1]), args.entry_weight, device)
    with timer("caption + adapter"), td.autocast(device):
        prefix, mask, controls = td.gpt_inputs(model, encoder, batch, maps, types, torch.as_tensor(drop, device=device))
    with timer("GPT forward + loss"):
        with td.autocast(device):
            hidden = td.teacher_forced_hidden(model, prefix, mask, controls, tokens)
            logits = model.logits(hidden)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none").view(tokens.shape)
        loss = (loss * w).sum() / w.sum()
    with timer("backward"):
        opt.zero_grad(set_to_none=True)
        loss.backward()
    with timer("clip + optimiser"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()


class Timer:
    def __init__(self, device):
        self.device, self.total = device, defaultdict(float)

    def __call__(self, name):
        timer = self

        class Part:
            def __enter__(self):
                timer.sync()
                self.t = time.perf_counter()

            def __exit__(self, *exc):
                timer.sync()
                timer.total[name] += time.perf_counter() - self.t
        return Part()

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    preset = dict(td.PRESETS[args.preset], pool=args.pool)
    if args.batch:
        preset["gpt_batch"] = args.batch
    margs = td.gpt_args(preset, preset["vq"])
    with torch.device(device):
        model = Transformer(ModelArgs(**margs))
    td.init_gpt(model)
    model.train()
    encoder = demo_text.DemoTextEncoder(margs["caption_dim"], margs["cls_token_num"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    N = (preset["size"] // 16) ** 2
    vq = None  # the tokens come from a table of random codes: the step's work is the same as the pool's
    table = torch.randint(0, preset["vq"]["codebook_size"], (args.pool, N), device=device, dtype=torch.int16)
    rng = np.random.RandomState(0)
    warm = Timer(device)
    for _ in range(3):
        step_parts(model, encoder, vq, opt, table, preset, rng, device, args, warm)
    timer = Timer(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step_parts(model, encoder, vq, opt, table, preset, rng, device, args, timer)
    wall = time.perf_counter() - t0
    print(f"{args.preset} preset, batch {preset['gpt_batch']}, {device}: {1e3 * wall / args.steps:.1f} ms per step "
          f"synchronised part by part ({args.steps / wall:.2f} steps/s)")
    for name, t in sorted(timer.total.items(), key=lambda kv: -kv[1]):
        print(f"  {1e3 * t / args.steps:8.1f} ms  {100 * t / wall:5.1f}%  {name}")
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step_parts(model, encoder, vq, opt, table, preset, rng, device, args, Timer(device))
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    launches = sum(e.count for e in kernels) / 3
    busy = sum(e.self_device_time_total for e in kernels) / 3e3
    print(f"per step: {launches:.0f} kernels, {busy:.1f} ms of GPU time; the largest:")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:20]:
        print(f"  {e.self_device_time_total / 3e3:8.2f} ms  {e.count / 3:6.0f}x  {e.key[:100]}")
    ops = [e for e in prof.key_averages() if e.device_type.name == "CPU"]
    print("per step, the host's largest ops by their own time (launches, Python-side work):")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:15]:
        print(f"  {e.self_cpu_time_total / 3e3:8.2f} ms  {e.count / 3:6.0f}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
