"""ControlAR sampling from the command line: a control image and a prompt in, a PNG out, fast.

    python fast_inference/fast_engine.py                      # embedded demo: the trained demo model
    python fast_inference/fast_engine.py --prompt "a red circle and a blue square on a white background"
    python fast_inference/fast_engine.py --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base \
        --vq-ckpt checkpoints/vq_ds16_t2i.pt --t5-path checkpoints/t5-ckpt/flan-t5-xl \
        --condition-type hed --condition-path condition/example/hed.png --condition-is-map --prompt "a house"

Flags keep the names and defaults of the official sample_t2i.py / sample_t2i_MR.py /
sample_c2i.py. The engine class (`Engine`) and the reference `generate` are importable from here.
"""
import argparse
import functools
import logging
import math
import os
import re
import sys
import time

PROCESS_START = time.perf_counter()  # before the heavy imports, so the report can say what they cost

if __package__ in (None, ""):  # run as a script: make `fast_inference` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from fast_inference import memory
from fast_inference import plan as plans
from fast_inference.checkpoint import (CheckpointError, fit_null_caption, gpt_fix_hint, load_weights, no_init,
                                       read_state_dict)
from fast_inference.engine import BACKENDS, COMPILE_SCOPES, SPECULATIVE, Engine, sync, vq_kernels
from fast_inference.generate import generate
from fast_inference.model import GPT_CONFIGS, ModelArgs, Transformer
from fast_inference.quantize import MODES as QUANTIZE_MODES, quantize_int8
from fast_inference.draft_tree import DEFAULT_TREE, parse_tree
from fast_inference.speculative import COUPLINGS, DEFAULT_COUPLING, DEFAULT_INIT, DRAFT_INITS

log = logging.getLogger("fast_inference")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONDITION_TYPES = ("canny", "hed", "lineart", "depth", "seg")  # = conditions.CONDITION_TYPES (lazy import)

# The embedded default: the demo model trained on procedural shapes (scripts/train_demo.py), its VQ and a scene of the
# demo set's test split (fast_inference/scenes.py) to draw the control map of.
DEMO_DIR = os.path.join(ROOT, "checkpoints", "demo")
DEMO_FILES = dict(gpt_model="gpt.json", gpt_ckpt="gpt.safetensors", vq_model="vq.json", vq_ckpt="vq.safetensors")
DEMO_SCENE = 3
EXAMPLES_DIR = os.path.join(ROOT, "condition", "example")
DEFAULT_T5 = os.path.join(ROOT, "checkpoints", "t5-ckpt")  # the official --t5-path default


class UserError(Exception):
    """A mistake the user can fix; printed as one line without a traceback."""


# Accepted ranges of the numeric flags (inclusive; None: unbounded), checked before any work and quoted by --help;
# the note says what the edge values mean. Guidance and control strength are bounded where float32 logits and
# fp16 activations could overflow into NaN (tokens of all zeros), far above any useful value (the models use 4 and 1).
RANGES = dict(
    cfg_scale=(0, 1000, "guidance runs only above 1, as officially (1 = none)"),
    cfg_interval=(-1, None, "-1 = guidance at every token"),
    top_k=(0, None, "0 = no top-k filter"),
    top_p=(0, 1, "1 = no top-p filter, 0 = the most likely token only"),
    temperature=(0, None, "0 = greedy (the official code divides the logits by max(temperature, 1e-5))"),
    control_strength=(0, 100, "0 = no control; it acts only with guidance on, as officially"),
    seed=(0, 2**32 - 1, None),  # fast_eval.py seeds a batch with seed * 2**32 + its first position
    image_size=(16, None, "a multiple of 16"), image_H=(16, None, "a multiple of 16"),
    image_W=(16, None, "a multiple of 16"),
    codebook_size=(1, None, None), codebook_embed_dim=(1, None, None), cls_token_num=(1, None, None),
    num_classes=(1, None, None), condition_token_nums=(0, None, None), num_images=(1, None, None),
    warmup=(0, None, None), t5_feature_max_len=(1, None, None), t5_feature_dim=(1, None, None),
    draft_window=(2, 256, "the last accepted token and window - 1 drafts"),
)


def span(name, ranges=RANGES):
    low, high, _ = ranges[name]
    return f"{low}..{high}" if high is not None else f">= {low}"


def ranged(name, what, ranges=RANGES):
    """A numeric flag's --help: what it is, its accepted range, its default and what the edge values mean."""
    note = ranges[name][2]
    return f"{what}, {span(name, ranges)} (default %(default)s)" + (f"; {note}" if note else "")


