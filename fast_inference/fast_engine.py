"""ControlAR sampling from the command line: a control image and a prompt in, a PNG out, fast.

    python fast_inference/fast_engine.py                      # embedded demo: random tiny model
    python fast_inference/fast_engine.py --gpt-ckpt checkpoints/edge_base.safetensors \
        --vq-ckpt checkpoints/vq_ds16_t2i.pt --t5-path checkpoints/t5-ckpt/flan-t5-xl \
        --condition-type hed --condition-path condition/example/hed.png --prompt "a house"

Flags keep the names and defaults of the official sample_t2i.py / sample_t2i_MR.py /
sample_c2i.py. The engine class (`Engine`) and the reference `generate` are importable from here.
"""
import argparse
import logging
import os
import sys
import time

if __package__ in (None, ""):  # run as a script: make `fast_inference` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from fast_inference.checkpoint import CheckpointError, gpt_fix_hint, load_weights, read_state_dict
from fast_inference.engine import BACKENDS, Engine  # noqa: F401  (the seed-compatible entry point)
from fast_inference.generate import generate
from fast_inference.model import GPT_CONFIGS, ModelArgs, Transformer

log = logging.getLogger("fast_inference")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The embedded default: small enough to sample a 256x256 image in seconds on a CPU.
DEMO_CONFIG = dict(n_layer=6, n_head=4, dim=256, caption_dim=2048, cls_token_num=120, adapter_size="small")
DEMO_IMAGE_SIZE = 256


class UserError(Exception):
    """A mistake the user can fix; printed as one line without a traceback."""


def add_model_args(p):
    """Model and sampling flags shared with fast_eval.py (official names and defaults)."""
    p.add_argument("--gpt-model", default=None, help=f"{', '.join(GPT_CONFIGS)} or a .json of model arguments "
                   "(default: GPT-XL with --gpt-ckpt, the embedded demo config without)")
    p.add_argument("--gpt-ckpt", default=None, help="ControlAR checkpoint (.safetensors or .pt); none = random weights")
    p.add_argument("--gpt-type", choices=["t2i", "c2i"], default="t2i")
    p.add_argument("--vq-model", default="VQ-16")
    p.add_argument("--vq-ckpt", default=None, help="vq_ds16_t2i.pt; none = random weights")
    p.add_argument("--codebook-size", type=int, default=16384)
    p.add_argument("--codebook-embed-dim", type=int, default=8)
    p.add_argument("--image-size", type=int, default=None,
                   help="training resolution: sets block_size = (size/16)^2 (default 512; c2i 256)")
    p.add_argument("--image-H", type=int, default=None, help="output height (default: the control image's)")
    p.add_argument("--image-W", type=int, default=None, help="output width (default: the control image's)")
    p.add_argument("--downsample-size", type=int, choices=[8, 16], default=16)
    p.add_argument("--cls-token-num", type=int, default=None, help="text/class prefix length (t2i 120, c2i 1)")
    p.add_argument("--adapter-size", choices=["small", "base"], default="small")
    p.add_argument("--condition-type", default="hed", help="canny | hed | lineart | depth | seg")
    p.add_argument("--condition-ckpt", default=None, help="annotator weights (hed/lineart .pth, DPT folder for depth)")
    p.add_argument("--condition-is-map", action="store_true", help="use the control image as a ready control map")
    p.add_argument("--pos-interp", choices=["v444", "v445"], default="v444",
                   help="DINOv2 position-table interpolation of transformers <=4.44 (default) or >=4.45")
    p.add_argument("--t5-path", default=None, help="local flan-t5-xl folder (for --prompt)")
    p.add_argument("--cfg-scale", type=float, default=4.0)
    p.add_argument("--cfg-interval", type=int, default=-1)
    p.add_argument("--top-k", type=int, default=2000)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--control-strength", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["auto", "fp32", "none", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU ('none' = fp32)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--engine", choices=["fast", "reference"], default="fast")
    p.add_argument("--backend", choices=list(BACKENDS), default=None,
                   help="fast engine backend (default: inductor on CUDA, eager on CPU)")
    p.add_argument("--compile-mode", choices=["reduce-overhead", "max-autotune"], default="reduce-overhead")
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="ControlAR sampling (fast engine)")
    add_model_args(p)
    p.add_argument("--condition-path", default=None, help="control image (default: the demo draws one)")
    p.add_argument("--prompt", default=None, help="text prompt (needs --t5-path)")
    p.add_argument("--prompt-file", default=None, help="one prompt per line, encoded in one pass")
    p.add_argument("--caption-emb", default=None, help="precomputed caption .npz (caption_emb, prompt)")
    p.add_argument("--class-label", type=int, default=None, help="c2i class (0..999)")
    p.add_argument("--num-images", type=int, default=1, help="samples per prompt, from the same control")
    p.add_argument("--warmup", type=int, default=0, help="untimed generations first (compile, capture)")
    p.add_argument("--out", default=None, help="PNG grid: control map, then the samples (default under sample/)")
    p.add_argument("--save-samples", default=None, help="directory: each sample as {i}.png")
    p.add_argument("--save-tokens", default=None, help=".npy of the token ids [num_images, H/16*W/16]")
    return p.parse_args(argv)


