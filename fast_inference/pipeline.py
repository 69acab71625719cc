"""The library's entry point: build a ControlAR model once, then call it with a control and a prompt for images.

    from fast_inference import Pipeline
    pipe = Pipeline()                                   # the demo model (checkpoints/demo_gpu)
    images = pipe(prompt="a red circle and a blue square on a white background", seed=1)
    images[0].save("sample.png")

    pipe = Pipeline(gpt_ckpt="checkpoints/edge_base.safetensors", adapter_size="base", condition_type="hed",
                    condition_ckpt="checkpoints/ControlNetHED.pth", vq_ckpt="checkpoints/vq_ds16_t2i.pt",
                    t5_path="checkpoints/t5-ckpt/flan-t5-xl")
    images = pipe("photo.png", "a house by a lake", num_images=4)   # the hed map extracted from the photo

The settings keep the command lines' names (fast_engine.py --help says what each does); a mistake is a UserError
(or the ConditionError, TextError, CheckpointError of the part that found it) whose one line names the fix.
"""
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np
import torch
from PIL import Image

from fast_inference import plan as plans
from fast_inference.components import (CONDITION_TYPES, build_gpt, build_vq, check_demo, check_grid, default_cfg_scale,
                                       find_multiple, is_demo, make_engine, model_args, pick_device, sample_tokens,
                                       t5_folder, use_demo_model, uses_demo_text, vq_constructor)
from fast_inference.draft_tree import parse_tree
from fast_inference.settings import RANGES, SamplingParams, UserError, check_draft_grid, check_ranges, flag_name
from fast_inference.speculative import DEFAULT_INIT

DEMO_SCENE = 3  # the demo's default control: this scene of the demo set's test split (scenes.py)
Control = Union[str, os.PathLike, Image.Image, np.ndarray, None]


@dataclass
class PipelineConfig:
    """What a Pipeline is built from: the model's files and how it runs. The names and defaults are the command
    lines' flags (official names); no GPT checkpoint and no GPT model means the demo model."""
    gpt_model: Optional[str] = None  # GPT-B ... GPT-7B or a .json of ModelArgs fields
    gpt_ckpt: Optional[str] = None  # .safetensors or .pt; None with gpt_model: random weights
    gpt_type: Optional[str] = None  # t2i | c2i
    vq_model: str = "VQ-16"  # or a .json of VQConfig fields
    vq_ckpt: Optional[str] = None
    codebook_size: Optional[int] = None
    codebook_embed_dim: Optional[int] = None
    image_size: Optional[int] = None  # the training resolution: the model's grid
    downsample_size: int = 16
    cls_token_num: Optional[int] = None
    num_classes: Optional[int] = None
    condition_token_nums: Optional[int] = None
    adapter_size: Optional[str] = None
    condition_type: str = "hed"  # the control's type: canny, hed, lineart, depth, seg
    condition_ckpt: Optional[str] = None  # the annotator's weights (hed, lineart, depth) for extraction
    pos_interp: str = "v444"
    t5_path: Optional[str] = None
    t5_model_type: str = "flan-t5-xl"
    t5_feature_max_len: int = 120
    no_left_padding: bool = False
    precision: str = "auto"  # auto | fp32 | bf16 | fp16
    quantize: str = "none"  # none | int8
    device: Optional[str] = None  # default cuda if available
    engine: str = "fast"  # fast | reference
    backend: Optional[str] = None  # inductor | cudagraph | eager (default inductor on CUDA, eager on the CPU)
    compile: bool = False
    compile_mode: str = "reduce-overhead"
    compile_prefill: bool = False
    compile_scope: str = "block"
    plan: tuple = ()  # decode plan overrides, "key=value"
    seed: int = 0  # the random weights' seed (a model without a checkpoint)
    keep_text_encoder: bool = True  # False: T5 is freed after each prompt (a command line's one run)
    demo: bool = field(default=False, repr=False)  # set when the demo model's files are filled in

    def __post_init__(self):
        if self.gpt_ckpt is None and self.gpt_model is None:
            use_demo_model(self)

    @classmethod
    def from_args(cls, args) -> "PipelineConfig":
        """The model flags of a command line (argparse names)."""
        names = [f.name for f in dataclasses.fields(cls)]
        values = {k: getattr(args, k) for k in names if hasattr(args, k)}
        values["plan"] = tuple(values.get("plan") or ())
        return cls(**values)

    @classmethod
    def from_json(cls, path: str) -> "PipelineConfig":
        """A JSON object of these settings (unknown keys are refused, naming the known ones)."""
        try:
            with open(path, encoding="utf-8") as f:
                values = json.load(f)
        except (OSError, ValueError) as e:
            raise UserError(f"{path}: not a readable JSON file ({e}); write an object of Pipeline settings") from None
        known = [f.name for f in dataclasses.fields(cls) if f.name != "demo"]
        unknown = sorted(set(values) - set(known)) if isinstance(values, dict) else None
        if unknown is None or unknown:
            raise UserError(f"{path}: unknown setting(s) {unknown}; use {', '.join(known)}")
        return cls(**values)


