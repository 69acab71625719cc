"""Where a server's step goes (issue 75): a continuous batch (continuous.Batch, as serve.py's engine thread runs it, no
HTTP) of n one-image requests against the plain engine's step at n images, in one process: GPT-XL t2i 512 px, bf16,
random weights, cfg 4, top-k 2000.

    python tools/server_step.py --sizes 1,8,32 [--plan server_block=fused] [--profile-dir DIR] [--json F]

Per n: the plain engine's ms/step (workload.bench_fast, the whole image's mean); the batch's ms/step over the same
image's steps (--steps: fewer, from the start, read shorter caches: a bias in the batch's favour) (wall, synchronised at
the end) and the host's time to issue them (before the synchronisation: near the wall time, the steps wait on the
host); its step graph replayed alone (the blocks and the head; where the draws are keyed, the draw and the tokens
written too) and so the rest (the requests' noise, the draw, the tokens written; keyed: the host's work) by
difference; and the time to admit one request between steps (its prefill and first token, synchronised): the first
of its kind (as it comes), the one that captures its graph and those after it (replays, where the plan captures them).
--profile-dir: the kernels of the plain step and of one batch step by name, largest first, per n
(DIR/server_step_profile.txt). --tiny: a tiny random model on the CPU (a smoke run of the script itself; its times mean
nothing).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from fast_inference.continuous import Batch, Request
from fast_inference.engine import Engine
from fast_inference.model import ModelArgs, Transformer
from fast_inference.workload import bench_fast, inputs, random_gpt_xl

N_SIDE = 512


def tiny_model():
    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layer=2, n_head=2, dim=64, block_size=64, cls_token_num=8, caption_dim=32,
                                 condition_type="hed")).eval().requires_grad_(False)


def requests(model, n, side):
    """n one-image requests, their tensors on the host (as serve.py makes them)."""
    cond, mask, condition = inputs(model, n, side, "cpu")
    return [Request(cond=cond[i : i + 1], mask=mask[i : i + 1], control=condition[i], seed=i) for i in range(n)]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(batch, steps, device):
    """(wall ms per step, host ms per step): `steps` steps issued back to back, synchronised once at the end."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        batch.step()
    host = time.perf_counter() - t0
    sync(device)
    wall = time.perf_counter() - t0
    return 1e3 * wall / steps, 1e3 * host / steps


def time_replays(batch, steps, device):
    """ms per replay of the batch's step graph alone (None where the plan captures none), the rows held at their
    positions (a keyed step's graph advances them: the steps after stay inside the caches)."""
    r = batch.runner
    if r.graphs is None:
        return None
    bucket = r.bucket(batch.used)
    live = r.live.clone()
    r.live.zero_()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        r.graphs.replay(bucket)
    sync(device)
    r.live.copy_(live)
    return 1e3 * (time.perf_counter() - t0) / steps


def admit_ms(batch, request, device):
    """ms to admit one request into the batch (its prefill and first token, as serve.py's engine thread does between
    steps), synchronised -> (ms, whether it captured its graph)."""
    captures = batch.admit_captures(request)
    sync(device)
    t0 = time.perf_counter()
    batch.admit(request)
    sync(device)
    return 1e3 * (time.perf_counter() - t0), captures


