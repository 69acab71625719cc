"""Train the demo model on the procedural scenes (fast_inference/scenes.py): a reduced-width VQ-16, then a small
t2i ControlAR of the official architecture (DINOv2-style "tiny" control encoder, the demo text encoder).

    python scripts/train_demo.py --preset cpu --out checkpoints/demo                 # both phases on the CPU
    python scripts/train_demo.py --preset gpu --phase vq --device cuda --out DIR      # one H200, then:
    python scripts/train_demo.py --preset gpu --phase gpt --device cuda --out DIR     # reads DIR/vq.* (or --vq-from)

Writes into --out: vq.json + vq.safetensors (the tokenizer, official key names), gpt.json + gpt.safetensors (the
model; its metadata names the text encoder and the image size) and train_log.jsonl. Weights are stored in fp16,
and the GPT learns from the tokens of the stored (fp16) VQ. The VQ learns to reconstruct scenes (MSE; l2-normalised
codebook with a commitment loss, unused codes restarted from encoder outputs); the GPT learns the tokens of scenes
given their caption and a control map of a random type, caption and control dropped together for CFG (10%, as
ControlAR trains). Scene i is a function of i, so the same seed, preset, device and dtype give the same weights;
--time-limit stops a phase early (and says so) rather than lose it. A mistake in the flags, or a folder they name
that lacks its files, is one `error:` line and exit code 2, before --out is made or anything in it is written.
"""
import copy
import json
import math
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fast_inference import demo_text, scenes
from fast_inference.components import checked_device
from fast_inference.flags import Parser
from fast_inference.model import ModelArgs, Transformer
from fast_inference.settings import UserError
from fast_inference.vq import VQConfig, VQModel

# Control types and how often the GPT sees each (canny, the measured one, most).
CONTROL_MIX = {"canny": 0.4, "hed": 0.2, "lineart": 0.1, "depth": 0.15, "seg": 0.15}
# GPT layers: a multiple of 3 (the official model injects control before blocks 0, L, 2L with L = n_layer // 3 and
# has three control lists). Weights: cpu ~12 MB, gpu ~22 MB in fp16.
PRESETS = {
    # 128 px, 8x8 tokens: trains on two CPU cores in a few hours
    "cpu": dict(size=128,
                vq=dict(codebook_size=1024, ch=32, ch_mult=[1, 1, 2, 2, 4], z_channels=64, num_res_blocks=1,
                        norm_groups=8),
                vq_steps=4000, vq_batch=8, vq_lr=1e-4, vq_crop=64,
                gpt=dict(dim=128, n_layer=6, n_head=4, caption_dim=64, cls_token_num=24, adapter_size="tiny"),
                gpt_steps=3000, gpt_batch=32, gpt_lr=8e-4, pool=15000, ema=0.999),
    # 256 px, 16x16 tokens: one H200, each phase well inside a 10-minute command
    "gpu": dict(size=256,
                vq=dict(codebook_size=4096, ch=32, ch_mult=[1, 1, 2, 2, 2], z_channels=64, num_res_blocks=2,
                        norm_groups=8),
                vq_steps=16000, vq_batch=32, vq_lr=1e-4, vq_crop=128,
                gpt=dict(dim=256, n_layer=6, n_head=8, caption_dim=64, cls_token_num=24, adapter_size="tiny"),
                gpt_steps=8000, gpt_batch=128, gpt_lr=6e-4, pool=200000, ema=0.9995),
    # the tests': seconds on a CPU
    "test": dict(size=64,
                 vq=dict(codebook_size=64, ch=32, ch_mult=[1, 1, 1, 1, 1], z_channels=32, num_res_blocks=1,
                         norm_groups=8),
                 vq_steps=3, vq_batch=2, vq_lr=1e-4, vq_crop=32,
                 gpt=dict(dim=32, n_layer=3, n_head=2, caption_dim=16, cls_token_num=20, adapter_size="tiny"),
                 gpt_steps=3, gpt_batch=4, gpt_lr=6e-4, pool=8, ema=0.9),
}
DROP = 0.1  # caption and control dropped together, for CFG
UNUSED_AT_INFERENCE = ("condition_embeddings.weight", "condition_mlp.uncond_embedding")  # not stored
COMMIT = 0.25  # LlamaGen's commitment weight
RESTART_EVERY = 200  # VQ steps between restarts of unused codes
HIDE_SHARE = 0.5  # --colour-weight: the captioned rows with shapes (--hide-dropped: all) with a shape hidden
RECOLOUR_SHARE = 0.5  # --hide-until e1: the hidden rows whose context shows the shape in a wrong colour (default)
ENTRY_TOKENS = 4  # --entry-weight's tokens per region: the first of a shape's top row, whose colour the rest copy
FULL_EVERY = 4  # every 4th VQ step sees whole images (as many pixels as the other steps' random crops)
# --phase caption (issue 77): the shipped model's caption MLP put each shape's colour by its kind into the captions'
# mean at 99.1% (512 test captions) with its outputs 1.7% changed, in 800 steps of Adam at 1e-3 (docs/demo_model.md)
CAPTION_STEPS, CAPTION_BATCH, CAPTION_LR, CAPTION_KEEP = 800, 64, 1e-3, 10.0
VQ_FILES = ("vq.json", "vq.safetensors")  # a trained VQ's folder holds these (--vq-from's, --phase gpt's --out)