CHOICES = dict(precision=("auto", "fp32", "none", "bf16", "fp16"), quantize=("none", "int8"),
               engine=("fast", "reference"), backend=(None, *plans.BACKENDS), compile_scope=plans.COMPILE_SCOPES,
               gpt_type=(None, "t2i", "c2i"), pos_interp=("v444", "v445"),
               adapter_size=(None, "small", "base", "tiny"))


def check_config(config, spell: Callable[[str], str] = flag_name) -> None:
    """The model settings, before anything loads: choices, files, the demo's files, the VQ's name or JSON."""
    for name, choices in CHOICES.items():
        if getattr(config, name) not in choices:
            raise UserError(f"{spell(name)} {getattr(config, name)!r}: use one of "
                            f"{', '.join(c for c in choices if c is not None)}")
    if is_demo(config):
        check_demo(config)
    if config.quantize == "int8" and config.compile_scope == "step":
        raise UserError("--quantize int8 runs with --compile-scope block (the default); drop --compile-scope step")
    if config.condition_type not in CONDITION_TYPES:
        raise UserError(f"unknown {spell('condition_type')} {config.condition_type!r}; use one of "
                        f"{', '.join(CONDITION_TYPES)}")
    for name in ("gpt_ckpt", "vq_ckpt"):
        path = getattr(config, name)
        if path is not None and not os.path.isfile(path):
            raise UserError(f"{spell(name)} {path} not found")
    vq_constructor(config)  # an unknown VQ name or a bad JSON: one line now
    if config.condition_ckpt is not None and not os.path.exists(config.condition_ckpt):
        raise UserError(f"{spell('condition_ckpt')} {config.condition_ckpt} not found")


def control_shape(H: int, W: int, is_map: bool, condition_type: str, height=None, width=None) -> tuple:
    """sample_t2i_MR.py's size of a control image: both sides rounded up to multiples of 16 (32 for depth
    extraction), or the size asked for."""
    step = 32 if condition_type == "depth" and not is_map else 16
    return height or find_multiple(H, step), width or find_multiple(W, step)


def demo_scene():
    from fast_inference import scenes

    return scenes.scene(DEMO_SCENE, "test")


def demo_map(condition_type: str, size: int) -> np.ndarray:
    """uint8 (size, size, 3): the demo scene's control map of this type."""
    from fast_inference import scenes

    return scenes.control([demo_scene()], condition_type, size)[0].permute(1, 2, 0).numpy()


def demo_rgb(condition_type: str, H: int, W: int) -> np.ndarray:
    """uint8 (H, W, 3): the demo scene's control map of this type, drawn at the larger side and resized to H x W."""
    from fast_inference import conditions

    rgb = demo_map(condition_type, max(H, W))
    return rgb if (H, W) == rgb.shape[:2] else conditions.resize_to(rgb, H, W)


