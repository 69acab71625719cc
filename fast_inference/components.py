"""The components a run needs, built from its settings: the GPT, the VQ, the device, precision and backend, the
memory check, the fast engine.

`config` is anything with the model settings' names as attributes: a PipelineConfig, or a command line's parsed
flags (the flags keep the official names). Without a GPT checkpoint or model the demo model is used (DEMO_DIR).
"""
import os

import torch

from fast_inference import memory
from fast_inference import plan as plans
from fast_inference.checkpoint import fit_null_caption, gpt_fix_hint, load_weights, no_init, read_state_dict
from fast_inference.model import GPT_CONFIGS, ModelArgs, Transformer
from fast_inference.quantize import quantize_int8
from fast_inference.settings import UserError
from fast_inference.speculative import DEFAULT_COUPLING

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The default model: the demo model trained on procedural shapes (scripts/train_demo.py --preset gpu) and its VQ. One
# constant, so that switching the default to another trained demo is one line (checkpoints/demo: the CPU preset's).
DEMO_DIR = os.path.join(ROOT, "checkpoints", "demo_gpu")
# Guidance without --cfg-scale: the official 4, and 1.5 for the demo model, its best edges and backgrounds
# (docs/demo_model.md, "cfg")
CFG_SCALE, DEMO_CFG_SCALE = 4.0, 1.5
DEMO_FILES = dict(gpt_model="gpt.json", gpt_ckpt="gpt.safetensors", vq_model="vq.json", vq_ckpt="vq.safetensors")
DEFAULT_T5 = os.path.join(ROOT, "checkpoints", "t5-ckpt")  # the official --t5-path default
CONDITION_TYPES = ("canny", "hed", "lineart", "depth", "seg")  # = conditions.CONDITION_TYPES (lazy import)


