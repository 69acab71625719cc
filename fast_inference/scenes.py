"""The demo data set: procedural scenes of a few flat shapes, their captions and their control maps.

Scene i of a split is a pure function of (split, i): one to three shapes of distinct kinds (circle, square,
triangle, diamond) in distinct colours of a small palette, not overlapping, on a plain or two-tone background
(top colour above a horizontal line, bottom colour below). Geometry is in units of the image side, so the 128 px
and the 256 px versions of a scene are the same picture. Rendering runs in torch on any device, batched:
anti-aliased RGB from each shape's signed distance, and every control type the project supports made from the
same geometry (no annotator weights):
  canny    OpenCV's Canny(100, 200) on the RGB image, re-implemented in torch (`canny`, the same pixels)
  hed      soft white outlines (a Gaussian of the distance to the nearest boundary, sigma ~1 px)
  lineart  thinner soft outlines
  depth    layered: far background, each shape a flat layer at its own depth (near = bright)
  seg      colour-coded class map (a colour per background part and per shape kind), not anti-aliased
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

# Every pair differs by >= 60 in some channel, so each boundary is a strong Canny edge.
PALETTE = {
    "red": (215, 40, 40), "orange": (245, 140, 20), "yellow": (245, 215, 40), "green": (40, 160, 70),
    "blue": (40, 90, 215), "purple": (135, 60, 175), "white": (245, 245, 245), "black": (25, 25, 25),
}
COLOURS = tuple(PALETTE)
KINDS = ("circle", "square", "triangle", "diamond")
# The captions' whole vocabulary, in a fixed order (the demo text encoder's rows follow it).
VOCABULARY = ("a", "an", "and", "on", "background") + COLOURS + KINDS
SPLITS = {"train": 0, "val": 1, "test": 2}
SEED = 69  # the data set's own seed: scene i of a split never changes
CONTROL_TYPES = ("canny", "hed", "lineart", "depth", "seg")
# seg class colours: top background, bottom background, then one per shape kind
SEG_COLOURS = ((120, 120, 120), (80, 50, 50), (6, 230, 230), (204, 5, 255), (255, 184, 6), (4, 250, 7))


@dataclass
class Shape:
    kind: str
    colour: str
    cx: float  # centre, in units of the side
    cy: float
    r: float  # circumradius: every point of the shape is within r of the centre
    layer: int  # depth order, 0 = farthest


@dataclass
class Scene:
    shapes: list  # in caption order
    top: str  # the background colour (above the horizon when two-tone)
    bottom: Optional[str] = None  # two-tone: the colour below the horizon
    horizon: float = 2.0  # the two-tone line, in units of the side (below the image: plain)

    @property
    def caption(self):
        return caption(self)


def scene(index, split="train"):
    """Scene `index` of `split` (train | val | test): the same scene on every machine."""
    rng = np.random.RandomState([SEED, SPLITS[split], int(index)])  # a stream NumPy keeps frozen
    top = str(rng.choice(COLOURS))
    bottom, horizon = None, 2.0
    if rng.random_sample() < 0.4:
        bottom = str(rng.choice([c for c in COLOURS if c != top]))
        horizon = snap(float(rng.uniform(0.3, 0.7)), 128)
    n = int(rng.choice([1, 2, 3], p=[0.25, 0.4, 0.35]))
    kinds = rng.permutation(KINDS)[:n]
    colours = rng.permutation([c for c in COLOURS if c not in (top, bottom)])[:n]
    shapes = []
    for kind, colour in zip(kinds, colours):
        for _ in range(50):  # place it clear of the others (a few scenes keep fewer shapes)
            r = float(rng.uniform(0.11, 0.2))
            cx, cy = rng.uniform(r + 0.02, 1 - r - 0.02, size=2)
            cx, cy, r = pixel_aligned(str(kind), float(cx), float(cy), r)
            if all(math.hypot(cx - s.cx, cy - s.cy) > r + s.r + 0.03 for s in shapes):
                shapes.append(Shape(str(kind), str(colour), cx, cy, r, 0))
                break
    for layer, k in enumerate(rng.permutation(len(shapes))):
        shapes[k].layer = layer
    return Scene(shapes, top, bottom, horizon)


def article(word):
    return "an" if word[0] in "aeiou" else "a"


def caption(s):
    """'a red circle, a blue square and a green triangle on a yellow background' (two-tone: 'on a yellow and
    white background', top colour first)."""
    things = [f"{article(x.colour)} {x.colour} {x.kind}" for x in s.shapes]
    listed = things[0] if len(things) == 1 else ", ".join(things[:-1]) + " and " + things[-1]
    ground = s.top if s.bottom is None else f"{s.top} and {s.bottom}"
    return f"{listed} on {article(s.top)} {ground} background"


def scenes(indices, split="train"):
    return [scene(i, split) for i in indices]


# ---- rendering ----------------------------------------------------------------------------------

def snap(v, steps):
    return round(v * steps) / steps


def pixel_aligned(kind, cx, cy, r):
    """Centres on a 1/128 grid, and the squares' sides, the diamonds' corners and the triangles' bases on it too:
    their straight edges then fall on pixel boundaries at 128 and 256 px (crisp, unambiguous Canny edges)."""
    if kind == "square":
        r = snap(0.75 * r, 128) / 0.75
    else:
        r = snap(r, 64 if kind == "triangle" else 128)
    return snap(cx, 128), snap(cy, 128), r


def circle(x, y, r):
    return torch.sqrt(x * x + y * y) - r


def square(x, y, r):  # axis-aligned, corners at 1.06 r
    return torch.maximum(x.abs(), y.abs()) - 0.75 * r


def triangle(x, y, r):  # upright and equilateral: circumradius r, inradius r / 2
    h = math.sqrt(3) / 2
    return torch.maximum(torch.maximum(y, -h * x - 0.5 * y), h * x - 0.5 * y) - 0.5 * r


def diamond(x, y, r):  # corners at r
    return (x.abs() + y.abs() - r) / math.sqrt(2)


# Signed distance in pixels (negative inside) of a shape centred at the origin; polygons: the largest of their
# edges' half-plane distances (exact inside, a mitred corner outside).
SDF = {"circle": circle, "square": square, "triangle": triangle, "diamond": diamond}


def geometry(batch, size, device):
    """Per-pixel distances for a list of scenes: (shape sdf (B, 3, H, W), +inf for absent slots; horizon sdf
    (B, H, W), negative below the line). Pixel (i, j) is sampled at its centre."""
    absent = (-1, 0.0, 0.0, 0.0)
    rows = [[(KINDS.index(sh.kind), sh.cx, sh.cy, sh.r) for sh in s.shapes] + [absent] * (3 - len(s.shapes)) for s in batch]
    kind, cx, cy, r = torch.tensor(rows, device=device).unbind(-1)  # (B, 3) each
    t = torch.arange(size, device=device, dtype=torch.float32) + 0.5
    y, x = t.view(1, size, 1), t.view(1, 1, size)
    sdf = torch.full((len(batch), 3, size, size), float("inf"), device=device)
    for j, name in enumerate(KINDS):
        b, k = (kind == j).nonzero(as_tuple=True)
        if len(b):
            c = lambda v: v[b, k].view(-1, 1, 1) * size
            sdf[b, k] = SDF[name](x - c(cx), y - c(cy), c(r))
    horizon = torch.tensor([s.horizon * size for s in batch], device=device).view(-1, 1, 1)
    return sdf, (horizon - y).expand(len(batch), size, size)


def coverage(sdf):
    """Anti-aliased coverage of a pixel from its signed distance (a one-pixel ramp)."""
    return (0.5 - sdf).clamp(0, 1)


def table(batch, values, default, device):
    """(B, 5, C) per scene: [top, bottom, shape 0, shape 1, shape 2] of values(...) (absent: default)."""
    rows = []
    for s in batch:
        row = [values("top", s), values("bottom", s)]
        row += [values(sh, s) for sh in s.shapes] + [default] * (3 - len(s.shapes))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32, device=device)