def check_ranges(args, ranges=RANGES):
    """Every numeric flag args has: a finite number within its range, else one line saying which values work."""
    for name, (low, high, note) in ranges.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        finite = isinstance(value, int) or math.isfinite(value)
        if not finite or value < low or (high is not None and value > high):
            kind = "a whole number" if isinstance(value, int) else "a number"
            raise UserError(f"--{name.replace('_', '-')} {value} is out of range; use {kind} {span(name, ranges)}"
                            + (f" ({note})" if note else ""))


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def add_model_args(p):
    """Model and sampling flags shared with fast_eval.py (official names and defaults).

    Model flags left unset (None) take the --gpt-model JSON's value, else the official default."""
    p.add_argument("--gpt-model", default=None, help=f"{', '.join(GPT_CONFIGS)} or a .json of model arguments "
                   "(default: GPT-XL with --gpt-ckpt, the demo model without)")
    p.add_argument("--gpt-ckpt", default=None, help="ControlAR checkpoint (.safetensors or .pt); none: random weights "
                   "with --gpt-model, the demo model (checkpoints/demo) without")
    p.add_argument("--gpt-type", choices=["t2i", "c2i"], default=None, help="default t2i")
    p.add_argument("--vq-model", default="VQ-16", help="VQ-16 or a .json of VQ arguments (vq.py's VQConfig)")
    p.add_argument("--vq-ckpt", default=None, help="vq_ds16_t2i.pt; none = random weights")
    p.add_argument("--codebook-size", type=int, default=None, help="default 16384 (>= 1)")
    p.add_argument("--codebook-embed-dim", type=int, default=None, help="default 8 (or the --vq-model JSON's; >= 1)")
    p.add_argument("--image-size", type=int, default=None,
                   help="training resolution, a positive multiple of 16: sets block_size = (size/16)^2 (default 512; "
                        "c2i 256); sizes whose model, caches and VQ decoding cannot fit the free memory are refused")
    p.add_argument("--image-H", type=int, default=None,
                   help="output height, a multiple of 16 (default: the control image's)")
    p.add_argument("--image-W", type=int, default=None, help="output width, a multiple of 16 (default: the control image's)")
    p.add_argument("--downsample-size", type=int, choices=[16], default=16, help="the VQ-16 tokenizer's (only 16)")
    p.add_argument("--cls-token-num", type=int, default=None, help="text/class prefix length (t2i 120, c2i 1; >= 1)")
    p.add_argument("--num-classes", type=int, default=None, help="c2i classes (default 1000; >= 1)")
    p.add_argument("--condition-token-nums", type=int, default=None, help="c2i condition tokens in the prefix (0; >= 0)")
    p.add_argument("--adapter-size", choices=["small", "base", "tiny"], default=None,
                   help="DINOv2 size (default small; tiny: the demo model's)")
    p.add_argument("--condition-type", default="hed", help=" | ".join(CONDITION_TYPES))
    p.add_argument("--condition-ckpt", default=None, help="annotator weights (hed/lineart .pth, DPT folder for depth)")
    p.add_argument("--condition-is-map", action="store_true", help="use the control image as a ready control map")
    p.add_argument("--pos-interp", choices=["v444", "v445"], default="v444",
                   help="DINOv2 position-table interpolation of transformers <=4.44 (default) or >=4.45")
    p.add_argument("--t5-path", default=None, help="local flan-t5-xl folder (for --prompt)")
    p.add_argument("--cfg-scale", type=float, default=4.0, help=ranged("cfg_scale", "classifier-free guidance scale"))
    p.add_argument("--cfg-interval", type=int, default=-1, help=ranged("cfg_interval", "guidance ends after this step"))
    p.add_argument("--top-k", type=int, default=2000, help=ranged("top_k", "keep the k most likely tokens"))
    p.add_argument("--top-p", type=float, default=1.0, help=ranged("top_p", "keep the likeliest tokens up to this mass"))
    p.add_argument("--temperature", type=float, default=1.0, help=ranged("temperature", "sampling temperature"))
    p.add_argument("--control-strength", type=float, default=1.0, help=ranged("control_strength", "control scale"))
    p.add_argument("--seed", type=int, default=0, help=ranged("seed", "torch.manual_seed before sampling"))
    p.add_argument("--precision", choices=["auto", "fp32", "none", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on GPUs that support it, fp16 on other GPUs, fp32 on CPU ('none' = fp32)")
    p.add_argument("--quantize", choices=list(QUANTIZE_MODES), default="none",
                   help="int8: the blocks' projections and the output head as weight-only int8, one scale per row "
                        "(as gpt-fast's int8 mode): half the bytes each step reads; on an H200 12%% faster for one "
                        "image, slower above 8 images; the images change slightly")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda if available)")
    p.add_argument("--engine", choices=["fast", "reference"], default="fast")
    p.add_argument("--backend", choices=list(BACKENDS), default=None,
                   help="fast engine backend (default: inductor on CUDA, eager on CPU)")
    p.add_argument("--compile-mode", choices=["reduce-overhead", "max-autotune"], default="reduce-overhead",
                   help="torch.compile mode of the step (--compile-scope step); with block scope, max-autotune tunes "
                        "the block's kernels and the CUDA graph is captured by hand either way")
    p.add_argument("--compile-prefill", action="store_true",
                   help="compile the prefill up to 8 images too (past 8 it runs the compiled block anyway): the compiled "
                        "block, a few seconds more at the first image; with --compile-scope step or int8 weights one "
                        "graph of the whole prefill (~50 s for GPT-XL). Worth it for long evaluations")
    p.add_argument("--compile-scope", choices=list(COMPILE_SCOPES), default="block",
                   help="inductor: compile one transformer block shared by all layers inside a step captured by "
                        "hand (block: ~7-21 s per shape for GPT-XL; at <= 16 rows, e.g. up to 8 images with CFG, "
                        "fused Triton kernels instead, nothing to compile), or the whole step with --compile-mode as "
                        "gpt-fast (step: ~50 s)")
    p.add_argument("--speculative", choices=list(SPECULATIVE), default="none",
                   help="jacobi: lossless speculative Jacobi decoding, each pass verifying --draft-window positions per "
                        "image at once (several tokens per pass, the same distribution as one per step); fast engine, "
                        "inductor (block scope) or eager backend, guidance at every token")
    p.add_argument("--draft-window", type=int, default=16, help=ranged("draft_window", "positions a pass verifies"))
    p.add_argument("--draft-init", choices=list(DRAFT_INITS), default=DEFAULT_INIT,
                   help="the drafts of positions a pass has not reached yet: random (uniform, as SJD), left (the "
                        "token before, repeated) or above (the token one grid row up; square images, a window no wider "
                        "than the grid)")
    p.add_argument("--draft-coupling", choices=list(COUPLINGS), default=DEFAULT_COUPLING,
                   help="gumbel: redraw each position's draft with noise fixed per (image, position, token), as MC-SJD, "
                        "so that drafts move only where their distribution does (still lossless); none: fresh noise; "
                        "pathwise: every token's noise fixed too, so the image is a function of the seed alone and a "
                        "draft is kept where it is its position's token (lossless; needed by --draft-tree)")
    p.add_argument("--draft-tree", type=tree_arg, default=DEFAULT_TREE, metavar="WxD|none",
                   help="each pass verifies W candidates of the window's first draft, each with D drafts below it, "
                        "beside the chain (draft_tree.py; --draft-coupling pathwise); none: the chain alone")
    p.add_argument("--plan", action="append", default=[], metavar="KEY=VALUE",
                   help="override the decode plan's choice (repeatable; also CONTROLAR_PLAN=KEY=VALUE,...): "
                        + "; ".join(f"{k}={'|'.join(v)}" for k, v in plans.OVERRIDES.items()))
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def parse_args(argv=None):
    p = Parser(description="ControlAR sampling (fast engine)")
    add_model_args(p)
    p.add_argument("--condition-path", default=None, help="control image (default: the demo draws one)")
    p.add_argument("--prompt", default=None, help="text prompt (T5 from --t5-path, default checkpoints/t5-ckpt; the "
                   "demo model's own word encoder for it)")
    p.add_argument("--prompt-file", default=None, help="one prompt per line, encoded in one pass")
    p.add_argument("--caption-emb", default=None, help="precomputed caption .npz (caption_emb, prompt)")
    p.add_argument("--t5-model-type", default="flan-t5-xl", help="the model's folder under --t5-path")
    p.add_argument("--t5-feature-max-len", type=int, default=120, help="T5 tokens per prompt (>= 1)")
    p.add_argument("--t5-feature-dim", type=int, default=None, help="must be the model's caption_dim (2048)")
    p.add_argument("--no-left-padding", action="store_true",
                   help="keep T5's right padding (the models were trained left padded)")
    p.add_argument("--class-label", type=int, default=None,
                   help="c2i class (default: the .npy beside --condition-path, as sample_c2i.py)")
    p.add_argument("--num-images", type=int, default=1,
                   help="samples per prompt, from the same control (>= 1; as many as fit the free memory)")
    p.add_argument("--warmup", type=int, default=0, help="untimed generations first (compile, capture; >= 0)")
    p.add_argument("--out", default=None,
                   help="PNG file: a grid of the control map, then the samples (default under sample/)")
    p.add_argument("--save-samples", default=None, help="directory: each sample as {i}.png")
    p.add_argument("--save-tokens", default=None, help=".npy of the token ids [num_images, H/16*W/16]")
    p.add_argument("--compile", action="store_true", help="the official flag: same as --backend inductor")
    p.add_argument("--explain", nargs="?", const="here", default=None, metavar="DEVICE",
                   help="print the decode plan of this run (which kernel runs each operation) and exit, loading no "
                        "weights; DEVICE plans for another one instead of this machine's: cpu, sm_80, sm_90, ...")
    return use_demo_model(p.parse_args(argv))


# ---- set-up ------------------------------------------------------------------------------------

def pick_device(args):
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise UserError(f"unknown --device {args.device!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible; use --device cpu")
    cuda = device.type == "cuda"
    dtype = precision_dtype(args.precision, cuda, cuda and torch.cuda.is_bf16_supported())
    backend = default_backend(args, device)
    if backend == "cudagraph" and device.type != "cuda":
        raise UserError("--backend cudagraph needs a CUDA device; use --backend eager on the CPU")
    return device, dtype, backend


def use_demo_model(args):
    """No --gpt-ckpt and no --gpt-model: the demo model's files (and its VQ's, unless a VQ is given)."""
    args.demo = args.gpt_ckpt is None and args.gpt_model is None
    if args.demo:
        args.gpt_model, args.gpt_ckpt = (os.path.join(DEMO_DIR, DEMO_FILES[k]) for k in ("gpt_model", "gpt_ckpt"))
        if args.vq_ckpt is None and args.vq_model == "VQ-16":
            args.vq_model, args.vq_ckpt = (os.path.join(DEMO_DIR, DEMO_FILES[k]) for k in ("vq_model", "vq_ckpt"))
    return args


def precision_dtype(precision, cuda, bf16):
    """--precision's dtype: auto is bf16 on GPUs that support it (bf16), fp16 on other GPUs, fp32 on the CPU."""
    if precision == "auto":
        precision = ("bf16" if bf16 else "fp16") if cuda else "fp32"
    return {"fp32": torch.float32, "none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def default_backend(args, device):
    return args.backend or ("inductor" if device.type == "cuda" or getattr(args, "compile", False) else "eager")


def is_demo(args):
    return getattr(args, "demo", False)


def text_encoder_name(args):
    """The text encoder the GPT checkpoint names in its metadata (the demo model's: demo_text.NAME), or None (T5)."""
    if args.gpt_ckpt and args.gpt_ckpt.lower().endswith(".safetensors") and os.path.isfile(args.gpt_ckpt):
        from fast_inference.checkpoint import read_metadata

        return read_metadata(args.gpt_ckpt).get("text_encoder")
    return None


def uses_demo_text(args):
    from fast_inference import demo_text

    return text_encoder_name(args) == demo_text.NAME


def read_json_config(path):
    if not os.path.isfile(path):
        raise UserError(f"--gpt-model {path} not found; pass a model name ({', '.join(GPT_CONFIGS)}) or a .json file")
    try:
        return ModelArgs.read_json(path)
    except ValueError as e:
        raise UserError(f"--gpt-model {e}") from None


def model_args(args):
    """(ModelArgs, training image size) from --gpt-model (name, JSON or the demo) and the flags.

    Precedence: explicit flags, then the JSON's fields, then the official defaults."""
    name = args.gpt_model or "GPT-XL"
    given = read_json_config(name) if name.endswith(".json") else {}
    c2i = (args.gpt_type or given.get("model_type", "t2i")) == "c2i"
    ds = args.downsample_size
    if args.image_size is not None and (args.image_size <= 0 or args.image_size % ds):
        raise UserError(f"--image-size {args.image_size} is not a positive multiple of {ds}")
    default_size = 256 if c2i else 512
    config = dict(model_type="c2i" if c2i else "t2i", cls_token_num=1 if c2i else 120, adapter_size="small",
                  block_size=(default_size // ds) ** 2, vocab_size=16384)
    config.update(given)
    flags = dict(model_type=args.gpt_type, cls_token_num=args.cls_token_num, adapter_size=args.adapter_size,
                 condition_type=args.condition_type, pos_interp=args.pos_interp, vocab_size=args.codebook_size,
                 num_classes=args.num_classes, condition_token_num=args.condition_token_nums,
                 block_size=(args.image_size // ds) ** 2 if args.image_size else None)
    config.update({k: v for k, v in flags.items() if v is not None})
    try:
        margs = ModelArgs(**config) if name.endswith(".json") else ModelArgs.from_name(name, **config)
    except (TypeError, ValueError) as e:
        msg = str(e) if str(e).startswith(name) else f"{name}: {e}"
        raise UserError(f"--gpt-model {msg}") from None
    return margs, int(round(margs.block_size ** 0.5)) * ds


def build_gpt(args, device, dtype):
    margs, image_size = model_args(args)
    if args.gpt_ckpt:
        sd = read_state_dict(args.gpt_ckpt)
        with no_init(), torch.device(device):
            model = Transformer(margs)
        fit_null_caption(model, sd)
        load_weights(model, sd, source=args.gpt_ckpt, hint=gpt_fix_hint(margs, sd))
        del sd
    else:
        with torch.device(device):
            model = Transformer(margs)
    model = model.to(dtype).eval().requires_grad_(False)
    if args.quantize == "int8":
        quantize_int8(model)
    return model, image_size


def vq_constructor(args):
    """() -> the VQ of --vq-model (an official name or a JSON of VQConfig fields), with the codebook flags."""
    from fast_inference.vq import VQ_models, VQConfig, VQModel

    if args.vq_model.endswith(".json"):
        try:
            cfg = VQConfig.from_json(args.vq_model, codebook_size=args.codebook_size,
                                     codebook_embed_dim=args.codebook_embed_dim)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"--vq-model {e}") from None
        return lambda: VQModel(cfg)
    if args.vq_model not in VQ_models:
        raise UserError(f"unknown --vq-model {args.vq_model!r}; use VQ-16 or a .json of VQ arguments")
    kw = dict(codebook_size=args.codebook_size or 16384, codebook_embed_dim=args.codebook_embed_dim or 8)
    return lambda: VQ_models[args.vq_model](**kw)


def build_vq(args, device):
    make = vq_constructor(args)
    if args.vq_ckpt:
        sd = read_state_dict(args.vq_ckpt, key_order=("model",))
        with no_init(), torch.device(device):
            vq = make()
        hint = "Is this the VQ-16 tokenizer (vq_ds16_t2i.pt)?" if args.vq_model == "VQ-16" else "Check --vq-model"
        load_weights(vq, sd, source=args.vq_ckpt, hint=hint)
    else:
        with torch.device(device):
            vq = make()
    return vq.eval().requires_grad_(False)  # the VQ always runs in float32, as officially


# ---- checks before any heavy work --------------------------------------------------------------

def check_args(args):
    """Everything that can be checked cheaply, so a mistake costs no model loading."""
    check_ranges(args)
    check_speculative(args)
    if is_demo(args):
        check_demo(args)
    if args.quantize == "int8" and args.compile_scope == "step":
        raise UserError("--quantize int8 runs with --compile-scope block (the default); drop --compile-scope step")
    if args.condition_type not in CONDITION_TYPES:
        raise UserError(f"unknown --condition-type {args.condition_type!r}; use one of {', '.join(CONDITION_TYPES)}")
    for flag in ("gpt_ckpt", "vq_ckpt", "condition_path", "caption_emb", "prompt_file"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise UserError(f"--{flag.replace('_', '-')} {path} not found")
    vq_constructor(args)  # an unknown --vq-model or a bad JSON: one line now
    if args.condition_ckpt is not None and not os.path.exists(args.condition_ckpt):
        raise UserError(f"--condition-ckpt {args.condition_ckpt} not found")
    for flag in ("image_H", "image_W"):
        side = getattr(args, flag)
        if side is not None and (side <= 0 or side % 16):
            fit = max(16, -(-side // 16) * 16)
            raise UserError(f"--{flag.replace('_', '-')} {side} is not a positive multiple of 16; use e.g. {fit}")
    if sum(x is not None for x in (args.caption_emb, args.prompt_file, args.prompt)) > 1:
        raise UserError("give one text source: --prompt, --prompt-file or --caption-emb")
    if (args.prompt is not None or args.prompt_file) and not t5_folder(args) and not uses_demo_text(args):
        raise UserError("--prompt/--prompt-file need the text encoder: pass --t5-path checkpoints/t5-ckpt/flan-t5-xl "
                        "(or use --caption-emb FILE.npz)")
    if not is_demo(args) and args.condition_path is None and not args.explain:  # --explain reads no inputs
        raise UserError("--condition-path is required outside the demo: the control image (or map)")
    if args.out and os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a directory; give a file name like {os.path.join(args.out, 'grid.png')}")
    if args.save_tokens and os.path.isdir(args.save_tokens):
        raise UserError(f"--save-tokens {args.save_tokens} is a directory; give a file name like tokens.npy")
    if args.save_samples and os.path.isfile(args.save_samples):
        raise UserError(f"--save-samples {args.save_samples} is a file; give a directory")
    check_format("--out", args.out, ".png", "a PNG")
    check_format("--save-tokens", args.save_tokens, ".npy", "a NumPy .npy")
    for path in (args.out, args.save_tokens, args.save_samples and os.path.join(args.save_samples, "0.png")):
        if path:
            check_writable(path)


def check_format(flag, path, ext, what):
    """An output file named with the extension of the one format it is written in (no image.jpg holding a PNG)."""
    if path and not path.lower().endswith(ext):
        stem = os.path.splitext(path)[0] if os.path.splitext(path)[1] else path
        raise UserError(f"{flag} {path}: it is written as {what} file only; name it {stem}{ext}")


def check_demo(args):
    if args.gpt_type == "c2i":
        raise UserError("the demo model is t2i; for c2i pass --gpt-model and --gpt-ckpt")
    missing = [p for p in (args.gpt_model, args.gpt_ckpt, args.vq_model, args.vq_ckpt)
               if p and p.startswith(DEMO_DIR) and not os.path.isfile(p)]
    if missing:
        raise UserError(f"the demo model's {missing[0]} is missing; restore it: git checkout -- checkpoints/demo")


def planned_shape(args, image_size, model_type):
    """(H, W) of the control map control_image will make, from the image's header alone (no pixel decoded)."""
    from fast_inference import conditions

    if args.condition_path is None:  # the demo draws its map
        return args.image_H or image_size, args.image_W or image_size
    return target_shape(args, *conditions.read_size(args.condition_path), model_type)


def target_shape(args, H, W, model_type):
    """sample_t2i_MR.py's size: both sides rounded up to multiples of 16 (32 for depth extraction), or the flags."""
    is_map = args.condition_is_map or model_type == "c2i"
    step = 32 if args.condition_type == "depth" and not is_map else 16
    return args.image_H or -(-H // step) * step, args.image_W or -(-W // step) * step


def check_speculative(args):
    """--speculative's companions, before any model loads (the plan refuses the rest when the engine is made)."""
    if args.speculative == "none":
        return
    if args.engine == "reference":
        raise UserError("--speculative jacobi runs on the fast engine; drop --engine reference")
    if args.cfg_interval > -1:
        raise UserError("--speculative jacobi guides every token; use --cfg-interval -1")
    if args.backend == "cudagraph" or (args.backend == "inductor" and args.compile_scope == "step"):
        raise UserError("--speculative jacobi runs on --backend inductor with --compile-scope block, or on --backend "
                        "eager")
    if args.draft_tree and args.draft_coupling != "pathwise":
        raise UserError(f"--draft-tree is exact with --draft-coupling pathwise only; add it, or --draft-tree none")


def tree_arg(text):
    """argparse's type of --draft-tree: draft_tree.parse_tree, its error as argparse's."""
    try:
        return parse_tree(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_draft_grid(args, H, W):
    """--draft-init above reads the token one grid row up: a square grid at least as wide as the window."""
    if args.speculative != "none" and args.draft_init == "above" and (H != W or W // 16 < args.draft_window):
        raise UserError(f"--draft-init above needs a square image at least {args.draft_window * 16} pixels wide "
                        f"(--draft-window x 16), not {H}x{W}; use --draft-init random or left")


def check_grid(margs, H, W, image_size):
    num_tokens = (H // 16) * (W // 16)
    if num_tokens > margs.block_size:
        raise UserError(f"{H}x{W} needs {num_tokens} tokens but the model's grid has {margs.block_size} "
                        f"(--image-size {image_size}); use a larger --image-size or a smaller image")


def vq_config(args):
    """The VQConfig of --vq-model and the codebook flags, from a VQ built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return vq_constructor(args)().cfg


def check_memory(margs, H, W, images, cfg_scale, device, dtype, fix, vq_cfg=None, int8=False, window=0,
                 coupling=DEFAULT_COUPLING, decoded=None):
    """Refuse before any large allocation a size the device, or the process's own limits, cannot hold (the
    allocator's traceback otherwise). memory.needed counts what the run holds at least: the model, the KV caches of
    images (x2 under CFG) and a speculative pass of `window` positions or the VQ decoding of `decoded` images (default
    all of them), one chunk at a time."""
    from fast_inference.vq import VQConfig

    shapes = memory.Shapes(H, W, images, cfg_scale > 1.0, dtype, int8=int8, window=window, coupling=coupling,
                           decoded=images if decoded is None else decoded)
    need = memory.needed(margs, vq_cfg or VQConfig(), shapes)
    have, where = memory.available(device)
    if have is not None and need > have:
        raise UserError(f"{images} image(s) of {H}x{W} on a grid of {margs.block_size} tokens need at least "
                        f"{need / 2**30:.1f} GiB but {where}; {fix}")


def run_memory(args, margs, H, W, images, device, dtype, fix):
    """check_memory for a run of the sampling flags: int8 weights, a speculative pass, the VQ of --vq-model."""
    window = args.draft_window if args.speculative != "none" else 0
    check_memory(margs, H, W, images, args.cfg_scale, device, dtype, fix, vq_cfg=vq_config(args),
                 int8=args.quantize == "int8", window=window, coupling=args.draft_coupling)


def check_writable(path):
    """The nearest existing folder above path must be writable (we create the rest at the end)."""
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(d):
        if os.path.exists(d):
            raise UserError(f"cannot write {path}: {d} is a file")
        d = os.path.dirname(d)
    if not os.access(d, os.W_OK):
        raise UserError(f"cannot write {path}: {d} is not writable; choose another output path")


# ---- inputs ------------------------------------------------------------------------------------

def control_image(args, image_size, model_type="t2i"):
    """The control map (3,H,W) in [-1,1] from --condition-path (or a drawn example in the demo).

    Like sample_t2i_MR.py, the image is resized (PIL bicubic) so both sides are multiples of 16
    (32 for depth extraction), or to --image-H/--image-W when given. c2i takes the image as a ready
    map, as sample_c2i.py does."""
    from fast_inference import conditions

    if args.condition_path is None:  # demo (check_args enforced it): a test scene of the demo set
        H, W = args.image_H or image_size, args.image_W or image_size
        return conditions.extract_control(demo_rgb(args.condition_type, H, W), args.condition_type, is_map=True)
    rgb = conditions.read_rgb(args.condition_path)
    H, W = rgb.shape[:2]
    is_map = args.condition_is_map or model_type == "c2i"
    target = target_shape(args, H, W, model_type)
    if target != (H, W):
        log.info("control image %dx%d resized to %dx%d (PIL bicubic)", H, W, target[0], target[1])
        rgb = conditions.resize_to(rgb, *target)
    return conditions.extract_control(rgb, args.condition_type, ckpt=args.condition_ckpt, is_map=is_map)


def demo_scene():
    from fast_inference import scenes

    return scenes.scene(DEMO_SCENE, "test")


def demo_map(condition_type, size):
    """uint8 (size, size, 3): the demo scene's control map of this type."""
    from fast_inference import scenes

    return scenes.control([demo_scene()], condition_type, size)[0].permute(1, 2, 0).numpy()


def demo_rgb(condition_type, H, W):
    """uint8 (H, W, 3): the demo scene's control map of this type, drawn at the larger side and resized to H x W."""
    from fast_inference import conditions

    rgb = demo_map(condition_type, max(H, W))
    return rgb if (H, W) == rgb.shape[:2] else conditions.resize_to(rgb, H, W)


def demo_text_inputs(args, model, device):
    """The demo model's captions: --prompt / --prompt-file through its word encoder, else the demo scene's caption."""
    from fast_inference.demo_text import DemoTextEncoder

    prompts = read_prompt_file(args.prompt_file) if args.prompt_file else [args.prompt] if args.prompt else None
    if prompts is None:
        if not is_demo(args):
            raise UserError("give a prompt: --prompt TEXT (the demo model's words), --prompt-file or --caption-emb")
        prompts = [demo_scene().caption]
    emb, mask = DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num).encode_left_padded(prompts)
    return emb.to(device), mask.to(device), prompts


def prompt_count(args):
    """The prompts the run will encode: --prompt-file's lines, else one."""
    return len(read_prompt_file(args.prompt_file)) if args.prompt_file else 1


def read_prompt_file(path):
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {path} has no prompts (one per line)")
    return prompts


def text_inputs(args, model, device):
    """(cond, masks, names) for P prompts: caption embeddings (P,T,C) left padded with their masks
    (P,T), or c2i class labels (P,) with masks None."""
    from fast_inference import text

    if model.args.model_type == "c2i":
        label = class_label(args, model.args.num_classes)
        return torch.tensor([label], device=device), None, [f"class {label}"]
    T = model.args.cls_token_num
    if args.caption_emb:
        emb, mask, prompt = text.load_caption_emb(args.caption_emb, T)
        if emb.shape[2] != model.args.caption_dim:
            raise UserError(f"{args.caption_emb}: caption_emb width {emb.shape[2]} != the model's caption_dim "
                            f"{model.args.caption_dim}; use embeddings of the model's text encoder")
        dtype = model.tok_embeddings.weight.dtype
        text.check_values(emb, f"{args.caption_emb}: 'caption_emb'", "run with --precision bf16 or fp32", dtype)
        return emb.to(device), mask.to(device), [prompt]
    if uses_demo_text(args):
        return demo_text_inputs(args, model, device)
    prompts, t5 = None, t5_folder(args)
    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    elif args.prompt is not None or t5:
        prompts = [args.prompt or "a high-quality image"]  # the official default prompt
    if prompts is not None:
        if args.t5_feature_dim not in (None, model.args.caption_dim):
            raise UserError(f"--t5-feature-dim {args.t5_feature_dim} but the model's caption_dim is "
                            f"{model.args.caption_dim}; drop the flag")
        # T5 in the run's precision, as the official T5Embedder(torch_dtype=precision).
        encoder = text.T5Encoder(t5, device=device, dtype=model.tok_embeddings.weight.dtype,
                                 max_length=args.t5_feature_max_len)
        emb, mask = encode_prompts(encoder, prompts, T, not args.no_left_padding)
        del encoder
        text.check_t5_output(emb, t5)
        return emb, mask, prompts
    raise UserError("give a prompt: --prompt TEXT with --t5-path, --prompt-file, or --caption-emb FILE.npz")


def encode_prompts(encoder, prompts, T, left_padding=True):
    """T5's embeddings (P, T, C) and masks (P, T) of prompts, left padded to the prefix T (or T5's right padding)."""
    if not left_padding:
        emb, mask = encoder.encode(prompts)
        return (emb * mask[..., None].to(emb.dtype))[:, :T], mask[:, :T]
    emb, mask = encoder.encode_left_padded(prompts)
    return left_fit(emb, T), left_fit(mask, T)


def t5_folder(args):
    """--t5-path, or outside the demo the official default checkpoints/t5-ckpt when it exists; the
    model folder itself or its parent (official layout: --t5-path + --t5-model-type)."""
    path = args.t5_path or (DEFAULT_T5 if not is_demo(args) and os.path.isdir(DEFAULT_T5) else None)
    sub = os.path.join(path, args.t5_model_type) if path else None
    if sub and not os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(sub):
        return sub
    return path


def class_label(args, num_classes):
    """--class-label, else the label saved beside the control map (sample_c2i.py: <map>.npy)."""
    label = args.class_label
    npy = os.path.splitext(args.condition_path)[0] + ".npy" if args.condition_path else None
    if label is None and npy and os.path.isfile(npy):
        try:
            label = int(np.load(npy).reshape(-1)[0])
        except (ValueError, OSError, IndexError) as e:
            raise UserError(f"{npy}: cannot read a class label ({e}); pass --class-label N") from None
    if label is None:
        if not is_demo(args):
            raise UserError(f"c2i needs a class: pass --class-label N (0..{num_classes - 1})")
        label = 0
    if not 0 <= label < num_classes:
        raise UserError(f"--class-label must be in 0..{num_classes - 1}, got {label}")
    return label


def left_fit(x, T):
    """Left-padded (P, 120, ...) -> (P, T, ...): keep the last T positions (where the real tokens
    are) or pad zeros on the left; the layout --caption-emb files get for a prefix of T."""
    L = x.shape[1]
    if L >= T:
        return x[:, L - T:]
    return torch.cat([x.new_zeros(x.shape[0], T - L, *x.shape[2:]), x], dim=1)


# ---- run ---------------------------------------------------------------------------------------

def make_engine(args, model, backend):
    """The fast engine the flags ask for, or None for --engine reference (the official loop, plain torch)."""
    if args.engine == "reference":
        return None
    try:
        return Engine(model, backend=backend, compile_mode=args.compile_mode, compile_prefill=args.compile_prefill,
                      compile_scope=args.compile_scope, overrides=args.plan, speculative=args.speculative,
                      draft_window=args.draft_window, draft_init=args.draft_init, draft_coupling=args.draft_coupling,
                      draft_tree=args.draft_tree)
    except plans.PlanError as e:
        raise UserError(str(e)) from None


def explain(args):
    """--explain: the decode plan of the run the flags describe, on this machine or on args.explain's device, from the
    model's configuration alone (no weights)."""
    margs, image_size = model_args(args)
    builds = lambda kernel, *key: True  # another device: its CUDA C++ kernels taken to build
    if args.explain == "here":
        device, dtype, backend = pick_device(args)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        builds = functools.partial(Engine.builds_on, device)
    else:
        target = args.explain.lower().replace("sm_", "sm")
        if not (target == "cpu" or re.fullmatch(r"sm\d\d+", target)):
            raise UserError(f"--explain {args.explain}: name a device as cpu or sm_XY (sm_80 Ampere, sm_90 Hopper)")
        capability = None if target == "cpu" else (int(target[2:-1]), int(target[-1]))
        device = torch.device("cpu" if target == "cpu" else "cuda")
        dtype = precision_dtype(args.precision, device.type == "cuda", capability is not None and capability >= (8, 0))
        backend = default_backend(args, device)
    H, W = args.image_H or image_size, args.image_W or image_size
    prompts = 1
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = max(1, sum(1 for line in f if line.strip()))
    s = plans.Situation(
        backend=backend, compile_scope=args.compile_scope, compile_prefill=args.compile_prefill, device=device.type,
        capability=capability, triton=plans.triton_available(), interpret=plans.interpreting(), dtype=dtype,
        int8=args.quantize == "int8", top_p=args.top_p, cfg=args.cfg_scale > 1.0, batch=prompts * args.num_images,
        dim=margs.dim, n_head=margs.n_head, ffn_hidden=margs.ffn_hidden, vocab_size=margs.vocab_size,
        max_seq=margs.prefix_len + (H // 16) * (W // 16), builds=builds,
        overrides=tuple(dict(plans.environment_overrides() + plans.parse_overrides(args.plan)).items()),
        draft_window=args.draft_window if args.speculative == "jacobi" else 0,
        draft_tree=args.draft_tree if args.speculative == "jacobi" else ())
    print(plans.explain(plans.make(s)))
    print(plans.explain_server(s))  # and a server's steps (serve.py), rows at their own positions


def sample_tokens(args, model, engine, cond, mask, condition, num_tokens):
    """Tokens (B, N) with the sampling flags, from the fast engine or (engine None) the reference."""
    kw = dict(emb_masks=mask, cfg_scale=args.cfg_scale, cfg_interval=args.cfg_interval, condition=condition,
              control_strength=args.control_strength, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p)
    if engine is None:
        return generate(model, cond, num_tokens, **kw)
    return engine.generate(cond, num_tokens, **kw)


def sample_images(args, model, engine, cond, mask, control, num_tokens):
    """Tokens (P*num_images, N): every prompt repeated num_images times, with the same control."""
    n = args.num_images
    cond = cond.repeat_interleave(n, 0)
    mask = mask.repeat_interleave(n, 0) if mask is not None else None
    condition = control[None].to(cond.device).expand(cond.shape[0], -1, -1, -1)
    return sample_tokens(args, model, engine, cond, mask, condition, num_tokens)


def default_out(args, model_type, demo):
    name = f"sample_{model_type}_{args.condition_type}" + ("_demo" if demo else "") + ".png"
    return os.path.join(ROOT, "sample", "example", name)


def save_outputs(args, out, images, control, tokens, caption=None):
    """The grid (control map, then the samples), then per-sample PNGs and the tokens; each atomic. With a caption
    (the demo) the grid is a figure: cells enlarged, the caption written below."""
    from fast_inference.images import save_figure, save_image

    grid = torch.cat([control[None].to(images.device, images.dtype), images])
    if caption is None:
        save_image(grid, out, nrow=4, padding=2)
    else:
        save_figure(grid, out, caption, nrow=4, padding=2)
    if args.save_samples:
        for i, img in enumerate(images):
            save_image(img, os.path.join(args.save_samples, f"{i}.png"))
    if args.save_tokens:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_tokens)), exist_ok=True)
        tmp = args.save_tokens + ".tmp.npy"
        np.save(tmp, tokens.cpu().numpy().astype(np.int64))
        os.replace(tmp, args.save_tokens)


def describe(args, model, demo):
    if demo:
        return f"demo model ({os.path.relpath(DEMO_DIR, ROOT)}, trained on procedural shapes)"
    name = os.path.basename(args.gpt_model) if args.gpt_model else "GPT-XL"
    a = model.args
    adapter = f"DINOv2-{a.adapter_size}" if a.model_type == "t2i" else "ViT-small"
    weights = "" if args.gpt_ckpt else ", RANDOM weights"
    return f"{name} {a.model_type} ({adapter}, {a.condition_type}, grid {int(a.block_size ** 0.5)}^2{weights})"


def weights_note(args, demo):
    """What the run draws with: the demo model's control and what to try next, or what random weights make of the
    output (None when every weight is loaded)."""
    if demo:
        where = args.condition_path or f"scene {DEMO_SCENE} of the demo set's test split"
        return (f"{args.condition_type} control: {where}. Try --prompt with the words of fast_inference/scenes.py, "
                "another --condition-type or --seed; real checkpoints: see checkpoints/README.md")
    if not args.gpt_ckpt:
        vq = "" if args.vq_ckpt else " and the VQ decoder"
        return f"no --gpt-ckpt: RANDOM weights in the transformer{vq}, so the tokens and the PNGs are noise"
    if not args.vq_ckpt:
        return "no --vq-ckpt: the VQ decoder has RANDOM weights, so the PNGs are noise (tokens are real)"
    return None


def run(args):
    t_start = time.perf_counter()
    check_args(args)
    if args.explain:
        return explain(args)
    torch.manual_seed(args.seed)
    device, dtype, backend = pick_device(args)
    demo = is_demo(args)
    margs, image_size = model_args(args)
    model_type = margs.model_type
    out = args.out or default_out(args, model_type, demo)
    check_writable(out)
    H, W = planned_shape(args, image_size, model_type)
    check_grid(margs, H, W, image_size)
    run_memory(args, margs, H, W, prompt_count(args) * args.num_images, device, dtype,
               "use a smaller --image-size, --image-H/--image-W or --num-images")
    t0 = time.perf_counter()
    model, image_size = build_gpt(args, device, dtype)
    t_models = time.perf_counter() - t0
    if demo and not all(os.path.isfile(os.path.join(EXAMPLES_DIR, f"{t}.png")) for t in CONDITION_TYPES):
        from fast_inference.conditions import write_examples

        write_examples(EXAMPLES_DIR)  # 512x512 example maps to try real checkpoints on
    t0 = time.perf_counter()
    control = control_image(args, image_size, model_type)
    t_control = time.perf_counter() - t0
    H, W = control.shape[1:]
    check_draft_grid(args, H, W)
    num_tokens = (H // 16) * (W // 16)
    t0 = time.perf_counter()
    cond, mask, prompts = text_inputs(args, model, device)
    t_text = time.perf_counter() - t0
    t0 = time.perf_counter()
    vq = vq_kernels(build_vq(args, device), backend, device, args.plan)
    t_models += time.perf_counter() - t0
    engine = make_engine(args, model, backend)
    weights = " (int8 weights)" if args.quantize == "int8" else ""
    print(f"{describe(args, model, demo)} | {args.engine} engine{'' if engine is None else ' (' + backend + ')'} | "
          f"{str(dtype).replace('torch.', '')}{weights} on {device} | {len(prompts)} prompt(s) x {args.num_images} "
          f"image(s) | {H}x{W} = {num_tokens} tokens")
    if demo:
        print(f"  prompt: {' | '.join(prompts)!r}")
    note = weights_note(args, demo)
    if note:
        print("  " + note)
    for _ in range(args.warmup):
        sample_images(args, model, engine, cond, mask, control, num_tokens)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    tokens = sample_images(args, model, engine, cond, mask, control, num_tokens)
    sync(device)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    images = vq.decode_code(tokens, (tokens.shape[0], vq.quantize.embedding.weight.shape[1], H // 16, W // 16))
    sync(device)
    t_vq = time.perf_counter() - t0
    save_outputs(args, out, images, control, tokens, caption=" | ".join(prompts) if demo else None)
    times = dict(imports=t_start - PROCESS_START, models=t_models, control=t_control, text=t_text, generate=t_gen, vq=t_vq,
                 total=time.perf_counter() - PROCESS_START)
    report(engine, times, tokens)
    print(f"saved {out}" + "".join(f", {p}" for p in (args.save_samples, args.save_tokens) if p))


def report(engine, times, tokens):
    n = tokens.numel()
    parts = [f"imports {times['imports']:.1f}s", f"models {times['models']:.1f}s", f"control {times['control']:.2f}s", f"text {times['text']:.2f}s"]
    if engine is not None and engine.last_timings:
        tm = engine.last_timings
        decode = tm["decode"]
        parts += [f"condition encoder {tm['condition']:.3f}s", f"prefill {tm['prefill']:.3f}s",
                  f"decode {decode:.2f}s ({n / max(decode, 1e-9):.0f} tok/s)"]
        spec = engine.last_speculation
        if spec:  # passes per image, tokens per pass, and a pass's time
            passes = sum(spec["passes"]) / len(spec["passes"])
            parts.append(f"{passes:.0f} passes per image, {spec['tokens_per_pass']:.2f} tokens per pass, "
                         f"{1e3 * decode / max(spec['batch_passes'], 1):.2f} ms per pass")
        if engine.backend != "eager":
            parts.append(f"compile/capture {engine.compile_seconds:.1f}s")
    else:
        parts.append(f"generate {times['generate']:.2f}s ({n / max(times['generate'], 1e-9):.0f} tok/s)")
    parts += [f"VQ decode {times['vq']:.2f}s", f"total {times['total']:.1f}s"]
    print("  " + " | ".join(parts))


def main(argv=None):
    args = parse_args(argv)
    cli_main(lambda: run(args), args.debug, is_user_error)


def official_tf32():
    """TF32 for float32 matmuls and convolutions on CUDA, as the official sample and test scripts set it (SPEC 9.1):
    the VQ decoder's attention, and fp32 (--precision none) models."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def cli_main(body, debug, user_error):
    """Run a CLI body with the official scripts' TF32 flags: a user's mistake becomes one 'error:' line and exit 2
    (--debug: traceback)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    official_tf32()
    try:
        with torch.no_grad():
            body()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 (user errors become one line; bugs keep their traceback)
        if debug or not user_error(e):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def is_user_error(e):
    """True for mistakes the user can fix (the message names the fix); bugs keep their traceback."""
    from fast_inference.conditions import ConditionError
    from fast_inference.text import TextError

    if isinstance(e, torch.cuda.OutOfMemoryError):
        e.args = ("CUDA out of memory; use a smaller --num-images (or fewer prompts, or a smaller --image-size)",)
        return True
    return isinstance(e, (UserError, CheckpointError, ConditionError, TextError, FileNotFoundError, PermissionError,
                          IsADirectoryError, NotADirectoryError, plans.PlanError))


if __name__ == "__main__":
    main()