# ---- set-up ------------------------------------------------------------------------------------

def pick_device(args):
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible; use --device cpu")
    precision = args.precision
    if precision == "auto":
        if device.type == "cuda":
            precision = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            precision = "fp32"
    dtype = {"fp32": torch.float32, "none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    backend = args.backend or ("inductor" if device.type == "cuda" else "eager")
    return device, dtype, backend


def is_demo(args):
    return args.gpt_ckpt is None and args.gpt_model is None


def model_args(args):
    demo = is_demo(args)
    c2i = args.gpt_type == "c2i"
    image_size = args.image_size or (DEMO_IMAGE_SIZE if demo else 256 if c2i else 512)
    grid = image_size // args.downsample_size
    overrides = dict(block_size=grid * grid, model_type=args.gpt_type, condition_type=args.condition_type,
                     adapter_size=args.adapter_size, pos_interp=args.pos_interp, vocab_size=args.codebook_size,
                     cls_token_num=args.cls_token_num or (1 if c2i else 120))
    if demo:
        return ModelArgs(**{**DEMO_CONFIG, **overrides}), image_size
    return ModelArgs.from_name(args.gpt_model or "GPT-XL", **overrides), image_size


def build_gpt(args, device, dtype):
    margs, image_size = model_args(args)
    with torch.device(device):
        model = Transformer(margs)
    if args.gpt_ckpt:
        sd = read_state_dict(args.gpt_ckpt)
        load_weights(model, sd, source=args.gpt_ckpt, hint=gpt_fix_hint(margs, sd))
        del sd
    return model.to(dtype).eval().requires_grad_(False), image_size


def build_vq(args, device):
    from fast_inference.vq import VQ_models

    if args.vq_model not in VQ_models:
        raise UserError(f"unknown --vq-model {args.vq_model}; use one of {sorted(VQ_models)}")
    with torch.device(device):
        vq = VQ_models[args.vq_model](codebook_size=args.codebook_size, codebook_embed_dim=args.codebook_embed_dim)
    if args.vq_ckpt:
        load_weights(vq, read_state_dict(args.vq_ckpt, key_order=("model",)), source=args.vq_ckpt,
                     hint="is this the VQ-16 tokenizer (vq_ds16_t2i.pt)?")
    return vq.eval().requires_grad_(False)  # the VQ always runs in float32, as officially


# ---- inputs ------------------------------------------------------------------------------------

def control_image(args, image_size):
    """The control map (3,H,W) in [-1,1] from --condition-path (or a drawn example)."""
    from fast_inference import conditions

    if args.condition_type not in conditions.CONDITION_TYPES:
        raise UserError(f"unknown --condition-type {args.condition_type}; use one of {conditions.CONDITION_TYPES}")
    if args.condition_path is None:
        if not is_demo(args):
            raise UserError("--condition-path is required with a checkpoint (a control image)")
        H, W = args.image_H or image_size, args.image_W or image_size
        rgb = conditions.draw_example(args.condition_type, H, W)
        return conditions.extract_control(rgb, args.condition_type, is_map=True)
    rgb = conditions.read_rgb(args.condition_path)
    H, W = rgb.shape[:2]
    target = (args.image_H or -(-H // 16) * 16, args.image_W or -(-W // 16) * 16)
    if target != (H, W):
        # As sample_t2i_MR.py: PIL bicubic resize, to the asked size or up to multiples of 16.
        log.info("control image %dx%d resized to %dx%d (PIL bicubic)", H, W, target[0], target[1])
        rgb = conditions.resize_to(rgb, *target)
    return conditions.extract_control(rgb, args.condition_type, ckpt=args.condition_ckpt,
                                      is_map=args.condition_is_map or is_demo(args))


def text_inputs(args, model, device):
    """Caption embeddings (P,T,C) and masks (P,T), left padded, for P prompts; or c2i labels."""
    from fast_inference import text

    if args.gpt_type == "c2i":
        label = 0 if args.class_label is None else args.class_label
        if not 0 <= label < model.args.num_classes:
            raise UserError(f"--class-label must be in 0..{model.args.num_classes - 1}")
        return torch.tensor([label], device=device), None, [f"class {label}"]
    T = model.args.cls_token_num
    if args.caption_emb:
        emb, mask, prompt = text.load_caption_emb(args.caption_emb, T)
        return emb.to(device), mask.to(device), [prompt]
    prompts = None
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise UserError(f"--prompt-file {args.prompt_file} not found")
        prompts = [line.strip() for line in open(args.prompt_file, encoding="utf-8") if line.strip()]
    elif args.prompt is not None or args.t5_path:
        prompts = [args.prompt or "a high-quality image"]
    if prompts is not None:
        if not args.t5_path:
            raise UserError("--prompt needs the text encoder: pass --t5-path checkpoints/t5-ckpt/flan-t5-xl "
                            "(or use --caption-emb FILE.npz)")
        encoder = text.T5Encoder(args.t5_path, device=device,
                                 dtype=model.tok_embeddings.weight.dtype if device.type == "cuda" else torch.float32)
        emb, mask = encoder.encode_left_padded(prompts)
        del encoder
        return emb[:, :T], mask[:, :T], prompts
    if not is_demo(args):
        raise UserError("give a prompt: --prompt TEXT with --t5-path, or --caption-emb FILE.npz")
    # Demo: a fixed random 'caption' of 12 valid tokens (random weights make text meaningless anyway).
    g = torch.Generator().manual_seed(args.seed)
    emb = torch.randn(1, T, model.args.caption_dim, generator=g) * 0.2
    mask = torch.zeros(1, T, dtype=torch.long)
    mask[:, T - 12:] = 1
    return (emb * mask[..., None]).to(device), mask.to(device), ["(random caption)"]


# ---- run ---------------------------------------------------------------------------------------

def sample_images(args, model, engine, cond, mask, control, num_tokens):
    """Tokens (P*num_images, N): every prompt repeated num_images times, with the same control."""
    n = args.num_images
    cond = cond.repeat_interleave(n, 0)
    mask = mask.repeat_interleave(n, 0) if mask is not None else None
    condition = control[None].to(cond.device).expand(cond.shape[0], -1, -1, -1)
    kw = dict(emb_masks=mask, cfg_scale=args.cfg_scale, cfg_interval=args.cfg_interval, condition=condition,
              control_strength=args.control_strength, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p)
    if engine is None:
        return generate(model, cond, num_tokens, **kw)
    return engine.generate(cond, num_tokens, **kw)


def save_outputs(args, images, control, tokens, demo):
    from fast_inference.images import save_image

    out = args.out or os.path.join(ROOT, "sample", "example", f"sample_{args.gpt_type}_{args.condition_type}"
                                   + ("_demo" if demo else "") + ".png")
    grid = torch.cat([control[None].to(images.device, images.dtype), images])
    save_image(grid, out, nrow=4, padding=2)
    if args.save_samples:
        for i, img in enumerate(images):
            save_image(img, os.path.join(args.save_samples, f"{i}.png"))
    if args.save_tokens:
        tmp = args.save_tokens + ".tmp.npy"
        np.save(tmp, tokens.cpu().numpy().astype(np.int64))
        os.replace(tmp, args.save_tokens)
    return out


def run(args):
    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    device, dtype, backend = pick_device(args)
    demo = is_demo(args)
    model, image_size = build_gpt(args, device, dtype)
    vq = build_vq(args, device)
    control = control_image(args, image_size)
    H, W = control.shape[1:]
    if H % 16 or W % 16:
        raise UserError(f"image size {H}x{W} is not a multiple of 16; use --image-H/--image-W multiples of 16")
    num_tokens = (H // 16) * (W // 16)
    if num_tokens > model.args.block_size:
        raise UserError(f"{H}x{W} needs {num_tokens} tokens but the model's grid has {model.args.block_size} "
                        f"(--image-size {image_size}); use a larger --image-size or a smaller image")
    t0 = time.perf_counter()
    cond, mask, prompts = text_inputs(args, model, device)
    t_text = time.perf_counter() - t0
    engine = None if args.engine == "reference" else Engine(model, backend=backend, compile_mode=args.compile_mode)
    print(f"{'demo: RANDOM weights, tiny config' if demo else 'model ' + (args.gpt_model or 'GPT-XL')} | "
          f"{args.engine} engine{'' if engine is None else ' (' + backend + ')'} | "
          f"{str(dtype).replace('torch.', '')} on {device} | {len(prompts)} prompt(s) x {args.num_images} image(s) "
          f"| {H}x{W} = {num_tokens} tokens")
    if demo:
        print("  the weights are random, so the image is noise: load real ones with --gpt-ckpt, --vq-ckpt "
              "and --t5-path (see checkpoints/README.md)")
    for _ in range(args.warmup):
        sample_images(args, model, engine, cond, mask, control, num_tokens)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tokens = sample_images(args, model, engine, cond, mask, control, num_tokens)
    sync(device)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    with torch.no_grad():
        images = vq.decode_code(tokens, (tokens.shape[0], vq.quantize.embedding.weight.shape[1], H // 16, W // 16))
    sync(device)
    t_vq = time.perf_counter() - t0
    out = save_outputs(args, images, control, tokens, demo)
    report(engine, t_text, t_gen, t_vq, tokens, time.perf_counter() - t_start)
    print(f"saved {out}")


def report(engine, t_text, t_gen, t_vq, tokens, t_total):
    n = tokens.numel()
    parts = [f"text {t_text:.2f}s"]
    if engine is not None and engine.last_timings:
        tm = engine.last_timings
        decode = tm["decode"]
        parts += [f"condition encoder {tm['condition']:.3f}s", f"prefill {tm['prefill']:.3f}s",
                  f"decode {decode:.2f}s ({n / max(decode, 1e-9):.0f} tok/s)"]
        if engine.compile_seconds:
            parts.append(f"compile/capture {engine.compile_seconds:.1f}s")
    else:
        parts.append(f"generate {t_gen:.2f}s ({n / max(t_gen, 1e-9):.0f} tok/s)")
    parts += [f"VQ decode {t_vq:.2f}s", f"total {t_total:.1f}s"]
    print("  " + " | ".join(parts))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None):
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        with torch.no_grad():
            run(args)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 (user errors become one line; --debug shows the rest)
        if args.debug or not is_user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def is_user_error(e):
    from fast_inference.conditions import ConditionError
    from fast_inference.text import TextError

    if isinstance(e, torch.cuda.OutOfMemoryError):
        e.args = ("CUDA out of memory; use a smaller --num-images (or fewer prompts)",)
        return True
    return isinstance(e, (UserError, CheckpointError, FileNotFoundError, ConditionError, TextError, ValueError))


if __name__ == "__main__":
    main()
