"""Control maps: from an RGB image to the (3, H, W) tensor in [-1, 1] the adapter takes.

Follows sample_t2i.py (SPEC section 10) per condition type:
  canny    OpenCV Canny(100, 200) on the RGB array itself (no grey conversion)
  hed      HED network on raw 0..255 RGB; sigmoid, x255, clamp
  lineart  LineArt network on raw 0..255 RGB; inverted to white lines on black
           (invert_lineart=False gives test_t2i.py's dark-on-white variant)
  depth    DPT (Intel/dpt-large folder) at the image's own size; x255/max
  seg      the colour-coded segmentation image itself
and then x -> 2 (x/255 - 0.5), one channel repeated to three.

Depth at sizes other than 512x512: sample_t2i.py always asks the DPT processor for 512x512, so
its depth map is 512x512 whatever the input (non-512 inputs are stretched to it);
sample_t2i_MR.py asks for the (32-rounded) image size when the image is square and switches to
MiDaS dpt_hybrid for non-square images. We run DPT at the image's own H x W: identical to
sample_t2i for 512x512 inputs and to sample_t2i_MR for square ones. Non-square images (which
transformers' DPT-large cannot take) and sides not a multiple of 32 are refused with a hint;
MiDaS is not implemented: pass a precomputed depth map with is_map instead.

Also draws example control maps procedurally (no copied images) for demos and tests.
"""
import functools
import math
import os

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFilter

CONDITION_TYPES = ("canny", "hed", "lineart", "depth", "seg")
CANNY_LOW, CANNY_HIGH = 100, 200


class ConditionError(ValueError):
    """A user mistake around the control image; the message names the fix."""


# ---------------------------------------------------------------------------------- image I/O

def read_rgb(path, fix=None):
    """An image file -> uint8 (H, W, 3). Grey, palette and RGBA files are converted to RGB."""
    return read_image(path, lambda im: np.array(im.convert("RGB")), fix)


def read_size(path, fix=None):
    """(H, W) of an image file from its header alone: sizes are checked before any pixel is decoded."""
    return read_image(path, lambda im: (im.height, im.width), fix)


def read_image(path, take, fix=None):
    """take(the opened PIL image); a missing or unreadable file is one ConditionError ending with fix (default: the
    fast_engine.py flag; fast_eval.py names the manifest line or the split instead)."""
    if not os.path.isfile(path):
        raise ConditionError(f"control image {path} not found; {fix or 'pass an existing image with --condition-path'}")
    try:
        with Image.open(path) as im:
            return take(im)
    except Exception as e:
        raise ConditionError(f"cannot read {path} as an image ({e}); "
                             f"{fix or 'pass a PNG or JPEG with --condition-path'}") from None


def resize_to(rgb, H, W):
    """PIL bicubic resize to H x W (what sample_t2i_MR.py does to the condition file)."""
    return np.array(Image.fromarray(rgb).resize((W, H), Image.BICUBIC))


def check_rgb(rgb):
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ConditionError(f"expected a uint8 RGB array (H, W, 3), got {rgb.dtype} {rgb.shape}; load it with read_rgb")
    return np.ascontiguousarray(rgb)


# ------------------------------------------------------------------------------- extraction

def to_model_range(x):
    """0..255 -> [-1, 1] with the official operation order: 2 * (x / 255 - 0.5)."""
    return 2 * (x.float() / 255 - 0.5)


def canny(rgb):
    """(H, W) uint8 in {0, 255}. On 3 channels OpenCV takes, per pixel, the channel with the
    largest gradient; this differs from Canny on a grey image, and the official code does this.
    Without OpenCV: the same algorithm in torch (scenes.canny; the same pixels in the tests)."""
    try:
        import cv2
    except ImportError:
        from fast_inference.scenes import canny as torch_canny

        edges = torch_canny(torch.from_numpy(np.ascontiguousarray(rgb)).permute(2, 0, 1)[None], CANNY_LOW, CANNY_HIGH)
        return edges[0].numpy().astype(np.uint8) * 255
    return cv2.Canny(rgb, CANNY_LOW, CANNY_HIGH)


def annotator_weights(model, ckpt, kind, filename):
    """Strictly load an annotator file into model, turning every failure into one line."""
    from fast_inference.checkpoint import CheckpointError, load_weights, read_state_dict

    if ckpt is None:
        raise ConditionError(f"{kind} needs its annotator weights: pass --condition-ckpt path/to/{filename}")
    try:
        load_weights(model, read_state_dict(ckpt), source=ckpt, hint=f"--condition-ckpt must be the {kind} file {filename}")
    except FileNotFoundError:
        raise ConditionError(f"{kind} weights {ckpt} not found; pass the {filename} file with --condition-ckpt") from None
    except CheckpointError as e:
        raise ConditionError(str(e)) from None
    return model


