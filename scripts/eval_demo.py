"""Measure the demo model on held-out scenes of the demo set (test split): what issue 69 asks of it.

    python scripts/eval_demo.py --out sample/demo_eval.json                      # the shipped model, CPU
    python scripts/eval_demo.py --device cuda --out $OUT/demo_eval.json   # and any fast_engine.py model flags
    python scripts/eval_demo.py --figure docs/demo_model.png --num 0             # only the README's picture

  vq_psnr           PSNR (dB) of the VQ's reconstructions of --num scenes (encode, decode, uint8 as a saved PNG)
  vq_canny_f1       Canny F1 of those reconstructions against the scene's canny map (the ceiling of control_f1)
  control_f1        Canny F1 between each generated image and its own canny control (the project's canny metric)
  mismatched_f1     the same images against another scene's control
  control_f1_tol, mismatched_f1_tol   the same two with edges matched within edge_tolerance_px (BSDS's 0.0075 of
                    the diagonal, 2.7 px at 256 px); control is followed when control_f1_tol >= 0.5 and >= 2x
                    mismatched_f1_tol
  colour_scenes     fraction of scenes whose every named shape has its named colour: the mean colour of the
                    generated pixels inside the shape (eroded 2 px) is nearest, among the palette, to the named one
  colour_shapes     the same per shape; background_colour: the same for the background's pixels
  greedy_same       the fast and the reference engine draw the same tokens under --top-k 1 (first 8 scenes)
  passes_per_image, tokens_per_pass   with --speculative jacobi (and its --draft-* flags): the passes each image took
Every metric comes with its standard error over scenes (sampling noise). --engine both samples the scenes with both
engines (their own random streams) and reports both. Controls are canny maps, captions the scenes' own.
"""
import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.nn.functional as F

from fast_inference import scenes
from fast_inference.components import make_engine, sample_tokens, use_demo_model
from fast_inference.flags import Parser, add_model_args
from fast_inference.pipeline import Pipeline, PipelineConfig
from fast_inference.settings import flag_name
from fast_inference.demo_text import DemoTextEncoder
from fast_inference.images import save_image
from fast_inference.metrics import binary_f1, tolerant_f1

PALETTE = torch.tensor(list(scenes.PALETTE.values()), dtype=torch.float32)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num", type=int, default=64, help="held-out scenes (test split 0..num-1)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--engine", choices=["fast", "reference", "both"], default="fast")
    p.add_argument("--out", default=None, help="JSON of the results")
    p.add_argument("--figure", default=None, help="PNG: control maps and images at two seeds (README)")
    p.add_argument("--figure-scenes", default="3,8,12", help="test scenes of the figure")
    args, rest = p.parse_known_args(argv)
    model_flags = Parser(description="the model flags of fast_engine.py")
    add_model_args(model_flags)
    args.model = use_demo_model(model_flags.parse_args(["--condition-type", "canny"] + [a for a in rest if a != "--"]))
    return args


def load(margs):
    pipe = Pipeline(PipelineConfig.from_args(margs), spell=flag_name)
    return pipe.device, pipe.dtype, pipe.backend, pipe.model, pipe.image_size, pipe.vq


def to_uint8(x):
    return scenes.to_uint8((x.clamp(-1, 1) + 1) * 127.5)