def parse_args(argv=None):
    p = Parser(description=__doc__.split("\n")[0])  # a bad flag: one error line, exit code 2
    p.add_argument("--out", required=True, help="folder for the configs, weights and log")
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--phase", choices=["vq", "gpt", "all", "caption"], default="all",
                   help="caption: only --gpt-from's caption MLP, trained so that the mean of a caption's embedded "
                   "tokens (all an image query reads of it) tells each shape's colour by its kind, its outputs kept "
                   "near the old ones; captions only, a minute on a CPU; then --phase gpt --gpt-from its --out")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vq-steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--gpt-steps", type=int, default=None, help="default: the preset's")
    p.add_argument("--vq-from", default=None, help="folder of a trained vq.json + vq.safetensors, copied into --out")
    p.add_argument("--gpt-from", default=None, help="folder of a trained gpt.json + gpt.safetensors to go on from "
                   "(its weights start the model and its average; the optimiser and schedule start afresh)")
    p.add_argument("--time-limit", type=float, default=None, help="seconds per phase; stops early and saves")
    p.add_argument("--resume", action="store_true", help="go on with the GPT run whose state --out holds "
                   "(gpt_state.pt: weights, average, optimiser, schedule, data order), up to its --gpt-steps")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default torch's); on cores shared with "
                   "other work use 1: OpenMP's threads spin waiting for a descheduled peer (30x slower seen)")
    p.add_argument("--entry-weight", type=float, default=None, help="loss weight of the first ENTRY_TOKENS tokens of "
                   "each shape and background part in raster order, where a colour is decided (1: plain loss)")
    p.add_argument("--colour-weight", type=float, default=None, help="weight of a training-only loss asking the GPT's "
                   "last hidden state where a shape begins, after tokens drawn without it, which colour it has (0: none)")
    p.add_argument("--hide-until", choices=["onset", "e1"], default=None, help="--colour-weight's hidden context "
                   "ends at the shape's onset (default), or at e1, its first token whose patch centre is inside it, "
                   "the context then half without the shape, half with it in a wrong colour; the head reads there")
    p.add_argument("--recolour-share", type=float, default=None, help="--hide-until e1: the share of the hidden rows "
                   f"whose context shows the shape in a wrong colour, the rest without it (default {RECOLOUR_SHARE})")
    p.add_argument("--hide-dropped", action="store_true", default=None, help="--colour-weight's hidden rows drawn "
                   "among all rows with shapes, the CFG-dropped ones too (token loss only: no caption names a colour), "
                   "so that the null branch learns the context before a shape can be wrong too")
    p.add_argument("--kind-weight", type=float, default=None, help="weight of a training-only loss asking the control "
                   "adapter's features at each token inside a shape which kind the shape is (a linear head; 0: none): "
                   "the caption names a shape's colour by its kind, which the features told 71%% of the time where "
                   "its colour is decided (tools/demo_binding.py --kinds)")
    p.add_argument("--binding-weight", type=float, default=None, help="weight of a training-only loss asking each "
                   "shape's colour from its kind and the mean of the embedded caption's tokens, which is all an image "
                   "query reads of the caption (a linear head; 0: none): the demo words' additive embeddings leave "
                   "which colour goes with which kind nearly out of it (tools/demo_binding.py --attention)")
    p.add_argument("--caption-steps", type=int, default=CAPTION_STEPS, help="--phase caption's steps of "
                   f"{CAPTION_BATCH} captions (default %(default)s)")
    p.add_argument("--caption-keep", type=float, default=CAPTION_KEEP, help="--phase caption: the weight of the "
                   "caption MLP's relative squared change beside the binding head's loss (default %(default)s)")
    p.add_argument("--gpt-batch", type=int, default=None, help="scenes per GPT step (default: the preset's)")
    p.add_argument("--gpt-lr", type=float, default=None, help="the GPT's peak learning rate (default: the preset's)")
    p.add_argument("--log-every", type=int, default=50)
    return p.parse_args(argv)


# ---- set-up -------------------------------------------------------------------------------------

def autocast(device):
    """bf16 on CUDA, nothing (fp32) on the CPU."""
    return torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)


def seed_everything(seed, device):
    torch.manual_seed(seed)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cudnn.benchmark = False


def lr_at(step, steps, peak):
    """Linear warm-up over 5% of the steps, then a cosine down to 10% of the peak."""
    warm = max(1, steps // 20)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class Log:
    def __init__(self, out):
        self.f = open(os.path.join(out, "train_log.jsonl"), "a", buffering=1)

    def __call__(self, **fields):
        self.f.write(json.dumps(fields) + "\n")
        print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items()), flush=True)


def save_fp16(module, path, drop=(), metadata=None):
    """The state dict in fp16 (float tensors), without the keys in drop, written atomically."""
    sd = {k: (v.half() if v.is_floating_point() else v).contiguous().cpu() for k, v in module.state_dict().items()
          if k not in drop}
    save_file(sd, path + ".tmp", metadata=metadata)
    os.replace(path + ".tmp", path)


def write_json(obj, path):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


SCENES = {}  # (split, index) -> scene, built once per process: a GPU step's 128 scenes took 50 ms of Python anew


def cached_scenes(indices, split):
    """scenes.scenes(indices, split) from SCENES (the scenes are not modified: callers that alter one copy it)."""
    missing = [i for i in indices if (split, i) not in SCENES]
    SCENES.update(((split, i), s) for i, s in zip(missing, scenes.scenes(missing, split)))
    return [SCENES[split, i] for i in indices]


def images(indices, size, device, split="train"):
    """Rendered scenes as the VQ and the model see them: (scenes, uint8 (B, 3, S, S), float [-1, 1])."""
    batch = cached_scenes(list(indices), split)
    rgb = scenes.render(batch, size, device)
    return batch, rgb, scenes.to_model_range(rgb)


# ---- the VQ ----------------------------------------------------------------------------------------

def quantize(vq, z):
    """quant_conv output (B, C, h, w) -> (z_q straight-through, codebook + commitment loss, indices (B*h*w,)).
    Both sides l2-normalised, as the official quantizer (and Quantizer.nearest at inference)."""
    b, c, h, w = z.shape
    zf = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, c), dim=-1)
    codes = vq.quantize.codebook()
    idx = (zf @ codes.t()).argmax(1)  # the nearest unit vector is the one of largest dot product
    zq = codes[idx]
    loss = F.mse_loss(zq, zf.detach()) + COMMIT * F.mse_loss(zf, zq.detach())
    zq = zf + (zq - zf).detach()
    return zq.view(b, h, w, c).permute(0, 3, 1, 2), loss, idx, zf.detach()


def vq_loss(vq, x):
    z = vq.quant_conv(vq.encoder(x))
    zq, q_loss, idx, zf = quantize(vq, z)
    rec = vq.decoder(vq.post_quant_conv(zq)).float()
    mse = F.mse_loss(rec, x)
    return mse + q_loss, mse, idx, zf


def crop(x, side, gen):
    """One random side x side window of the batch (the encoder and decoder are convolutional; their attention and
    norms see whole images every FULL_EVERY steps)."""
    i, j = torch.randint(0, x.shape[-1] - side + 1, (2,), generator=gen).tolist()
    return x[..., i:i + side, j:j + side]


def restart_unused(vq, used, zf, gen):
    """Unused codes since the last restart take the directions of random encoder outputs of this batch."""
    dead = (used == 0).nonzero()[:, 0]
    if len(dead):
        pick = torch.randint(0, zf.shape[0], (len(dead),), generator=gen, device="cpu").to(zf.device)
        with torch.no_grad():
            vq.quantize.embedding.weight[dead] = zf[pick].to(vq.quantize.embedding.weight.dtype)
    return len(dead)