@functools.lru_cache(maxsize=4)
def load_annotator(kind, ckpt, device):
    """The hed or lineart network with weights, in fp32 eval mode; cached across calls."""
    if kind == "hed":
        from fast_inference.hed import HED

        net = annotator_weights(HED(), ckpt, kind, "ControlNetHED.pth")
    else:
        from fast_inference.lineart import LineArt

        net = annotator_weights(LineArt(), ckpt, kind, "model.pth")
    return net.to(device).eval()


@functools.lru_cache(maxsize=2)
def load_dpt(ckpt, device):
    try:
        from transformers import DPTForDepthEstimation, DPTImageProcessor
    except ImportError:
        raise ConditionError("depth needs transformers: pip install transformers") from None
    if ckpt is None or not os.path.isdir(ckpt):
        raise ConditionError("depth needs --condition-ckpt pointing to a local Intel/dpt-large folder "
                             "(config.json, preprocessor_config.json, weights)")
    try:
        processor = DPTImageProcessor.from_pretrained(ckpt)
        model = DPTForDepthEstimation.from_pretrained(ckpt)
    except (OSError, ValueError) as e:
        raise ConditionError(f"{ckpt} is not a DPT folder ({str(e).splitlines()[0]}); download Intel/dpt-large into it") from None
    return processor, model.to(device).eval()


def depth(rgb, ckpt, device):
    """(1, H, W) float in 0..255: DPT relative inverse depth scaled so its maximum is 255."""
    H, W = rgb.shape[:2]
    # transformers' ViT-DPT reshapes its tokens to a square grid, and its head rounds sides up
    # to multiples of 32 (hence sample_t2i_MR's 32-rounding and MiDaS for non-square images).
    if H != W or H % 32:
        raise ConditionError(f"depth extraction needs a square image with sides a multiple of 32, got {H}x{W}; "
                             "resize it, or pass a ready depth map with --condition-is-map")
    processor, model = load_dpt(ckpt, device)
    # The processor resizes (aspect not kept), rescales 1/255 and normalises per its config.
    pixels = processor(images=Image.fromarray(rgb), return_tensors="pt", size=(H, W))["pixel_values"]
    d = model(pixel_values=pixels.to(device)).predicted_depth  # (1, H, W); no min subtraction below
    return d * 255 / d.max()


@torch.no_grad()
def extract_control(rgb, condition_type, ckpt=None, device="cpu", is_map=False, invert_lineart=True):
    """uint8 RGB (H, W, 3) -> float32 (3, H, W) in [-1, 1] on the CPU.

    ckpt: the annotator file (hed: ControlNetHED.pth, lineart: model.pth) or DPT folder (depth).
    is_map: rgb already is the control map (e.g. a saved edge map); it is only rescaled.
    """
    if condition_type not in CONDITION_TYPES:
        raise ConditionError(f"unknown condition type {condition_type!r}; use one of {', '.join(CONDITION_TYPES)}")
    rgb = check_rgb(rgb)
    if is_map or condition_type == "seg":
        x = to_model_range(torch.from_numpy(rgb).permute(2, 0, 1))
    elif condition_type == "canny":
        x = to_model_range(torch.from_numpy(canny(rgb))[None])
    elif condition_type == "depth":
        x = to_model_range(depth(rgb, ckpt, device)).cpu()
    else:
        net = load_annotator(condition_type, ckpt, torch.device(device))
        image = torch.from_numpy(rgb).permute(2, 0, 1)[None].to(device).float()
        out = net(image)[0].cpu()  # (1, H, W) in [0, 1]
        if condition_type == "hed":
            x = to_model_range((out * 255.0).clamp(0, 255))
        elif invert_lineart:
            x = to_model_range((1 - out) * 255)
        else:
            x = 2 * (out - 0.5)  # test_t2i.py: no 0..255 round trip
    if not torch.isfinite(x).all():  # e.g. a depth map whose maximum is 0 (x 255 / 0): tokens of all zeros
        raise ConditionError(f"the {condition_type} annotator gave NaN or infinite values for this image; "
                             "pass a ready control map with --condition-is-map")
    return x.expand(3, -1, -1).contiguous()


# ---------------------------------------------------------------------------------- examples

def scene_shapes(rng, H, W):
    """Three shapes as (kind, (cx, cy, r)) in pixels, one per third of the width so none is cut."""
    s = min(H, W)
    shapes = []
    for slot, kind in enumerate(rng.permutation(["ellipse", "rectangle", "polygon"])):
        cx = (slot + 0.5 + rng.uniform(-0.1, 0.1)) * W / 3
        cy = rng.uniform(0.45, 0.6) * H
        shapes.append((str(kind), (cx, cy, rng.uniform(0.09, 0.13) * s)))
    return shapes


def polygon_points(cx, cy, r, n=5, phase=0.3):
    return [(cx + r * math.cos(phase + 2 * math.pi * k / n), cy + r * math.sin(phase + 2 * math.pi * k / n)) for k in range(n)]


