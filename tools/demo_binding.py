"""Does the demo model read the caption's colours? Teacher-forced loss of held-out scenes under altered inputs (issue 77).

    python tools/demo_binding.py --model checkpoints/demo_gpu [--num 32] [--device cpu]

Each test scene of two or more shapes is encoded by the model's VQ and scored (nats per token, the model's own
forward as in training, canny control, nothing dropped) under its true caption and control, and under:
  colours rotated      the shapes' colours moved one shape along in the caption (the same words, bound wrongly)
  shapes recoloured    the shapes named in colours the scene does not show
  background recoloured  the background named in a colour the scene does not show
  other control        another scene's control map
  dropped both         the null caption and no control (the CFG branch)
Reported over all tokens, tokens inside a shape (the centre pixel's), and the first ENTRY_TOKENS tokens of each
region in raster order, where a colour is decided (scripts/train_demo.py's entry_weights). A model that binds each
colour to its shape loses clearly more under "colours rotated" than under the true caption on those tokens.
"""
import argparse
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import train_demo
from fast_inference import demo_text, scenes
from fast_inference.model import ModelArgs, Transformer


def load(folder, device):
    with open(os.path.join(folder, "gpt.json")) as f:
        margs = json.load(f)
    model = Transformer(ModelArgs(**margs))
    model.load_state_dict({k: v.float() for k, v in load_file(os.path.join(folder, "gpt.safetensors")).items()},
                          strict=False)  # the keys unused at inference are not stored
    return model.to(device).eval(), train_demo.load_vq(folder, device), margs


def rotated(s):
    s = copy.deepcopy(s)
    colours = [x.colour for x in s.shapes]
    for x, c in zip(s.shapes, colours[1:] + colours[:1]):
        x.colour = c
    return s


def unused(s):
    return [c for c in scenes.COLOURS if c not in {s.top, s.bottom} | {x.colour for x in s.shapes}]


def shapes_recoloured(s):
    s = copy.deepcopy(s)
    for x, c in zip(s.shapes, unused(s)):
        x.colour = c
    return s


def background_recoloured(s):
    s = copy.deepcopy(s)
    s.top = unused(s)[0]
    return s


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="folder of gpt.json, gpt.safetensors, vq.json, vq.safetensors")
    p.add_argument("--num", type=int, default=32, help="test scenes of two or more shapes")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model, vq, margs = load(args.model, device)
    encoder = demo_text.DemoTextEncoder(margs["caption_dim"], margs["cls_token_num"])
    batch = [s for s in scenes.scenes(range(10 * args.num), "test") if len(s.shapes) >= 2][: args.num]
    size = 16 * int(margs["block_size"] ** 0.5)
    rgb = scenes.render(batch, size, device)
    tokens = vq.encode(scenes.to_model_range(rgb))
    types = ["canny"] * len(batch)
    maps = train_demo.control_maps(batch, types, rgb, size, device)
    grid = size // 16
    _, inside = scenes.labels(batch, size, device)
    in_shape = inside.any(1)[:, 8::16, 8::16].flatten(1)
    entry = train_demo.entry_weights(batch, size, grid, 2.0, device) > 1

    def nats(captioned, control, drop=False):
        dropped = torch.full((len(batch),), drop, device=device)
        prefix, mask, controls = train_demo.gpt_inputs(model, encoder, captioned, control, types, dropped)
        logits = train_demo.teacher_forced_logits(model, prefix, mask, controls, tokens)
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none").view(tokens.shape)

    cases = [("true", nats(batch, maps)),
             ("colours rotated", nats([rotated(s) for s in batch], maps)),
             ("shapes recoloured", nats([shapes_recoloured(s) for s in batch], maps)),
             ("background recoloured", nats([background_recoloured(s) for s in batch], maps)),
             ("other control", nats(batch, maps.roll(1, 0))),
             ("dropped both", nats(batch, maps, drop=True))]
    print(f"{args.model}: {len(batch)} test scenes, {size} px, nats per token (teacher forced)")
    print(f"| inputs | all | inside shapes ({int(in_shape.sum())}) | regions' first tokens ({int(entry.sum())}) |")
    print("|---|---|---|---|")
    for name, v in cases:
        print(f"| {name} | {v.mean():.3f} | {v[in_shape].mean():.3f} | {v[entry].mean():.3f} |")


if __name__ == "__main__":
    main()