def composite(layers, sdf, horizon):
    """Paint (B, 5, C) layer values: top background, bottom background over the line, then the shapes."""
    out = layers[:, 0, :, None, None] * torch.ones_like(horizon)[:, None]
    out = torch.lerp(out, layers[:, 1, :, None, None], coverage(horizon)[:, None])
    for k in range(3):
        out = torch.lerp(out, layers[:, 2 + k, :, None, None], coverage(sdf[:, k])[:, None])
    return out


def rgb_of(part, s):
    if part == "top":
        return PALETTE[s.top]
    if part == "bottom":
        return PALETTE[s.bottom or s.top]
    return PALETTE[part.colour]


def render(batch, size, device="cpu"):
    """uint8 RGB (B, 3, size, size) of a list of scenes."""
    sdf, horizon = geometry(batch, size, device)
    return to_uint8(composite(table(batch, rgb_of, (0, 0, 0), device), sdf, horizon))


def to_uint8(x):
    return x.round().clamp(0, 255).to(torch.uint8)


def labels(batch, size, device="cpu"):
    """(B, size, size) int64 class map: 0 top background, 1 bottom background, 2 + kind inside a shape; and
    (B, 3, size, size) bool: the pixels of each shape slot (sdf < 0)."""
    sdf, horizon = geometry(batch, size, device)
    label = (horizon < 0).long()
    inside = sdf < 0
    kinds = table(batch, lambda p, s: (0,) if isinstance(p, str) else (2 + KINDS.index(p.kind),), (0,), device)
    for k in range(3):
        label = torch.where(inside[:, k], kinds[:, 2 + k, 0, None, None].long(), label)
    return label, inside