def time_admits(batch, request, device, rounds=5):
    """Removals and re-admissions of the running batch's last request -> (ms of the one that captured its graph, None
    if none did; the median ms of the `rounds` after it)."""
    capture, times = None, []
    while len(times) < rounds:
        batch.remove(batch.entries[-1])
        ms, captured = admit_ms(batch, request, device)
        if captured:
            capture = ms
        else:
            times.append(ms)
    return capture, sorted(times)[rounds // 2]


def profile_step(batch, label, out):
    """One batch step's kernels (of 3 under the profiler, the second) by name, largest first, to out."""
    from step_timeline import kernel_events, write_by_name

    write_by_name(kernel_events(batch.step, 3), 3, label, out)


def profile_admit(batch, request, label, out):
    """One replayed admission's kernels (the running batch's last request removed and admitted again, 3 times under
    the profiler, the second) by name, to out: where admit ms goes beside the prefill's work."""
    from step_timeline import kernel_events, write_by_name

    write_by_name(kernel_events(lambda: (batch.remove(batch.entries[-1]), batch.admit(request)), 3), 3, label, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,8,32", help="images in the batch (one request each)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: all but the last few of a request's "
                    "1,023 at 512 px, as the plain step's ms is the whole image's mean: early steps read short caches)")
    ap.add_argument("--plan", action="append", default=[], metavar="KEY=VALUE", help="the batch's plan overrides")
    ap.add_argument("--profile-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on the CPU: a smoke run of this script")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("server_step.py needs a CUDA GPU (or --tiny)")
    model = tiny_model() if args.tiny else random_gpt_xl()
    side = 8 * 16 if args.tiny else N_SIDE
    num_tokens = (side // 16) ** 2
    steps = min(args.steps or num_tokens, num_tokens - 10)
    kw = dict(cfg_scale=4.0, top_k=2000, temperature=1.0, top_p=1.0)
    bargs = argparse.Namespace(image_size=side, fast_runs=1 if args.tiny else 3)
    prof = None
    if args.profile_dir and not args.tiny:
        os.makedirs(args.profile_dir, exist_ok=True)
        prof = open(os.path.join(args.profile_dir, "server_step_profile.txt"), "w")
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{name} | {'tiny' if args.tiny else 'GPT-XL'} t2i {side} px, random weights, cfg 4, top-k 2000 | batch plan "
          f"{','.join(args.plan) or '(default)'}", flush=True)
    print("| n | plain ms/step | batch ms/step | x plain | host ms/step | forward graph ms | the rest ms "
          "| first admit ms | capture ms | admit ms |", flush=True)
    print("|---|---|---|---|---|---|---|---|---|---|", flush=True)
    results = []
    with torch.no_grad():
        for n in map(int, args.sizes.split(",")):
            model.clear_caches()
            plain = Engine(model, backend="inductor" if device == "cuda" else "eager")
            if device == "cuda":
                fast = bench_fast(plain, model, n, num_tokens, bargs, kw, device)
            else:  # the smoke run: one image's decode, untimed by bench_fast (which synchronises CUDA)
                cond, mask, condition = inputs(model, n, side, device)
                plain.generate(cond, num_tokens, emb_masks=mask, condition=condition, **kw)
                fast = dict(step_ms=1e3 * plain.last_timings["decode"] / (num_tokens - 1))
            if prof is not None:  # the plain step's graph at the middle of the image, as pass_ab.py profiles it
                from pass_ab import profile

                r = plain.runner
                profile(plain.graphs.graphs[True, r.window(num_tokens // 2)], f"plain step, n = {n}", prof)
            plain.runner = None
            model.clear_caches()
            engine = Engine(model, backend="inductor" if device == "cuda" else "eager", overrides=tuple(args.plan))
            rs = requests(model, n, side)
            batch = Batch(engine, rs[0].shape, capacity=n)
            admits = [admit_ms(batch, r, device) for r in rs]  # one key: the first as it comes, the second captures
            first, capture = admits[0][0], next((ms for ms, captured in admits if captured), None)
            for _ in range(3):  # the bucket's capture and warm-up
                batch.step()
            wall, host = time_steps(batch, steps, device)
            forward = time_replays(batch, steps, device)
            late_capture, admit = time_admits(batch, rs[-1], device)
            capture = capture if late_capture is None else late_capture
            row = dict(n=n, plain_ms=fast["step_ms"], batch_ms=wall, host_ms=host, forward_ms=forward,
                       rest_ms=None if forward is None else wall - forward, first_admit_ms=first,
                       capture_ms=capture, admit_ms=admit)
            results.append(row)
            cell = lambda v, f=".3f": "-" if v is None else format(v, f)
            print(f"| {n} | {fast['step_ms']:.3f} | {wall:.3f} | {wall / fast['step_ms']:.2f} | {host:.3f} | "
                  f"{cell(forward)} | {cell(row['rest_ms'])} | {first:.1f} | {cell(capture, '.1f')} | {admit:.1f} |",
                  flush=True)
            if prof is not None:
                profile_step(batch, f"server step, n = {n}, {','.join(args.plan) or 'default plan'}", prof)
                profile_admit(batch, rs[-1], f"a replayed admission (and the removal before it), n = {n}", prof)
            if args.json:  # after each row: a run cut by its time limit keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(dict(plan=args.plan, rows=results), f, indent=1)
            del batch, engine, plain
    if prof is not None:
        prof.close()
        print(f"wrote {prof.name}", flush=True)


if __name__ == "__main__":
    main()
