"""The command lines' shared flags: the model and sampling flags (official names and defaults), the parser that
prints one line, and the run wrapper that turns a user's mistake into one `error:` line and exit code 2.

fast_engine.py, fast_eval.py, serve.py and bench.py build their parsers from these; the values are checked by the
library (settings.py, pipeline.py), the same checks a Pipeline's keyword arguments meet.
"""
import argparse
import logging
import sys

import torch

from fast_inference import plan as plans
from fast_inference.components import CONDITION_TYPES
from fast_inference.checkpoint import CheckpointError
from fast_inference.draft_tree import format_tree, parse_tree
from fast_inference.model import GPT_CONFIGS
from fast_inference.quantize import MODES as QUANTIZE_MODES
from fast_inference.settings import RANGES, SPECULATIVE, UserError, span
from fast_inference.speculative import COUPLINGS, DEFAULT_INIT, DRAFT_INITS

BACKENDS, COMPILE_SCOPES = plans.BACKENDS, plans.COMPILE_SCOPES


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


# The draft flags' defaults in --help (plan.given_drafts and choose_drafts; docs/speculative.md says the same)
DRAFT_DEFAULTS = (f"default: with --draft-window, --draft-coupling and --draft-tree all left out the plan picks "
                  f"{plans.MEASURED_TREE.window}, {plans.MEASURED_TREE.coupling}, "
                  f"{format_tree(plans.MEASURED_TREE.tree)} where that tree measured faster than the chain (TREE_GAINS: "
                  f"under 8 images on a CUDA GPU with Triton, left drafts), else {plans.CHAIN.window}, "
                  f"{plans.CHAIN.coupling}, none (--explain and the report say which); any of them given pins the "
                  f"drafts, the others then {plans.CHAIN.window}, {plans.CHAIN.coupling} (pathwise with a tree), none")


def ranged(name, what, ranges=RANGES):
    """A numeric flag's --help: what it is, its accepted range, its default and what the edge values mean."""
    note = ranges[name][2]
    return f"{what}, {span(name, ranges)} (default %(default)s)" + (f"; {note}" if note else "")


def tree_arg(text):
    """argparse's type of --draft-tree: draft_tree.parse_tree, its error as argparse's."""
    try:
        return parse_tree(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_model_args(p):
    """Model and sampling flags shared with fast_eval.py (official names and defaults).

    Model flags left unset (None) take the --gpt-model JSON's value, else the official default."""
    p.add_argument("--gpt-model", default=None, help=f"{', '.join(GPT_CONFIGS)} or a .json of model arguments "
                   "(default: GPT-XL with --gpt-ckpt, the demo model without)")
    p.add_argument("--gpt-ckpt", default=None, help="ControlAR checkpoint (.safetensors or .pt); none: random weights "
                   "with --gpt-model, the demo model (checkpoints/demo_gpu) without")
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
    p.add_argument("--cfg-scale", type=float, default=None,
                   help=f"classifier-free guidance scale, {span('cfg_scale')} (default 4, the official; 2 with the "
                        f"demo model, its best); {RANGES['cfg_scale'][2]}")
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
                        "(as gpt-fast's int8 mode): half the bytes each step reads; faster for one image, slower above "
                        "8 images (docs/PERF_NOTES.md); the images change slightly")
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
    p.add_argument("--draft-window", type=int, default=None,
                   help=f"positions a pass verifies, {span('draft_window')}; {DRAFT_DEFAULTS}")
    p.add_argument("--draft-init", choices=list(DRAFT_INITS), default=DEFAULT_INIT,
                   help="the drafts of positions a pass has not reached yet: random (uniform, as SJD), left (the "
                        "token before, repeated) or above (the token one grid row up; square images, a window no wider "
                        "than the grid)")
    p.add_argument("--draft-coupling", choices=list(COUPLINGS), default=None,
                   help="gumbel: redraw each position's draft with noise fixed per (image, position, token), as MC-SJD, "
                        "so that drafts move only where their distribution does (still lossless); none: fresh noise; "
                        "pathwise: every token's noise fixed too, so the image is a function of the seed alone and a "
                        "draft is kept where it is its position's token (lossless; needed by --draft-tree); default: as --draft-window")
    p.add_argument("--draft-tree", type=tree_arg, default=None, metavar="WxD[+SxE]|none",
                   help="each pass verifies W candidates of the window's first draft, each with D drafts below it, "
                        "beside the chain, and with +SxE the runner-up of each of the next S drafts, each with E "
                        "drafts below it (draft_tree.py; --draft-coupling pathwise); none: the chain alone; default: as "
                        "--draft-window")
    p.add_argument("--plan", action="append", default=[], metavar="KEY=VALUE",
                   help="override the decode plan's choice (repeatable; also CONTROLAR_PLAN=KEY=VALUE,...): "
                        + "; ".join(f"{k}={'|'.join(v)}" for k, v in plans.OVERRIDES.items()))
    p.add_argument("--debug", action="store_true", help="show tracebacks")


def add_text_args(p):
    """The T5 flags of a command line that encodes prompts (fast_engine.py, serve.py)."""
    p.add_argument("--t5-model-type", default="flan-t5-xl", help="the model's folder under --t5-path")
    p.add_argument("--t5-feature-max-len", type=int, default=120, help="T5 tokens per prompt (>= 1)")


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