def soft_edges(batch, size, sigma, device):
    """255 * exp(-d^2 / 2 sigma^2), d the distance in pixels to the nearest boundary (shapes, horizon)."""
    sdf, horizon = geometry(batch, size, device)
    d = torch.minimum(sdf.abs().amin(1), horizon.abs())
    return 255 * torch.exp(-0.5 * (d / sigma) ** 2)


def depth_of(part, s):
    if part == "top":
        return (40,)
    if part == "bottom":
        return (70,) if s.bottom else (40,)
    return (120 + 120 * part.layer / 2,)


def control(batch, kind, size, device="cpu", rgb=None):
    """uint8 control map (B, 3, size, size) of one type for a list of scenes (rgb: their render, if made)."""
    if kind == "canny":
        edges = canny(render(batch, size, device) if rgb is None else rgb)
        return (edges.to(torch.uint8) * 255)[:, None].expand(-1, 3, -1, -1)
    if kind in ("hed", "lineart"):
        sigma = (1.0 if kind == "hed" else 0.6) * max(1.0, size / 256)
        return to_uint8(soft_edges(batch, size, sigma, device))[:, None].expand(-1, 3, -1, -1)
    sdf, horizon = geometry(batch, size, device)
    if kind == "depth":
        return to_uint8(composite(table(batch, depth_of, (0,), device), sdf, horizon)).expand(-1, 3, -1, -1)
    if kind == "seg":  # hard class colours (a segmentation map is not anti-aliased)
        label, _ = labels(batch, size, device)
        return torch.tensor(SEG_COLOURS, dtype=torch.uint8, device=device)[label].permute(0, 3, 1, 2)
    raise ValueError(f"unknown control type {kind!r}; use one of {', '.join(CONTROL_TYPES)}")


def to_model_range(x):
    """uint8 0..255 -> float [-1, 1] as conditions.to_model_range: 2 (x / 255 - 0.5)."""
    return 2 * (x.float() / 255 - 0.5)


# ---- OpenCV's Canny in torch ----------------------------------------------------------------------

TG22 = int(0.4142135623730950488016887242097 * (1 << 15) + 0.5)  # tan(22.5 deg) in OpenCV's fixed point


def sobel(img):
    """3x3 Sobel dx, dy of (B, C, H, W) int32 with replicated borders (OpenCV's Canny)."""
    p = F.pad(img.float(), (1, 1, 1, 1), mode="replicate").int()
    rows = p[:, :, :-2] + 2 * p[:, :, 1:-1] + p[:, :, 2:]  # vertical smoothing
    cols = p[:, :, :, :-2] + 2 * p[:, :, :, 1:-1] + p[:, :, :, 2:]
    return rows[..., 2:] - rows[..., :-2], cols[:, :, 2:] - cols[:, :, :-2]


def canny(rgb, low=100, high=200):
    """cv2.Canny(rgb, low, high) (aperture 3, L1 gradient) of uint8 (B, C, H, W) -> bool (B, H, W). Per pixel
    the channel of the largest |dx| + |dy| (the first on ties), non-maximum suppression in four sectors with
    OpenCV's comparisons, then the pixels over `low` connected to one over `high` (8-neighbourhood)."""
    dx, dy = sobel(rgb.int())
    mag = dx.abs() + dy.abs()
    best = mag.argmax(1, keepdim=True)
    mag, dx, dy = (t.gather(1, best)[:, 0] for t in (mag, dx, dy))
    m = F.pad(mag, (1, 1, 1, 1))  # zero outside the image
    H, W = mag.shape[-2:]
    at = lambda di, dj: m[:, 1 + di:1 + di + H, 1 + dj:1 + dj + W]
    ax, ay = dx.abs().long(), dy.abs().long() << 15
    tg22 = ax * TG22
    horizontal = ay < tg22
    vertical = ay > tg22 + (ax << 16)
    s = torch.where((dx < 0) != (dy < 0), -1, 1)  # the diagonal's orientation
    diag = torch.where(s > 0, (mag > at(-1, -1)) & (mag > at(1, 1)), (mag > at(-1, 1)) & (mag > at(1, -1)))
    peak = torch.where(horizontal, (mag > at(0, -1)) & (mag >= at(0, 1)),
                       torch.where(vertical, (mag > at(-1, 0)) & (mag >= at(1, 0)), diag))
    candidate = peak & (mag > low)
    edges = candidate & (mag > high)
    while True:  # grow the strong edges along the candidates until nothing changes
        grown = candidate & (F.max_pool2d(edges[:, None].float(), 3, 1, 1)[:, 0] > 0)
        if torch.equal(grown, edges):
            return edges
        edges = grown