def train_vq(args, preset, device, log):
    cfg = VQConfig(**preset["vq"])
    write_json(preset["vq"], os.path.join(args.out, "vq.json"))
    vq = VQModel(cfg).to(device).to(memory_format=torch.contiguous_format).train()
    # (contiguous, not channels-last: vq.py's CUDA kernels, which have no backward, take only channels-last tensors)
    steps = preset["vq_steps"] if args.vq_steps is None else args.vq_steps
    B, size = preset["vq_batch"], preset["size"]
    # Adam at LlamaGen's 1e-4: at 2e-4 and above this VQ stalls on the scenes' flat colours
    opt = torch.optim.Adam(vq.parameters(), lr=preset["vq_lr"], betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed + 1)
    used = torch.zeros(cfg.codebook_size, device=device)
    t0, done = time.perf_counter(), 0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, preset["vq_lr"])
        side = preset["vq_crop"]
        if step % FULL_EVERY == FULL_EVERY - 1:
            _, _, x = images(range(step * B, step * B + max(1, B * side * side // (size * size))), size, device)
        else:
            _, _, x = images(range(step * B, (step + 1) * B), size, device)
            x = crop(x, side, gen)
        with autocast(device):
            loss, mse, idx, zf = vq_loss(vq, x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        used += torch.bincount(idx, minlength=cfg.codebook_size)
        done = step + 1
        if done % RESTART_EVERY == 0 and done < 0.8 * steps:
            log(phase="vq", step=done, restarted_codes=restart_unused(vq, used, zf, gen))
            used.zero_()
        if done % args.log_every == 0 or done == steps:
            log(phase="vq", step=done, loss=loss.item(), psnr_train=psnr(mse.item()), lr=opt.param_groups[0]["lr"],
                seconds=round(time.perf_counter() - t0, 1))
        if args.time_limit and time.perf_counter() - t0 > args.time_limit:
            log(phase="vq", stopped_early_at=done, of=steps)
            break
    save_fp16(vq, os.path.join(args.out, "vq.safetensors"))
    log(phase="vq", trained_steps=done, val_psnr=val_psnr(load_vq(args.out, device), preset["size"], device))
    return done


@torch.no_grad()
def val_psnr(vq, size, device, n=32):
    """PSNR (dB, 0..255 images) of the stored VQ's reconstructions of n held-out scenes, through its inference path
    (encode to tokens, decode_code, rounded to uint8 as a saved PNG is)."""
    _, rgb, x = images(range(n), size, device, "val")
    rec = scenes.to_uint8((vq.decode_code(vq.encode(x)).clamp(-1, 1) + 1) * 127.5)
    mse = (rec.float() - rgb.float()).pow(2).mean().item()
    return round(10 * math.log10(255**2 / max(mse, 1e-12)), 2)


def psnr(mse_in_model_range):
    """PSNR in dB of images in [-1, 1] (peak-to-peak 2) from their MSE."""
    return 10 * math.log10(4 / max(mse_in_model_range, 1e-12))


def load_vq(out, device):
    """The stored VQ (fp16 weights, run in float32 as the project runs every VQ)."""
    with open(os.path.join(out, "vq.json")) as f:
        vq = VQModel(VQConfig(**json.load(f)))
    vq.load_state_dict({k: v.float() for k, v in load_file(os.path.join(out, "vq.safetensors")).items()})
    return vq.to(device).eval().requires_grad_(False)


# ---- the GPT ---------------------------------------------------------------------------------------

def teacher_forced_hidden(model, prefix, text_mask, controls, tokens):
    """The model's own blocks over a whole sequence (no caches): prefix (B, T, D), text mask (B, T) bool, control
    lists (3, B, N, D), image tokens (B, N) -> the last hidden states (B, N, D) that predict them."""
    T = prefix.shape[1]
    x = torch.cat([prefix, model.tok_embeddings(tokens[:, :-1])], 1)  # positions 0 .. T + N - 2
    key_valid = torch.cat([text_mask, text_mask.new_ones(tokens.shape[0], tokens.shape[1] - 1)], 1)
    return model.blocks(x, torch.arange(x.shape[1], device=x.device), key_valid, controls)[:, T - 1:]


def teacher_forced_logits(model, prefix, text_mask, controls, tokens):
    """-> logits (B, N, V) float32 predicting the tokens: the model's forward (logits of its blocks)."""
    return model.logits(teacher_forced_hidden(model, prefix, text_mask, controls, tokens))


def control_features(model, maps, types):
    """uint8 control maps (B, 3, S, S) of the given types -> adapter features (B, Nc, D): each type resized to the
    14-px grid its own way (nearest for canny and seg, bicubic for the others: the adapter's resize for that type)."""
    x = scenes.to_model_range(maps)
    order, parts = [], []
    for t in sorted(set(types)):
        rows = [i for i, u in enumerate(types) if u == t]
        order += rows
        parts.append(model.adapter(x[rows], t))
    features = model.adapter_mlp(torch.cat(parts))
    return features[torch.argsort(torch.tensor(order, device=features.device))]


def control_maps(batch, types, rgb, size, device):
    """Each scene's control map of its type, (B, 3, S, S) uint8."""
    out = torch.empty_like(rgb)
    for t in set(types):
        rows = [i for i, u in enumerate(types) if u == t]
        out[rows] = scenes.control([batch[i] for i in rows], t, size, device, rgb=rgb[rows])
    return out


def gpt_inputs(model, encoder, batch, maps, types, drop, features=None):
    """(prefix (B, T, D), text mask (B, T) bool, control lists (3, B, N, D)); rows in drop get the null caption
    (cut by their own mask, as at inference) and zero control features. features: control_features' own, if made."""
    emb, mask = encoder.encode_left_padded([s.caption for s in batch])
    emb, mask = emb.to(maps.device), mask.to(maps.device).bool()
    null = model.cls_embedding.uncond_embedding[: emb.shape[1]].to(emb.dtype)
    emb = torch.where(drop[:, None, None], null, emb)
    features = control_features(model, maps, types) if features is None else features
    features = torch.where(drop[:, None, None], torch.zeros_like(features), features)
    return model.cls_embedding(emb), mask, model.control_tokens(features)


def init_gpt(model):
    """The official initialisation (every Linear and Embedding from N(0, 0.02), biases zero, the output layer
    zero); the control encoder's position table and CLS token from N(0, 0.02) as they start at zero."""
    for m in model.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                torch.nn.init.zeros_(m.bias)
    torch.nn.init.zeros_(model.output.weight)
    emb = model.adapter.model.embeddings
    torch.nn.init.normal_(emb.position_embeddings, std=0.02)
    torch.nn.init.normal_(emb.cls_token, std=0.02)


def gpt_args(preset, vq_cfg):
    grid = preset["size"] // 16
    return dict(preset["gpt"], vocab_size=vq_cfg["codebook_size"], block_size=grid * grid, condition_type="canny")


def token_pool(preset, vq, device):
    """The pool's tokens (pool, N) int16, encoded once; None for a preset that encodes each batch's scenes now."""
    size, pool = preset["size"], preset["pool"]
    if not pool:
        return None
    chunk = 256 if device.type == "cuda" else 64
    with torch.no_grad():
        return torch.cat([vq.encode(images(range(i, min(i + chunk, pool)), size, device)[2]).short()
                          for i in range(0, pool, chunk)])


def tokens_of(indices, table, preset, vq, device):
    """(B, N) tokens of those train scenes: from the pool, or encoded now."""
    if table is not None:
        return table[torch.as_tensor(list(indices), device=table.device)].long()
    with torch.no_grad():
        return vq.encode(images(indices, preset["size"], device)[2])


def ema_decay(preset, steps):
    """The preset's average, with a horizon 1 / (1 - decay) of at most a tenth of the run: a short run's average
    must not still hold the model of its first steps."""
    return min(preset["ema"], 1 - 10 / max(steps, 10))


def gpt_step_batch(step, preset, rng):
    """This step's train indices (from the pool, or fresh ones) and their control types."""
    B = preset["gpt_batch"]
    if preset["pool"]:
        indices = rng.randint(0, preset["pool"], size=B).tolist()
    else:
        indices = list(range(step * B, (step + 1) * B))
    types = rng.choice(list(CONTROL_MIX), size=B, p=list(CONTROL_MIX.values())).tolist()
    return indices, types, rng.random_sample(B) < DROP


def token_regions(batch, size, grid, device):
    """(B, grid * grid) each token's region, its centre pixel's: 0 top background, 1 bottom, 2 + k shape slot k."""
    label, inside = scenes.labels(batch, size, device)
    region = (label == 1).long()
    for k in range(inside.shape[1]):
        region = torch.where(inside[:, k], 2 + k, region)
    step = size // grid
    return region[:, step // 2::step, step // 2::step].flatten(1)


def entry_weights(batch, size, grid, weight, device):
    """(B, grid * grid) loss weights: `weight` on the first ENTRY_TOKENS tokens (raster order) of each region (each
    shape, each background part; a token's region is its centre pixel's), 1 elsewhere. Teacher forced, a region's
    later tokens copy the colour its first ones show: without this the caption's colours weigh a few tokens in 256."""
    region = token_regions(batch, size, grid, device)
    one_hot = F.one_hot(region, 2 + 3)
    seen = (one_hot.cumsum(1) * one_hot).sum(-1)  # 1 for a region's first token, 2 for its second, ...
    return torch.where(seen <= ENTRY_TOKENS, weight, 1.0).float()


def by_region(batch, size, grid, device, table):
    """(B, grid * grid) each token's entry of its scene's row of table (top, bottom, shape slots 0-2: token_regions'
    order)."""
    return torch.tensor(table, device=device).gather(1, token_regions(batch, size, grid, device))


def token_colours(batch, size, grid, device):
    """(B, grid * grid) the palette index (scenes.COLOURS) of each token's region."""
    table = [[scenes.COLOURS.index(c) for c in [s.top, s.bottom or s.top] + [x.colour for x in s.shapes]]
             + [0] * (3 - len(s.shapes)) for s in batch]  # absent slots: no token lies in them
    return by_region(batch, size, grid, device, table)


def token_kinds(batch, size, grid, device):
    """(B, grid * grid) the kind (scenes.KINDS index) of the shape each token's centre pixel is inside, -1 outside."""
    table = [[-1, -1] + [scenes.KINDS.index(x.kind) for x in s.shapes] + [-1] * (3 - len(s.shapes)) for s in batch]
    return by_region(batch, size, grid, device, table)


def kind_loss(head, features, kinds, drop):
    """(cross-entropy, accuracy) of the kind head on the control features (B, N, D) at the tokens inside a shape
    (kinds (B, N), -1 outside), the dropped rows' (zeroed features) skipped; none inside: no loss."""
    inside = (kinds >= 0) & ~drop[:, None]
    if not inside.any():
        return features.new_zeros(()), torch.tensor(float("nan"))
    logits = head(F.rms_norm(features[inside].float(), features.shape[-1:]))
    return F.cross_entropy(logits, kinds[inside]), (logits.argmax(-1) == kinds[inside]).float().mean()


def binding_loss(head, prefix, mask, batch, drop):
    """(cross-entropy, accuracy) of the binding head: each shape's colour from its kind and the mean of its caption's
    embedded tokens (prefix (B, T, D) over the text mask), in the captioned rows. The text positions' queries and keys
    are zero (their RoPE rows are), so every image query reads the caption as such a mean, in which additive word
    embeddings lose which colour goes with which kind (tools/demo_binding.py --attention)."""
    picked = [(b, scenes.KINDS.index(x.kind), scenes.COLOURS.index(x.colour))
              for b, sc in enumerate(batch) if not drop[b] for x in sc.shapes]
    if not picked:
        return prefix.new_zeros(()), torch.tensor(float("nan"))
    rows, kinds, colours = (torch.tensor(x, device=prefix.device) for x in zip(*picked))
    text = mask[..., None].float()
    mean = (prefix.float() * text).sum(1) / text.sum(1).clamp(min=1)
    logits = head(F.rms_norm(mean, mean.shape[-1:])).view(len(batch), len(scenes.KINDS), -1)[rows, kinds]
    return F.cross_entropy(logits, colours), (logits.argmax(-1) == colours).float().mean()


def without_shape(s, k):
    """A copy of scene s without its shape k."""
    s = copy.deepcopy(s)
    s.shapes = [x for j, x in enumerate(s.shapes) if j != k]
    return s


def recoloured(s, k, pick=0):
    """A copy of scene s with its shape k in the pick-th (cyclic) palette colour that is neither its background's
    nor a shape's (a wrong colour: --hide-until e1, tools/demo_colour_trace.py)."""
    free = [c for c in scenes.COLOURS if c not in {s.top, s.bottom} | {x.colour for x in s.shapes}]
    s = copy.deepcopy(s)
    s.shapes[k].colour = free[pick % len(free)]
    return s


def touched_tokens(batch, size, grid, device):
    """(B, 3, grid * grid): whether each token's patch holds any pixel of shape slot k."""
    _, inside = scenes.labels(batch, size, device)
    step = size // grid
    return inside.view(len(batch), 3, grid, step, grid, step).any(5).any(3).flatten(2)


def onsets(batch, slots, size, grid, device):
    """(R,) each scene's shape slots[i] onset: the first token in raster order whose patch holds any of its pixels."""
    touched = touched_tokens(batch, size, grid, device)
    return touched[torch.arange(len(batch), device=device), torch.as_tensor(slots, device=device)].int().argmax(1)


def entries(batch, slots, size, grid, device):
    """(R,) each scene's shape slots[i] e1: its first token in raster order whose patch centre pixel is inside it
    (token_regions == 2 + k); the onset where no centre is inside."""
    inner = token_regions(batch, size, grid, device) == 2 + torch.as_tensor(slots, device=device)[:, None]
    return torch.where(inner.any(1), inner.int().argmax(1), onsets(batch, slots, size, grid, device))


def hide_before_onset(batch, tokens, vq, size, drop, until="onset", dropped=False, recolour_share=RECOLOUR_SHARE):
    """--colour-weight's rows: in a random HIDE_SHARE of the captioned rows with shapes (dropped, --hide-dropped: of
    all rows with shapes, the CFG-dropped too), the tokens before one random shape's onset replaced by those of the
    scene drawn without it. The VQ's tokens next to a shape carry some of its colour, so a model taught on true tokens
    reads a shape's colour from them, and at sampling, where nothing drew them yet, guesses it
    (tools/demo_binding.py --colours). until "e1": hidden up to the shape's e1 instead, in a recolour_share of those
    rows by the scene with the shape in a wrong colour. -> (tokens, rows (R,), onsets or e1s (R,), colours (R,))."""
    count = torch.tensor([len(s.shapes) for s in batch])
    picked = (torch.rand(len(batch)) < HIDE_SHARE) & (count > 0) & (~drop.cpu() | dropped)  # the same draws either way
    slot = (torch.rand(len(batch)) * count).long()  # uniform over the row's shapes
    rows = picked.nonzero().flatten().tolist()
    device = tokens.device
    sub, ks = [batch[r] for r in rows], slot[rows].tolist()
    colours = torch.tensor([scenes.COLOURS.index(s.shapes[k].colour) for s, k in zip(sub, ks)], device=device)
    rows = torch.tensor(rows, dtype=torch.long, device=device)
    if not len(sub):
        return tokens, rows, rows, colours
    recolour = None
    if until == "e1":  # drawn after onset mode's draws, so that mode's stay as they were
        wrong = (torch.rand(len(sub)) < recolour_share).tolist()
        pick = torch.randint(0, len(scenes.COLOURS), (len(sub),)).tolist()
        recolour = [p if w else None for w, p in zip(wrong, pick)]
    tokens = tokens.clone()
    tokens[rows], at = shape_hidden(sub, ks, tokens[rows], vq, size, until, recolour)
    return tokens, rows, at, colours


@torch.no_grad()
def shape_hidden(batch, slots, tokens, vq, size, until="onset", recolour=None):
    """-> (tokens (R, N) with those before each scene's shape slots[i] onset (until "e1": e1) taken from the scene
    drawn without it (recolour[i] not None: with it in recoloured's colour recolour[i]), the onsets or e1s (R,))."""
    find = entries if until == "e1" else onsets
    at = find(batch, slots, size, math.isqrt(tokens.shape[1]), tokens.device)
    recolour = recolour or [None] * len(batch)
    hidden = [without_shape(s, k) if p is None else recoloured(s, k, p) for s, k, p in zip(batch, slots, recolour)]
    clean = vq.encode(scenes.to_model_range(scenes.render(hidden, size, tokens.device)))
    before = torch.arange(tokens.shape[1], device=tokens.device)[None] < at[:, None]
    return torch.where(before, clean.to(tokens.dtype), tokens), at


def colour_loss(head, hidden, rows, at, colours, drop):
    """(cross-entropy, accuracy) of the colour head at the hidden shapes' onsets: the colour of the shape about to
    begin, from the GPT's last hidden state that predicts the onset token (only the caption and the control tell).
    Rows in drop (--hide-dropped's) are skipped: no caption names their colour."""
    keep = ~drop[rows]
    rows, at, colours = rows[keep], at[keep], colours[keep]
    if not len(rows):
        return hidden.new_zeros(()), torch.tensor(float("nan"))
    logits = head(F.rms_norm(hidden[rows, at].float(), hidden.shape[-1:]))
    return F.cross_entropy(logits, colours), (logits.argmax(-1) == colours).float().mean()


def gpt_loss(model, encoder, vq, indices, types, drop, tokens, preset, device, split="train", entry_weight=1.0,
             colour=None, hide_until="onset", hide_dropped=False, recolour_share=RECOLOUR_SHARE, kind=None,
             binding=None):
    """-> (the tokens' cross-entropy, entry-weighted, {}). With colour = (head, weight): some rows' tokens before a
    shape's onset or e1 (hide_until) hidden (hide_before_onset; hide_dropped: dropped rows too), plus weight x the
    colour head's loss there (captioned rows only); with kind = (head, weight): plus weight x the kind head's loss on
    the control features (kind_loss); with binding = (head, weight): plus weight x the binding head's loss on the
    embedded caption (binding_loss); the heads' accuracies in the dict."""
    size = preset["size"]
    batch, rgb, _ = images(indices, size, device, split)
    maps = control_maps(batch, types, rgb, size, device)
    drop = torch.as_tensor(drop, device=device)
    if colour is not None:
        tokens, rows, at, colours = hide_before_onset(batch, tokens, vq, size, drop, hide_until, hide_dropped,
                                                      recolour_share)
    with autocast(device):
        features = control_features(model, maps, types) if kind is not None else None
        prefix, mask, controls = gpt_inputs(model, encoder, batch, maps, types, drop, features)
        hidden = teacher_forced_hidden(model, prefix, mask, controls, tokens)
        logits = model.logits(hidden)
    loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none").view(tokens.shape)
    if entry_weight == 1.0:
        loss = loss.mean()
    else:
        w = entry_weights(batch, size, math.isqrt(tokens.shape[1]), entry_weight, device)
        loss = (loss * w).sum() / w.sum()
    scores = {}
    if colour is not None:
        head, weight = colour
        extra, scores["colour_accuracy_at_onsets"] = colour_loss(head, hidden, rows, at, colours, drop)
        loss = loss + weight * extra
    if kind is not None:
        head, weight = kind
        kinds = token_kinds(batch, size, math.isqrt(tokens.shape[1]), device)
        extra, scores["kind_accuracy"] = kind_loss(head, features, kinds, drop)
        loss = loss + weight * extra
    if binding is not None:
        head, weight = binding
        extra, scores["binding_accuracy"] = binding_loss(head, prefix, mask, batch, drop)
        loss = loss + weight * extra
    return loss, scores


def train_gpt(args, preset, device, log, recipe, state):
    """The GPT phase, with check_run's recipe and --resume's state (None for a new run)."""
    with open(os.path.join(args.out, "vq.json")) as f:
        vq_cfg = json.load(f)
    vq = load_vq(args.out, device)
    margs = gpt_args(preset, vq_cfg)
    write_json(margs, os.path.join(args.out, "gpt.json"))
    with torch.device(device):
        model = Transformer(ModelArgs(**margs))
    init_gpt(model)
    before = 0
    if args.gpt_from:  # the stored weights (fp16, checked by check_gpt_from); the keys not stored keep their init
        path = os.path.join(args.gpt_from, "gpt.safetensors")
        model.load_state_dict({k: v.float() for k, v in load_file(path).items()}, strict=False)
        with safe_open(path, "pt") as f:
            before = int(f.metadata().get("trained_steps", 0))
    model.train()
    ema = copy.deepcopy(model).eval().requires_grad_(False)
    encoder = demo_text.DemoTextEncoder(margs["caption_dim"], margs["cls_token_num"])
    steps = preset["gpt_steps"] if args.gpt_steps is None else args.gpt_steps
    start = 0
    # the colour, kind and binding heads: training only (not stored with the model); one names a hidden shape's colour
    # at its onset, one each shape token's kind from the control features, one each shape's colour from its kind and
    # the embedded caption's mean
    head = torch.nn.Linear(margs["dim"], len(scenes.COLOURS), device=device) if recipe["colour_weight"] else None
    kind_head = torch.nn.Linear(margs["dim"], len(scenes.KINDS), device=device) if recipe["kind_weight"] else None
    binding_head = torch.nn.Linear(margs["dim"], len(scenes.KINDS) * len(scenes.COLOURS), device=device) \
        if recipe["binding_weight"] else None
    heads = (head, kind_head, binding_head)
    trained = list(model.parameters()) + [p for h in heads if h for p in h.parameters()]
    decay = [p for p in trained if p.dim() >= 2]
    rest = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}],
                            lr=recipe["gpt_lr"], betas=(0.9, 0.95))
    rng = np.random.RandomState(args.seed + 2)
    t0 = time.perf_counter()
    if args.resume:
        start, steps, table, before = resume(state, model, ema, heads, opt, rng, device)
        state.clear()  # its copies of the weights and the pool (main holds the dict too)
        log(phase="gpt", resumed_at=start, of=steps, **recipe)
    else:
        table = token_pool(preset, vq, device)
        log(phase="gpt", **recipe)
    preset = dict(preset, gpt_batch=recipe["gpt_batch"])
    colour = (head, recipe["colour_weight"]) if head else None
    kind = (kind_head, recipe["kind_weight"]) if kind_head else None
    binding = (binding_head, recipe["binding_weight"]) if binding_head else None
    log(phase="gpt", tokens_ready_seconds=round(time.perf_counter() - t0, 1))
    val = val_batch(preset, vq, device)
    done = start
    for step in range(start, steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, recipe["gpt_lr"])
        indices, types, drop = gpt_step_batch(step, preset, rng)
        loss, scores = gpt_loss(model, encoder, vq, indices, types, drop,
                                tokens_of(indices, table, preset, vq, device), preset, device,
                                entry_weight=recipe["entry_weight"], colour=colour,
                                hide_until=recipe["hide_until"], hide_dropped=recipe["hide_dropped"],
                                recolour_share=recipe["recolour_share"], kind=kind, binding=binding)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        update_ema(ema, model, ema_decay(preset, steps) if step > steps // 10 else 0.0)
        done = step + 1
        if done % args.log_every == 0 or done == steps:
            fields = dict(phase="gpt", step=done, loss=loss.item(), lr=opt.param_groups[0]["lr"])
            fields.update({name: score.item() for name, score in scores.items()})
            if done % (4 * args.log_every) == 0 or done == steps:
                with torch.no_grad():
                    fields["val_loss_ema"] = gpt_loss(ema, encoder, vq, *val, preset, device, split="val")[0].item()
                    fields["val_loss"] = gpt_loss(model, encoder, vq, *val, preset, device, split="val")[0].item()
            log(**fields, seconds=round(time.perf_counter() - t0, 1))
        if args.time_limit and time.perf_counter() - t0 > args.time_limit and done < steps:
            log(phase="gpt", stopped_early_at=done, of=steps)
            break
    save_state(os.path.join(args.out, "gpt_state.pt"), model, ema, heads, opt, rng, done, steps, table,
               recipe, before)
    meta = {"text_encoder": demo_text.NAME, "text_seed": str(demo_text.SEED), "image_size": str(preset["size"]),
            "data": "fast_inference/scenes.py", "trained_steps": str(before + done), "seed": str(args.seed),
            "planned_steps": str(before + steps)}
    save_fp16(ema, os.path.join(args.out, "gpt.safetensors"), metadata=meta,
              drop=UNUSED_AT_INFERENCE)
    return done


def caption_loss(model, before, head, encoder, batch):
    """(the binding head's cross-entropy and accuracy on the model's embedded captions of batch, the caption MLP's
    squared change from `before`'s over the text tokens relative to their squared norm)."""
    emb, mask = encoder.encode_left_padded([s.caption for s in batch])
    emb, mask = emb.to(model.cls_embedding.cap_proj.fc1.weight.device), mask.bool()
    new, old = model.cls_embedding(emb), before(emb)
    ce, accuracy = binding_loss(head, new, mask.to(new.device), batch, torch.zeros(len(batch), dtype=torch.bool))
    text = mask.to(new.device)[..., None].float()
    change = (((new - old) ** 2) * text).sum() / ((old**2) * text).sum()
    return ce, accuracy, change


def train_caption(args, margs, device, log):
    """--phase caption: --gpt-from's caption MLP (not its null caption) and a binding head trained on captions alone,
    the head's loss plus --caption-keep x the MLP's relative change (caption_loss); the rest of the model as stored.
    Writes gpt.json and gpt.safetensors (--gpt-from's tensors and metadata, the MLP's replaced)."""
    src = os.path.join(args.gpt_from, "gpt.safetensors")
    stored = load_file(src)
    with safe_open(src, "pt") as f:
        meta = dict(f.metadata() or {})
    with torch.device(device):
        model = Transformer(ModelArgs(**margs))
    model.load_state_dict({k: v.float() for k, v in stored.items()}, strict=False)
    before = copy.deepcopy(model.cls_embedding).requires_grad_(False)
    encoder = demo_text.DemoTextEncoder(margs["caption_dim"], margs["cls_token_num"])
    head = torch.nn.Linear(margs["dim"], len(scenes.KINDS) * len(scenes.COLOURS), device=device)
    trained = list(model.cls_embedding.cap_proj.parameters()) + list(head.parameters())
    opt = torch.optim.Adam(trained, lr=CAPTION_LR)
    pool = [s for s in scenes.scenes(range(100 * CAPTION_BATCH), "train") if s.shapes]
    test = [s for s in scenes.scenes(range(1024), "test") if len(s.shapes) >= 2][:512]
    gen = torch.Generator().manual_seed(args.seed + 4)
    t0, done = time.perf_counter(), 0
    log(phase="caption", steps=args.caption_steps, keep=args.caption_keep, lr=CAPTION_LR, batch=CAPTION_BATCH)
    for step in range(args.caption_steps):
        batch = [pool[i] for i in torch.randint(len(pool), (CAPTION_BATCH,), generator=gen).tolist()]
        ce, accuracy, change = caption_loss(model, before, head, encoder, batch)
        opt.zero_grad(set_to_none=True)
        (ce + args.caption_keep * change).backward()
        opt.step()
        done = step + 1
        last = done == args.caption_steps or (args.time_limit and time.perf_counter() - t0 > args.time_limit)
        if done % args.log_every == 0 or last:
            with torch.no_grad():
                _, test_accuracy, test_change = caption_loss(model, before, head, encoder, test)
            log(phase="caption", step=done, binding_loss=round(ce.item(), 4),
                binding_accuracy=round(accuracy.item(), 4), test_binding_accuracy=round(test_accuracy.item(), 4),
                caption_change=round(test_change.item(), 5), seconds=round(time.perf_counter() - t0, 1))
        if last:
            break
    if done < args.caption_steps:
        log(phase="caption", stopped_early_at=done, of=args.caption_steps)
    for k, v in model.cls_embedding.cap_proj.state_dict().items():
        stored["cls_embedding.cap_proj." + k] = v.to(stored["cls_embedding.cap_proj." + k].dtype).contiguous().cpu()
    write_json(margs, os.path.join(args.out, "gpt.json"))
    path = os.path.join(args.out, "gpt.safetensors")
    meta.update(caption_steps=str(done), caption_keep=str(args.caption_keep))
    save_file(stored, path + ".tmp", metadata=meta)
    os.replace(path + ".tmp", path)
    return done


RECIPE = ("gpt_batch", "gpt_lr", "entry_weight", "colour_weight", "hide_until", "hide_dropped",
          "recolour_share", "kind_weight", "binding_weight")  # --resume keeps these
DEFAULT_WEIGHTS = dict(entry_weight=1.0, colour_weight=0.0, hide_until="onset", hide_dropped=False,
                       recolour_share=RECOLOUR_SHARE, kind_weight=0.0, binding_weight=0.0)  # the plain loss


def run_recipe(args, preset, state):
    """The run's batch, peak LR and loss weights: the flags (else the preset's) for a new run, the stored run's on
    --resume, state its gpt_state.pt (a flag given there that differs from it: a UserError)."""
    flags = {k: getattr(args, k) for k in RECIPE}
    new = {k: preset.get(k, DEFAULT_WEIGHTS.get(k)) if flags[k] is None else flags[k] for k in RECIPE}
    if state is None:
        return new
    stored = state.get("recipe") or new  # a state from before recipes were stored: the flags'
    stored = {**DEFAULT_WEIGHTS, **stored}  # one from before a flag: its default
    for k in RECIPE:
        if flags[k] is not None and flags[k] != stored[k]:
            raise UserError(f"--resume goes on with the run's --{k.replace('_', '-')} {stored[k]}; leave the flag "
                            f"out, or start a new run for {flags[k]}")
    return stored


def save_state(path, model, ema, heads, opt, rng, done, steps, table, recipe, before):
    """What --resume needs to go on as if never stopped: weights, average, the colour, kind and binding heads,
    optimiser, schedule, random states, the run's recipe, the steps of the --gpt-from model it started from (before)."""
    head, kind_head, binding_head = heads
    state = dict(model=model.state_dict(), ema=ema.state_dict(), opt=opt.state_dict(), step=done, steps=steps,
                 numpy_rng=rng.get_state(), torch_rng=torch.get_rng_state(), table=table, recipe=recipe,
                 colour_head=head.state_dict() if head else None, before=before,
                 kind_head=kind_head.state_dict() if kind_head else None,
                 binding_head=binding_head.state_dict() if binding_head else None,
                 cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def resume(state, model, ema, heads, opt, rng, device):
    """Load --out's gpt_state.pt (state) into the run -> (next step, planned steps, token pool, steps before it)."""
    model.load_state_dict(state["model"])
    ema.load_state_dict(state["ema"])
    head, kind_head, binding_head = heads
    if head:
        head.load_state_dict(state["colour_head"])
    if kind_head:
        kind_head.load_state_dict(state["kind_head"])
    if binding_head:
        binding_head.load_state_dict(state["binding_head"])
    opt.load_state_dict(state["opt"])
    rng.set_state(state["numpy_rng"])
    torch.set_rng_state(state["torch_rng"].cpu())
    if state["cuda_rng"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
    return state["step"], state["steps"], state["table"], state.get("before", 0)


@torch.no_grad()
def update_ema(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p.detach(), 1 - decay)


def val_batch(preset, vq, device):
    """A fixed held-out batch (val split), each control type in turn, nothing dropped."""
    B = min(preset["gpt_batch"], 32)
    types = [list(CONTROL_MIX)[i % len(CONTROL_MIX)] for i in range(B)]
    with torch.no_grad():
        tokens = vq.encode(images(range(B), preset["size"], device, "val")[2])
    return list(range(B)), types, np.zeros(B, dtype=bool), tokens


# ---- the user's mistakes, found before anything is written ----------------------------------------------------------

def missing_file(folder, names):
    """The first of names that folder lacks (None: it holds them all)."""
    return next((n for n in names if not os.path.isfile(os.path.join(folder, n))), None)


def check_gpt_from(folder, margs):
    """--gpt-from's folder holds a gpt.safetensors of this model: every stored key, at its shape (read from the
    header, against the model built on the meta device); the keys dropped at saving may be absent."""
    path = os.path.join(folder, "gpt.safetensors")
    if not os.path.isfile(path):
        raise UserError(f"--gpt-from {folder} has no gpt.safetensors; give the folder of a trained GPT")
    with torch.device("meta"):
        want = {k: tuple(v.shape) for k, v in Transformer(ModelArgs(**margs)).state_dict().items()}
    with safe_open(path, "pt") as f:
        got = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    wrong = [k for k in sorted(want.keys() | got.keys())
             if got.get(k) != want.get(k) and not (k in UNUSED_AT_INFERENCE and k not in got)]
    if wrong:
        k = wrong[0]
        raise UserError(f"--gpt-from {path} is not this preset's model ({k}: {got.get(k, 'absent')} stored, "
                        f"{want.get(k, 'absent')} here); give the --preset it was trained with")


def check_caption(args):
    """--phase caption's flags and --gpt-from's folder -> the model's config (its gpt.json)."""
    if args.resume:
        raise UserError("--resume goes on with a GPT run; --phase caption is one short run: leave out --resume")
    if not args.gpt_from:
        raise UserError("--phase caption trains a trained GPT's caption MLP; give --gpt-from its folder")
    if lost := missing_file(args.gpt_from, ("gpt.json", "gpt.safetensors")):
        raise UserError(f"--gpt-from {args.gpt_from} has no {lost}; give the folder of a trained GPT")
    if args.vq_from and (lost := missing_file(args.vq_from, VQ_FILES)):
        raise UserError(f"--vq-from {args.vq_from} has no {lost}; give the folder of a trained VQ "
                        f"({' + '.join(VQ_FILES)})")
    if args.caption_steps < 1 or args.caption_keep < 0:
        raise UserError("--caption-steps is a count >= 1 and --caption-keep a weight >= 0")
    with open(os.path.join(args.gpt_from, "gpt.json")) as f:
        margs = json.load(f)
    with safe_open(os.path.join(args.gpt_from, "gpt.safetensors"), "pt") as f:
        if "cls_embedding.cap_proj.fc1.weight" not in f.keys():
            raise UserError(f"--gpt-from {args.gpt_from} is no text-conditioned GPT (no caption MLP)")
    return margs


def check_run(args, preset, device):
    """Every mistake of the flags and of the folders they name, as a UserError naming the fix, found before --out
    is made or written -> the GPT phase's (recipe, --resume's stored state or None); (None, None) for --phase vq;
    (the model's config, None) for --phase caption."""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a file; give a folder")
    if args.phase == "caption":
        return check_caption(args), None
    if args.resume and args.phase != "gpt":  # --phase all would train a new VQ under the run's stored tokens
        raise UserError("--resume goes on with --out's GPT run; add --phase gpt")
    if args.resume and args.gpt_from:
        raise UserError("--resume goes on with --out's own run; leave out --gpt-from")
    state_path = os.path.join(args.out, "gpt_state.pt")
    if args.resume and not os.path.isfile(state_path):
        raise UserError(f"--resume: {state_path} does not exist; start the run without --resume")
    if args.vq_from and (lost := missing_file(args.vq_from, VQ_FILES)):
        raise UserError(f"--vq-from {args.vq_from} has no {lost}; give the folder of a trained VQ "
                        f"({' + '.join(VQ_FILES)})")
    if args.phase == "gpt" and not args.vq_from and (lost := missing_file(args.out, VQ_FILES)):
        raise UserError(f"--phase gpt needs a trained VQ and --out {args.out} has no {lost}; give --vq-from a "
                        "trained VQ's folder, or use --phase all")
    if args.phase == "vq":
        return None, None
    if args.gpt_from:  # against the VQ the GPT phase will have: the one it reads, or the preset's it trains first
        vq_cfg = preset["vq"]
        if args.phase == "gpt":
            with open(os.path.join(args.vq_from or args.out, "vq.json")) as f:
                vq_cfg = json.load(f)
        check_gpt_from(args.gpt_from, gpt_args(preset, vq_cfg))
    state = torch.load(state_path, map_location=device, weights_only=False) if args.resume else None  # our own file
    recipe = run_recipe(args, preset, state)
    if recipe["hide_until"] != "onset" and not recipe["colour_weight"]:
        raise UserError("--hide-until moves --colour-weight's hidden context; give --colour-weight too")
    if args.recolour_share is not None and not 0 <= args.recolour_share <= 1:
        raise UserError(f"--recolour-share {args.recolour_share} is a share of rows; give a number from 0 to 1")
    if args.recolour_share is not None and recipe["hide_until"] != "e1":
        raise UserError("--recolour-share sets --hide-until e1's recoloured rows; give --hide-until e1 too")
    if recipe["hide_dropped"] and not recipe["colour_weight"]:  # the hiding comes with the colour head
        raise UserError("--hide-dropped widens --colour-weight's hidden rows; give --colour-weight too")
    for name in ("kind_weight", "binding_weight"):
        if recipe[name] < 0:
            raise UserError(f"--{name.replace('_', '-')} {recipe[name]} is a loss weight; give a number >= 0")
    return recipe, state


def main(argv=None):
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    try:
        device = checked_device(args.device)
        recipe, state = check_run(args, preset, device)
    except UserError as e:  # one line, as the project's other tools, and nothing written
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    vq_from = args.vq_from
    if args.phase == "caption" and not vq_from and not missing_file(args.gpt_from, VQ_FILES):
        vq_from = args.gpt_from  # a model's folder: its VQ comes along
    if vq_from and os.path.realpath(vq_from) != os.path.realpath(args.out):  # (the same: nothing to copy)
        for name in VQ_FILES:
            shutil.copyfile(os.path.join(vq_from, name), os.path.join(args.out, name))
    seed_everything(args.seed, device)
    if device.type == "cuda":  # TF32 for the float32 VQ where it is not trained (tokenising, validation)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    log = Log(args.out)
    log(event="start", preset=args.preset, phase=args.phase, device=str(device), seed=args.seed,
        torch=torch.__version__, threads=torch.get_num_threads())
    if args.phase == "caption":
        train_caption(args, recipe, device, log)
    if args.phase in ("vq", "all"):
        train_vq(args, preset, device, log)
    if args.phase in ("gpt", "all"):
        torch.manual_seed(args.seed + 3)
        train_gpt(args, preset, device, log, recipe, state)
    log(event="done")


if __name__ == "__main__":
    main()