def left_fit(x: torch.Tensor, T: int) -> torch.Tensor:
    """Left-padded (P, 120, ...) -> (P, T, ...): keep the last T positions (where the real tokens
    are) or pad zeros on the left; the layout caption embedding files get for a prefix of T."""
    L = x.shape[1]
    if L >= T:
        return x[:, L - T:]
    return torch.cat([x.new_zeros(x.shape[0], T - L, *x.shape[2:]), x], dim=1)


def encode_prompts(encoder, prompts: list, T: int, left_padding: bool = True) -> tuple:
    """T5's embeddings (P, T, C) and masks (P, T) of prompts, left padded to the prefix T (or T5's right padding)."""
    if not left_padding:
        emb, mask = encoder.encode(prompts)
        return (emb * mask[..., None].to(emb.dtype))[:, :T], mask[:, :T]
    emb, mask = encoder.encode_left_padded(prompts)
    return left_fit(emb, T), left_fit(mask, T)


def to_pil(images: torch.Tensor) -> list:
    """(B, 3, H, W) in [-1, 1] -> PIL images, the pixels save_image writes."""
    from fast_inference.images import to_uint8

    return [Image.fromarray(a) for a in to_uint8(images)]


class Pipeline:
    """A ControlAR model, its VQ and its engines, built once; call it for images.

    Pipeline() is the demo model; Pipeline(gpt_ckpt=..., vq_ckpt=..., ...) official checkpoints by their paths;
    Pipeline.from_json(path) a JSON of the settings. The parts stay inspectable: .model, .vq, .engine_for(params),
    .config. spell: how errors name a setting (the keyword; the command lines pass their flags' spelling)."""

    def __init__(self, config: Optional[PipelineConfig] = None, *, spell: Callable[[str], str] = str, **settings):
        known = [f.name for f in dataclasses.fields(PipelineConfig) if f.name != "demo"]
        unknown = sorted(set(settings) - set(known))
        if unknown:
            raise UserError(f"unknown Pipeline setting(s) {unknown}; the settings are {', '.join(known)}")
        config = dataclasses.replace(config, **settings) if config else PipelineConfig(**settings)
        check_ranges(config, {k: v for k, v in RANGES.items() if hasattr(config, k)}, spell)
        check_config(config, spell)
        self.config, self.spell = config, spell
        self.device, self.dtype, self.backend = pick_device(config)
        self.margs, self.image_size = model_args(config)
        torch.manual_seed(config.seed)  # random weights (no checkpoint) as the command lines' --seed makes them
        self.model, _ = build_gpt(config, self.device, self.dtype)
        from fast_inference.engine import vq_kernels

        self.vq = vq_kernels(build_vq(config, self.device), self.backend, self.device, config.plan)
        self.engines = {}  # one fast engine per speculative setting, made when first asked for
        self.text_encoder = None

    @classmethod
    def from_json(cls, path: str, **settings) -> "Pipeline":
        return cls(PipelineConfig.from_json(path), **settings)

    @property
    def demo(self) -> bool:
        return is_demo(self.config)

    @property
    def model_type(self) -> str:
        return self.margs.model_type

    # ---- the call ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self,
        control: Control = None,
        prompt: Union[str, list, None] = None,
        *,
        caption_emb: Union[str, os.PathLike, torch.Tensor, None] = None,
        class_label: Optional[int] = None,
        is_map: bool = False,
        height: Optional[int] = None,
        width: Optional[int] = None,
        num_images: int = 1,
        seed: int = 0,
        cfg_scale: Optional[float] = None,
        cfg_interval: int = -1,
        top_k: int = 2000,
        top_p: float = 1.0,
        temperature: float = 1.0,
        control_strength: float = 1.0,
        speculative: str = "none",
        draft_window: Optional[int] = None,
        draft_init: str = DEFAULT_INIT,
        draft_coupling: Optional[str] = None,
        draft_tree: Union[str, tuple, None] = None,
        return_tokens: bool = False,
    ) -> Union[list, tuple]:
        """Images from one control and one prompt (or several: num_images each, the same control).

        Args:
            control: the control image as a path, a PIL image or a uint8 (H, W, 3) array, extracted as the config's
                condition_type asks (canny, hed, lineart, depth; seg is the map itself); None: the demo scene's map.
            prompt: text (T5, or the demo model's words), or a list of them; None: the demo scene's caption (T5:
                the official default prompt).
            caption_emb: instead of a prompt, an extracted caption .npz or a (P, L, C) tensor, left padded.
            class_label: the class of a c2i model.
            is_map: the control is a ready control map (no extraction).
            height, width: the output size, multiples of 16 (default the control's, rounded up to 16).
            num_images: images per prompt; seed: torch.manual_seed before sampling.
            cfg_scale, cfg_interval, top_k, top_p, temperature, control_strength: the official sampling settings
                (cfg_scale None: 4, the official, or 2 with the demo model).
            speculative, draft_window, draft_init, draft_coupling, draft_tree: speculative Jacobi decoding ("jacobi":
                several tokens per pass, the same distribution); window, coupling and tree all None: the plan picks
                them (docs/speculative.md), any given pins them.
            return_tokens: also return the token ids (B, H/16 * W/16).

        Returns:
            a list of PIL images (prompts x num_images), or (that list, the tokens) with return_tokens.
        """
        # 1. Check inputs: the sampling settings, once
        if isinstance(draft_tree, str):
            try:
                draft_tree = parse_tree(draft_tree)
            except ValueError as e:
                raise UserError(str(e).replace("--draft-tree", self.spell("draft_tree"))) from None
        cfg_scale = default_cfg_scale(self.config) if cfg_scale is None else cfg_scale
        params = SamplingParams(cfg_scale=cfg_scale, cfg_interval=cfg_interval, top_k=top_k, top_p=top_p,
                                temperature=temperature, control_strength=control_strength, seed=seed,
                                num_images=num_images, speculative=speculative, draft_window=draft_window,
                                draft_init=draft_init, draft_coupling=draft_coupling, draft_tree=draft_tree,
                                spell=self.spell)
        # 2. The control map (3, H, W)
        control = self.prepare_control(control, is_map=is_map, height=height, width=width)
        check_draft_grid(params, *control.shape[1:], self.spell)
        # 3. The prefix: caption embeddings and masks, or class labels
        cond, mask, _ = self.encode_prompt(prompt, caption_emb=caption_emb, class_label=class_label)
        # 4. The tokens
        tokens = self.generate_tokens(cond, mask, control, params)
        # 5. The VQ decoder, then PIL images
        images = to_pil(self.decode(tokens, *control.shape[1:]))
        return (images, tokens) if return_tokens else images

    # ---- its phases ----------------------------------------------------------------------------------------------

    def prepare_control(self, control: Control = None, *, is_map: bool = False, height: Optional[int] = None,
                        width: Optional[int] = None) -> torch.Tensor:
        """The control map (3, H, W) in [-1, 1] on the CPU. Like sample_t2i_MR.py, an image is resized (PIL bicubic)
        so both sides are multiples of 16 (32 for depth extraction), or to height x width; c2i takes it as a ready
        map, as sample_c2i.py does. None: the demo scene's map at the model's size."""
        from fast_inference import conditions

        for name, side in (("height", height), ("width", width)):
            if side is not None and (isinstance(side, bool) or not isinstance(side, int) or side <= 0 or side % 16):
                fit = max(16, find_multiple(side, 16)) if isinstance(side, int) else 256
                raise UserError(f"{self.spell(name)} {side} is not a positive multiple of 16; use e.g. {fit}")
        kind = self.config.condition_type
        if control is None:
            if not self.demo:
                raise UserError(f"give a control image: {self.spell('control')} PATH, a PIL image or an array (the "
                                "image, or a ready map)")
            H, W = height or self.image_size, width or self.image_size
            check_grid(self.margs, H, W, self.image_size)
            return conditions.extract_control(demo_rgb(kind, H, W), kind, is_map=True)
        rgb = self.read_control(control)
        is_map = is_map or self.model_type == "c2i"
        H, W = rgb.shape[:2]
        target = control_shape(H, W, is_map, kind, height, width)
        check_grid(self.margs, *target, self.image_size)
        if target != (H, W):
            rgb = conditions.resize_to(rgb, *target)
        return conditions.extract_control(rgb, kind, ckpt=self.config.condition_ckpt, is_map=is_map)

    def read_control(self, control: Control) -> np.ndarray:
        """A path, a PIL image or an array -> uint8 (H, W, 3)."""
        from fast_inference import conditions

        if isinstance(control, (str, os.PathLike)):
            return conditions.read_rgb(os.fspath(control))
        if isinstance(control, Image.Image):
            return np.array(control.convert("RGB"))
        if isinstance(control, np.ndarray):
            if control.ndim == 2:
                control = np.repeat(control[..., None], 3, axis=2)  # grey
            return conditions.check_rgb(control)
        raise UserError(f"{self.spell('control')} must be a path, a PIL image or a uint8 (H, W, 3) array, not "
                        f"{type(control).__name__}")

    def encode_prompt(self, prompt: Union[str, list, None] = None, *, caption_emb=None,
                      class_label: Optional[int] = None) -> tuple:
        """(cond, masks, names) for P prompts: caption embeddings (P, T, C) left padded with their masks (P, T), or
        c2i class labels (P,) with masks None; names say what each row is (its prompt, or its class)."""
        from fast_inference import text

        a, T, device = self.margs, self.margs.cls_token_num, self.device
        if a.model_type == "c2i":
            if class_label is None:
                raise UserError(f"c2i needs a class: pass {self.spell('class_label')} N (0..{a.num_classes - 1})")
            if isinstance(class_label, bool) or not isinstance(class_label, int) or \
                    not 0 <= class_label < a.num_classes:
                raise UserError(f"{self.spell('class_label')} must be in 0..{a.num_classes - 1}, got {class_label}")
            return torch.tensor([class_label], device=device), None, [f"class {class_label}"]
        if sum(x is not None for x in (prompt, caption_emb)) > 1:
            raise UserError(f"give one text source: {self.spell('prompt')} or {self.spell('caption_emb')}")
        if caption_emb is not None:
            return self.caption_inputs(caption_emb)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt) if prompt is not None else None
        if prompts is not None and (not prompts or not all(isinstance(p, str) for p in prompts)):
            raise UserError(f"{self.spell('prompt')} must be a string or a list of strings")
        encoder = self.load_text_encoder()
        if encoder is None:
            if prompts is not None:
                raise UserError(f"{self.spell('prompt')} needs the text encoder: pass {self.spell('t5_path')} "
                                f"checkpoints/t5-ckpt/flan-t5-xl (or use {self.spell('caption_emb')} FILE.npz)")
            raise UserError(f"give a prompt: {self.spell('prompt')} TEXT with {self.spell('t5_path')}, or "
                            f"{self.spell('caption_emb')} FILE.npz")
        from fast_inference.demo_text import DemoTextEncoder

        if isinstance(encoder, DemoTextEncoder):
            if prompts is None:
                if not self.demo:
                    raise UserError(f"give a prompt: {self.spell('prompt')} TEXT (the demo model's words) or "
                                    f"{self.spell('caption_emb')}")
                prompts = [demo_scene().caption]
            emb, mask = encoder.encode_left_padded(prompts)
            return emb.to(device), mask.to(device), prompts
        prompts = prompts or ["a high-quality image"]  # the official default prompt
        emb, mask = encode_prompts(encoder, prompts, T, not self.config.no_left_padding)
        if not self.config.keep_text_encoder:
            self.text_encoder = None
        text.check_t5_output(emb, encoder.path)
        return emb, mask, prompts

    def caption_inputs(self, caption_emb) -> tuple:
        """An extracted caption .npz (official format) or a (P, L, C) tensor, left padded to the model's prefix."""
        from fast_inference import text

        a, T = self.margs, self.margs.cls_token_num
        if isinstance(caption_emb, torch.Tensor):
            if caption_emb.dim() != 3:
                raise UserError(f"{self.spell('caption_emb')} must be (P, L, C), got {tuple(caption_emb.shape)}")
            emb = left_fit(caption_emb.float().cpu(), T)
            mask, name, prompts = (emb != 0).any(-1).long(), self.spell("caption_emb"), ["caption_emb"] * len(emb)
        else:
            name = os.fspath(caption_emb)
            emb, mask, prompt = text.load_caption_emb(name, T)
            prompts = [prompt]
        if emb.shape[2] != a.caption_dim:
            raise UserError(f"{name}: caption_emb width {emb.shape[2]} != the model's caption_dim {a.caption_dim}; "
                            "use embeddings of the model's text encoder")
        text.check_values(emb, f"{name}: 'caption_emb'", "run with --precision bf16 or fp32", self.dtype)
        return emb.to(self.device), mask.to(self.device), prompts

    def load_text_encoder(self):
        """The model's text encoder, loaded once: the demo model's words (no weights), T5 from t5_path, or None."""
        if self.text_encoder is None:
            from fast_inference import text
            from fast_inference.demo_text import DemoTextEncoder

            t5 = t5_folder(self.config)
            if uses_demo_text(self.config):
                self.text_encoder = DemoTextEncoder(self.margs.caption_dim, self.margs.cls_token_num)
            elif t5 and self.model_type == "t2i":
                # T5 in the run's precision, as the official T5Embedder(torch_dtype=precision)
                self.text_encoder = text.T5Encoder(t5, device=self.device, dtype=self.dtype,
                                                   max_length=self.config.t5_feature_max_len)
        return self.text_encoder

    def engine_for(self, params: Optional[SamplingParams] = None):
        """The fast engine of these speculative settings (made once), or None for engine "reference"."""
        key = (params or SamplingParams()).speculation
        if key not in self.engines:
            self.engines[key] = make_engine(self.config, self.model, self.backend, key)
        return self.engines[key]

    def generate_tokens(self, cond: torch.Tensor, mask: Optional[torch.Tensor], control: torch.Tensor,
                        params: SamplingParams) -> torch.Tensor:
        """Tokens (P * num_images, H/16 * W/16): every prompt num_images times with the same control, after
        torch.manual_seed(params.seed)."""
        n = params.num_images
        cond = cond.repeat_interleave(n, 0)
        mask = mask.repeat_interleave(n, 0) if mask is not None else None
        condition = control[None].to(cond.device).expand(cond.shape[0], -1, -1, -1)
        num_tokens = (control.shape[1] // 16) * (control.shape[2] // 16)
        engine = self.engine_for(params)
        torch.manual_seed(params.seed)
        return sample_tokens(self.model, engine, cond, mask, condition, num_tokens, params)

    def decode(self, tokens: torch.Tensor, H: int, W: int) -> torch.Tensor:
        """Tokens (B, H/16 * W/16) -> images (B, 3, H, W) in [-1, 1] through the VQ decoder."""
        shape = (tokens.shape[0], self.vq.quantize.embedding.weight.shape[1], H // 16, W // 16)
        return self.vq.decode_code(tokens, shape)