def draw_edges(rng, H, W, width):
    """White outlines on black: three shapes, a horizon and a wavy curve."""
    im = Image.new("L", (W, H), 0)
    d = ImageDraw.Draw(im)
    for kind, (cx, cy, r) in scene_shapes(rng, H, W):
        if kind == "ellipse":
            d.ellipse((cx - r, cy - 0.7 * r, cx + r, cy + 0.7 * r), outline=255, width=width)
        elif kind == "rectangle":
            d.rectangle((cx - r, cy - r, cx + 0.8 * r, cy + 1.2 * r), outline=255, width=width)
        else:
            d.polygon(polygon_points(cx, cy, r), outline=255, width=width)
    horizon = rng.uniform(0.6, 0.8) * H
    d.line([(0, horizon), (W - 1, horizon + rng.uniform(-0.05, 0.05) * H)], fill=255, width=width)
    amp, freq = rng.uniform(0.03, 0.06) * H, rng.uniform(1.5, 3.0)
    wave = [(x, 0.15 * H + amp * math.sin(2 * math.pi * freq * x / W)) for x in range(0, W, 4)]
    d.line(wave, fill=255, width=width)
    return im


def draw_depth(rng, H, W):
    """Near = bright, as DPT's inverse depth: a receding ground plane plus shaded spheres."""
    y, x = np.mgrid[0:H, 0:W].astype(np.float64)
    horizon = rng.uniform(0.35, 0.5) * H
    ground = np.clip((y - horizon) / (H - horizon), 0, 1)
    img = 40 + 180 * ground  # far wall / sky at 40, ground brightening towards the viewer
    for _ in range(3):
        cx, cy = rng.uniform(0.15, 0.85) * W, rng.uniform(0.4, 0.8) * H
        r = rng.uniform(0.08, 0.18) * min(H, W)
        q = 1 - ((x - cx) ** 2 + (y - cy) ** 2) / r ** 2
        near = 60 + 180 * cy / H  # objects lower in the frame are closer
        img = np.where(q > 0, np.maximum(img, near + 15 * np.sqrt(np.clip(q, 0, 1))), img)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    return im.filter(ImageFilter.GaussianBlur(1.5))


def draw_seg(rng, H, W):
    """Flat colour regions without anti-aliasing: sky, ground, a building, a tree, a person."""
    im = Image.new("RGB", (W, H), (80, 170, 230))  # sky
    d = ImageDraw.Draw(im)
    horizon = rng.uniform(0.55, 0.7) * H
    d.rectangle((0, horizon, W, H), fill=(140, 110, 60))  # ground
    bx, bw = rng.uniform(0.05, 0.4) * W, rng.uniform(0.25, 0.35) * W
    d.rectangle((bx, 0.25 * H, bx + bw, horizon), fill=(180, 60, 60))  # building
    d.polygon([(bx - 0.03 * W, 0.25 * H), (bx + bw / 2, 0.12 * H), (bx + bw + 0.03 * W, 0.25 * H)], fill=(110, 40, 110))
    tx = rng.uniform(0.65, 0.85) * W
    d.rectangle((tx - 0.02 * W, horizon - 0.15 * H, tx + 0.02 * W, horizon + 0.02 * H), fill=(100, 70, 30))  # trunk
    d.ellipse((tx - 0.12 * W, horizon - 0.4 * H, tx + 0.12 * W, horizon - 0.12 * H), fill=(40, 160, 60))  # crown
    px = rng.uniform(0.45, 0.6) * W
    d.ellipse((px - 0.025 * W, horizon - 0.02 * H, px + 0.025 * W, horizon + 0.03 * H), fill=(230, 200, 40))  # head
    d.rectangle((px - 0.035 * W, horizon + 0.03 * H, px + 0.035 * W, horizon + 0.2 * H), fill=(230, 200, 40))  # body
    return im


def draw_example(condition_type, H=512, W=512, seed=0):
    """A plausible control map of this type, drawn procedurally -> uint8 (H, W, 3)."""
    if condition_type not in CONDITION_TYPES:
        raise ConditionError(f"unknown condition type {condition_type!r}; use one of {', '.join(CONDITION_TYPES)}")
    rng = np.random.default_rng(seed)
    if condition_type == "canny":
        im = draw_edges(rng, H, W, width=1)  # thin, hard {0, 255} edges
    elif condition_type == "hed":
        im = draw_edges(rng, H, W, width=3).filter(ImageFilter.GaussianBlur(1.2))  # soft edges
    elif condition_type == "lineart":
        im = draw_edges(rng, H, W, width=2).filter(ImageFilter.GaussianBlur(0.6))
    elif condition_type == "depth":
        im = draw_depth(rng, H, W)
    else:
        im = draw_seg(rng, H, W)
    return np.array(im.convert("RGB"))


def write_examples(directory, H=512, W=512):
    """Write {type}.png for every condition type (atomically); returns the paths."""
    from fast_inference.images import save_png_uint8

    paths = []
    for kind in CONDITION_TYPES:
        path = os.path.join(directory, f"{kind}.png")
        save_png_uint8(draw_example(kind, H, W), path)
        paths.append(path)
    return paths