def generate(margs, model, engine, vq, batch, controls, seed, device):
    """uint8 images (B, 3, S, S) of scenes `batch` under their captions and the control maps (uint8)."""
    encoder = DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num)
    emb, mask = encoder.encode_left_padded([s.caption for s in batch])
    torch.manual_seed(seed)
    size = controls.shape[-1]
    tokens = sample_tokens(model, engine, emb.to(device), mask.to(device), scenes.to_model_range(controls).to(device),
                           (size // 16) ** 2, margs)
    return to_uint8(vq.decode_code(tokens)).cpu(), tokens.cpu()


def f1s(images, controls, tol=0):
    """Per image: Canny F1 of each image against each control map (both uint8 (B, 3, S, S)); tol > 0: within tol
    px (tolerant_f1)."""
    edges = scenes.canny(images)
    score = (lambda e, c: tolerant_f1(e, c, tol)) if tol else binary_f1
    return [score(e.numpy(), (c[0] == 255).numpy()) for e, c in zip(edges, controls)]


def tolerance(size):
    """BSDS's edge-matching distance, 0.0075 of the image diagonal: 2.7 px at 256 px, 1.4 at 128."""
    return 0.0075 * math.hypot(size, size)


def colour_checks(images, batch, size):
    """Per scene: (all named shapes right, [shape right], background right) by the nearest palette colour of the
    mean generated colour inside each shape's region (eroded 2 px) and over the background's pixels."""
    label, inside = scenes.labels(batch, size)
    eroded = -F.max_pool2d(-inside.float(), 5, 1, 2) > 0  # 2 px in from the edge
    out = []
    for b, s in enumerate(batch):
        img = images[b].float()
        shapes = [nearest(img[:, eroded[b, k]]) == sh.colour for k, sh in enumerate(s.shapes)]
        bg = (label[b] == 0) & (F.max_pool2d(inside[b].float()[None], 9, 1, 4)[0].amax(0) == 0)
        out.append((all(shapes), shapes, nearest(img[:, bg]) == s.top if bg.any() else True))
    return out


def nearest(pixels):
    """Name of the palette colour nearest the mean of pixels (3, n)."""
    if pixels.shape[1] == 0:
        return None
    return scenes.COLOURS[int(torch.cdist(pixels.mean(1)[None], PALETTE).argmin())]


def mean_se(values):
    v = np.asarray(values, dtype=np.float64)
    return round(float(v.mean()), 4), round(float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else 0.0, 4)


@torch.no_grad()
def vq_metrics(vq, size, n, device, batch=32):
    psnrs, f1 = [], []
    for start in range(0, n, batch):
        sc = scenes.scenes(range(start, min(n, start + batch)), "test")
        rgb = scenes.render(sc, size)
        rec = to_uint8(vq.decode_code(vq.encode(scenes.to_model_range(rgb).to(device)))).cpu()
        mse = (rec.float() - rgb.float()).pow(2).flatten(1).mean(1)
        psnrs += (10 * torch.log10(255**2 / mse.clamp_min(1e-12))).tolist()
        f1 += f1s(rec, scenes.control(sc, "canny", size, rgb=rgb))
    return dict(vq_psnr=mean_se(psnrs), vq_canny_f1=mean_se(f1))


@torch.no_grad()
def sample_metrics(args, model, engine, vq, size, device):
    """The control and colour metrics of --num scenes sampled by one engine (seeded per batch)."""
    own, other, own_tol, other_tol, scene_ok, shape_ok, bg_ok, passes = [], [], [], [], [], [], [], []
    n = args.num
    for start in range(0, n, args.batch):
        idx = list(range(start, min(n, start + args.batch)))
        batch = scenes.scenes(idx, "test")
        controls = scenes.control(batch, "canny", size)
        images, _ = generate(args.model, model, engine, vq, batch, controls, args.model.seed * 1000 + start, device)
        own += f1s(images, controls)
        own_tol += f1s(images, controls, tolerance(size))
        passes += engine.last_speculation.get("passes", []) if engine is not None else []
        mismatched = scenes.control(scenes.scenes([(i + 1) % n for i in idx], "test"), "canny", size)
        other += f1s(images, mismatched)
        other_tol += f1s(images, mismatched, tolerance(size))
        for ok, shapes, bg in colour_checks(images, batch, size):
            scene_ok.append(ok)
            shape_ok += shapes
            bg_ok.append(bg)
    result = dict(control_f1=mean_se(own), mismatched_f1=mean_se(other), control_f1_tol=mean_se(own_tol),
                  mismatched_f1_tol=mean_se(other_tol), edge_tolerance_px=round(tolerance(size), 2),
                  colour_scenes=mean_se(scene_ok),
                  colour_shapes=mean_se(shape_ok), background_colour=mean_se(bg_ok))
    if passes:  # --speculative jacobi: passes per image; tokens per pass leave out the first, drawn by the prefill
        tokens = ((size // 16) ** 2 - 1) * n
        result.update(passes_per_image=mean_se(passes), tokens_per_pass=round(tokens / sum(passes), 3))
    return result


@torch.no_grad()
def greedy_same(args, model, vq, backend, size, device, n=8):
    """Both engines under top-k 1 on the first n scenes: the same tokens?"""
    margs = argparse.Namespace(**{**vars(args.model), "top_k": 1})
    batch = scenes.scenes(range(n), "test")
    controls = scenes.control(batch, "canny", size)
    tokens = []
    for name in ("reference", "fast"):
        margs.engine = name
        engine = make_engine(margs, model, backend)
        tokens.append(generate(margs, model, engine, vq, batch, controls, 0, device)[1])
    return bool(torch.equal(*tokens)), int((tokens[0] != tokens[1]).sum())


@torch.no_grad()
def figure(args, model, engine, vq, size, device, path):
    """Rows: a scene's canny control, then the images drawn from it (and its caption) at seeds 0 and 1."""
    idx = [int(i) for i in args.figure_scenes.split(",")]
    batch = scenes.scenes(idx, "test")
    controls = scenes.control(batch, "canny", size)
    cells = [controls] + [generate(args.model, model, engine, vq, batch, controls, seed, device)[0] for seed in (0, 1)]
    grid = torch.stack(cells, 1).flatten(0, 1)
    save_image(scenes.to_model_range(grid), path, nrow=3, padding=2)
    return [s.caption for s in batch]


def main(argv=None):
    args = parse_args(argv)
    device, dtype, backend, model, size, vq = load(args.model)
    result = dict(model=args.model.gpt_ckpt, vq=args.model.vq_ckpt, image_size=size, num=args.num,
                  device=str(device), dtype=str(dtype).replace("torch.", ""), cfg_scale=args.model.cfg_scale,
                  top_k=args.model.top_k, temperature=args.model.temperature, seed=args.model.seed)
    t0 = time.perf_counter()
    if args.num:
        result.update(vq_metrics(vq, size, args.num, device))
        print(json.dumps(result), flush=True)
        engines = ["fast", "reference"] if args.engine == "both" else [args.engine]
        for name in engines:
            args.model.engine = name
            engine = make_engine(args.model, model, backend)
            result[name] = sample_metrics(args, model, engine, vq, size, device)
            print(name, json.dumps(result[name]), flush=True)
        result["greedy_same"], result["greedy_differing_tokens"] = greedy_same(args, model, vq, backend, size, device)
    if args.figure:
        args.model.engine = "fast"
        result["figure_captions"] = figure(args, model, make_engine(args.model, model, backend), vq, size, device,
                                           args.figure)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    with torch.no_grad():
        main()