def find_multiple(x: int, k: int) -> int:
    """The smallest multiple of k at or above x."""
    return -(-x // k) * k


def use_demo_model(config):
    """No GPT checkpoint and no GPT model: the demo model's files (and its VQ's, unless a VQ is given). A command
    line's --cfg-scale left out becomes the model's default (default_cfg_scale)."""
    config.demo = config.gpt_ckpt is None and config.gpt_model is None
    if getattr(config, "cfg_scale", 0) is None:
        config.cfg_scale = default_cfg_scale(config)
    if config.demo:
        config.gpt_model, config.gpt_ckpt = (os.path.join(DEMO_DIR, DEMO_FILES[k]) for k in ("gpt_model", "gpt_ckpt"))
        if config.vq_ckpt is None and config.vq_model == "VQ-16":
            config.vq_model, config.vq_ckpt = (os.path.join(DEMO_DIR, DEMO_FILES[k]) for k in ("vq_model", "vq_ckpt"))
    return config


def default_cfg_scale(config) -> float:
    return DEMO_CFG_SCALE if is_demo(config) else CFG_SCALE


def is_demo(config) -> bool:
    return getattr(config, "demo", False)


def check_demo(config) -> None:
    if config.gpt_type == "c2i":
        raise UserError("the demo model is t2i; for c2i pass --gpt-model and --gpt-ckpt")
    missing = [p for p in (config.gpt_model, config.gpt_ckpt, config.vq_model, config.vq_ckpt)
               if p and p.startswith(DEMO_DIR) and not os.path.isfile(p)]
    if missing:
        raise UserError(f"the demo model's {missing[0]} is missing; restore it: git checkout -- "
                        f"{os.path.relpath(DEMO_DIR, ROOT)}")


def describe(config, margs, demo: bool) -> str:
    """The model in a few words (the run's first line, the server's /v1/info)."""
    if demo:
        return f"demo model ({os.path.relpath(DEMO_DIR, ROOT)}, trained on procedural shapes)"
    name = os.path.basename(config.gpt_model) if config.gpt_model else "GPT-XL"
    a = margs
    adapter = f"DINOv2-{a.adapter_size}" if a.model_type == "t2i" else "ViT-small"
    weights = "" if config.gpt_ckpt else ", RANDOM weights"
    return f"{name} {a.model_type} ({adapter}, {a.condition_type}, grid {int(a.block_size ** 0.5)}^2{weights})"


# ---- device, precision, backend -------------------------------------------------------------------------------------

def checked_device(name: str) -> torch.device:
    """--device's torch.device; an unknown name or cuda without a GPU is a UserError naming the fix."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown --device {name!r}; use cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda but no CUDA GPU is visible; use --device cpu")
    return device


def pick_device(config) -> tuple:
    """(device, dtype, backend) of the settings: default cuda if available, --precision, --backend."""
    device = checked_device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    dtype = precision_dtype(config.precision, cuda, cuda and torch.cuda.is_bf16_supported())
    backend = default_backend(config, device)
    check_backend(backend, device)
    return device, dtype, backend


def check_backend(backend: str, device: torch.device) -> None:
    if backend == "cudagraph" and device.type != "cuda":
        raise UserError("--backend cudagraph needs a CUDA device; use --backend eager on the CPU")


def precision_dtype(precision: str, cuda: bool, bf16: bool) -> torch.dtype:
    """--precision's dtype: auto is bf16 on GPUs that support it (bf16), fp16 on other GPUs, fp32 on the CPU."""
    if precision == "auto":
        precision = ("bf16" if bf16 else "fp16") if cuda else "fp32"
    return {"fp32": torch.float32, "none": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def default_backend(config, device: torch.device) -> str:
    return config.backend or ("inductor" if device.type == "cuda" or getattr(config, "compile", False) else "eager")


# ---- the GPT ----------------------------------------------------------------------------------------------------

def text_encoder_name(config):
    """The text encoder the GPT checkpoint names in its metadata (the demo model's: demo_text.NAME), or None (T5)."""
    if config.gpt_ckpt and config.gpt_ckpt.lower().endswith(".safetensors") and os.path.isfile(config.gpt_ckpt):
        from fast_inference.checkpoint import read_metadata

        return read_metadata(config.gpt_ckpt).get("text_encoder")
    return None


def uses_demo_text(config) -> bool:
    from fast_inference import demo_text

    return text_encoder_name(config) == demo_text.NAME


def t5_folder(config):
    """--t5-path, or outside the demo the official default checkpoints/t5-ckpt when it exists; the
    model folder itself or its parent (official layout: --t5-path + --t5-model-type)."""
    path = config.t5_path or (DEFAULT_T5 if not is_demo(config) and os.path.isdir(DEFAULT_T5) else None)
    sub = os.path.join(path, config.t5_model_type) if path else None
    if sub and not os.path.isfile(os.path.join(path, "config.json")) and os.path.isdir(sub):
        return sub
    return path


def read_json_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise UserError(f"--gpt-model {path} not found; pass a model name ({', '.join(GPT_CONFIGS)}) or a .json file")
    try:
        return ModelArgs.read_json(path)
    except ValueError as e:
        raise UserError(f"--gpt-model {e}") from None


def model_args(config) -> tuple:
    """(ModelArgs, training image size) from the GPT model (name, JSON or the demo) and the settings.

    Precedence: explicit settings, then the JSON's fields, then the official defaults."""
    name = config.gpt_model or "GPT-XL"
    given = read_json_config(name) if name.endswith(".json") else {}
    c2i = (config.gpt_type or given.get("model_type", "t2i")) == "c2i"
    ds = config.downsample_size
    if config.image_size is not None and (config.image_size <= 0 or config.image_size % ds):
        raise UserError(f"--image-size {config.image_size} is not a positive multiple of {ds}")
    default_size = 256 if c2i else 512
    values = dict(model_type="c2i" if c2i else "t2i", cls_token_num=1 if c2i else 120, adapter_size="small",
                  block_size=(default_size // ds) ** 2, vocab_size=16384)
    values.update(given)
    flags = dict(model_type=config.gpt_type, cls_token_num=config.cls_token_num, adapter_size=config.adapter_size,
                 condition_type=config.condition_type, pos_interp=config.pos_interp, vocab_size=config.codebook_size,
                 num_classes=config.num_classes, condition_token_num=config.condition_token_nums,
                 block_size=(config.image_size // ds) ** 2 if config.image_size else None)
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        margs = ModelArgs(**values) if name.endswith(".json") else ModelArgs.from_name(name, **values)
    except (TypeError, ValueError) as e:
        msg = str(e) if str(e).startswith(name) else f"{name}: {e}"
        raise UserError(f"--gpt-model {msg}") from None
    return margs, int(round(margs.block_size ** 0.5)) * ds


def build_gpt(config, device, dtype) -> tuple:
    """(the transformer, its training image size): the checkpoint's weights loaded strictly, or random ones."""
    margs, image_size = model_args(config)
    if config.gpt_ckpt:
        sd = read_state_dict(config.gpt_ckpt)
        with no_init(), torch.device(device):
            model = Transformer(margs)
        fit_null_caption(model, sd)
        load_weights(model, sd, source=config.gpt_ckpt, hint=gpt_fix_hint(margs, sd))
        del sd
    else:
        with torch.device(device):
            model = Transformer(margs)
    model = model.to(dtype).eval().requires_grad_(False)
    if config.quantize == "int8":
        quantize_int8(model)
    return model, image_size


# ---- the VQ -----------------------------------------------------------------------------------------------------

def vq_constructor(config):
    """() -> the VQ of --vq-model (an official name or a JSON of VQConfig fields), with the codebook settings."""
    from fast_inference.vq import VQ_models, VQConfig, VQModel

    if config.vq_model.endswith(".json"):
        try:
            cfg = VQConfig.from_json(config.vq_model, codebook_size=config.codebook_size,
                                     codebook_embed_dim=config.codebook_embed_dim)
        except (FileNotFoundError, ValueError) as e:
            raise UserError(f"--vq-model {e}") from None
        return lambda: VQModel(cfg)
    if config.vq_model not in VQ_models:
        raise UserError(f"unknown --vq-model {config.vq_model!r}; use VQ-16 or a .json of VQ arguments")
    kw = dict(codebook_size=config.codebook_size or 16384, codebook_embed_dim=config.codebook_embed_dim or 8)
    return lambda: VQ_models[config.vq_model](**kw)


def build_vq(config, device):
    make = vq_constructor(config)
    if config.vq_ckpt:
        sd = read_state_dict(config.vq_ckpt, key_order=("model",))
        with no_init(), torch.device(device):
            vq = make()
        hint = "Is this the VQ-16 tokenizer (vq_ds16_t2i.pt)?" if config.vq_model == "VQ-16" else "Check --vq-model"
        load_weights(vq, sd, source=config.vq_ckpt, hint=hint)
    else:
        with torch.device(device):
            vq = make()
    return vq.eval().requires_grad_(False)  # the VQ always runs in float32, as officially


def vq_config(config):
    """The VQConfig of --vq-model and the codebook settings, from a VQ built on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return vq_constructor(config)().cfg


# ---- sizes and memory -------------------------------------------------------------------------------------------

def check_grid(margs, H: int, W: int, image_size: int) -> None:
    num_tokens = (H // 16) * (W // 16)
    if num_tokens > margs.block_size:
        raise UserError(f"{H}x{W} needs {num_tokens} tokens but the model's grid has {margs.block_size} "
                        f"(--image-size {image_size}); use a larger --image-size or a smaller image")


def check_memory(margs, H, W, images, cfg_scale, device, dtype, fix, vq_cfg=None, int8=False, window=0,
                 coupling=DEFAULT_COUPLING, decoded=None) -> None:
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


def run_memory(config, margs, H, W, images, device, dtype, fix) -> None:
    """check_memory for a run of the sampling settings: int8 weights, a speculative pass, the VQ of --vq-model."""
    drafts = plans.given_drafts(config.draft_window, config.draft_coupling, config.draft_tree)
    window = plans.widest_window(drafts) if config.speculative != "none" else 0
    check_memory(margs, H, W, images, config.cfg_scale, device, dtype, fix, vq_cfg=vq_config(config),
                 int8=config.quantize == "int8", window=window, coupling=drafts.coupling)


def check_writable(path: str) -> None:
    """The nearest existing folder above path must be writable (we create the rest at the end)."""
    d = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(d):
        if os.path.exists(d):
            raise UserError(f"cannot write {path}: {d} is a file")
        d = os.path.dirname(d)
    if not os.access(d, os.W_OK):
        raise UserError(f"cannot write {path}: {d} is not writable; choose another output path")


# ---- the engine -------------------------------------------------------------------------------------------------

def make_engine(config, model, backend, speculation=None):
    """The fast engine the settings ask for, or None for engine "reference" (the official loop, plain torch).
    speculation: (speculative, window, init, coupling, tree), default the config's own."""
    from fast_inference.engine import Engine

    if config.engine == "reference":
        return None
    if speculation is None:
        speculation = (config.speculative, config.draft_window, config.draft_init, config.draft_coupling,
                       config.draft_tree)
    speculative, window, init, coupling, tree = speculation
    try:
        return Engine(model, backend=backend, compile_mode=config.compile_mode, compile_prefill=config.compile_prefill,
                      compile_scope=config.compile_scope, overrides=config.plan, speculative=speculative,
                      draft_window=window, draft_init=init, draft_coupling=coupling, draft_tree=tree)
    except plans.PlanError as e:
        raise UserError(str(e)) from None


def sample_tokens(model, engine, cond, mask, condition, num_tokens, params):
    """Tokens (B, N) with the sampling settings `params` (SamplingParams or parsed flags), from the fast engine or
    (engine None) the reference."""
    from fast_inference.generate import generate

    kw = dict(emb_masks=mask, cfg_scale=params.cfg_scale, cfg_interval=params.cfg_interval, condition=condition,
              control_strength=params.control_strength, temperature=params.temperature, top_k=params.top_k,
              top_p=params.top_p)
    if engine is None:
        return generate(model, cond, num_tokens, **kw)
    return engine.generate(cond, num_tokens, **kw)
