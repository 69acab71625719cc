"""PNG saving, bit-identical to torchvision.utils.save_image(x, normalize=True, value_range=(-1, 1)).

No torchvision dependency. Files are written atomically (temp file + os.replace) so an
interrupted run never leaves a truncated PNG that a resume step would take as finished.
"""
import math
import os
import tempfile

import numpy as np
import torch
from PIL import Image


def to_rgb(x):
    """Promote 2-D / single-channel input to 3 channels; returns (B, 3, H, W)."""
    x = torch.as_tensor(x)
    if x.dim() == 2:
        x = x.unsqueeze(0)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    return x


def normalize(x):
    """[-1, 1] -> [0, 1] in float32, same op order as torchvision (clamp, -low, /(high-low))."""
    x = x.detach().to("cpu", torch.float32)
    return x.clamp(-1.0, 1.0).sub(-1.0).div(2.0)


def quantize01(y):
    """[0, 1] float -> uint8 with round half up: floor(255*y + 0.5), clamped."""
    return y.mul(255).add(0.5).clamp(0, 255).to(torch.uint8)


def to_uint8(x):
    """(B, 3, H, W) or (3, H, W) (or grey) in [-1, 1] -> numpy uint8, (B, H, W, 3) or (H, W, 3)."""
    x = torch.as_tensor(x)
    single = x.dim() < 4
    u = quantize01(normalize(to_rgb(x))).permute(0, 2, 3, 1).numpy()
    return u[0] if single else u


def make_grid(x, nrow=8, padding=2, pad_value=0.0):
    """torchvision.utils.make_grid layout: (B, C, H, W) -> (C, H', W').

    nrow images per row, `padding` pixels around every cell (so 2*padding between cells),
    filled with pad_value. A single image is returned unpadded, as torchvision does.
    """
    x = to_rgb(x)
    b, c, h, w = x.shape
    if b == 1:
        return x[0]
    cols = min(nrow, b)
    rows = math.ceil(b / cols)
    ch, cw = h + padding, w + padding
    grid = x.new_full((c, ch * rows + padding, cw * cols + padding), pad_value)
    for k in range(b):
        y0, x0 = (k // cols) * ch + padding, (k % cols) * cw + padding
        grid[:, y0:y0 + h, x0:x0 + w] = x[k]
    return grid


def atomic_save(img: Image.Image, path):
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp_", suffix=".png", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            img.save(f, format="PNG")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def save_image(x, path, nrow=8, padding=2):
    """Save a [-1, 1] tensor (B, 3, H, W) / (3, H, W) / grey as one RGB PNG (a grid if B > 1)."""
    atomic_save(grid_image(x, nrow, padding), path)


def grid_image(x, nrow, padding):
    # normalise before gridding: torchvision pads in the [0, 1] space, so padding is black
    grid = make_grid(normalize(to_rgb(x)), nrow=nrow, padding=padding, pad_value=0.0)
    return Image.fromarray(quantize01(grid).permute(1, 2, 0).contiguous().numpy())


def save_figure(x, path, caption, nrow=8, padding=2, min_side=384):
    """save_image's grid for people to look at: each pixel repeated k times (the samples' pixels unchanged, only
    larger) so that a cell is at least min_side px, and the caption written on a strip below it."""
    from PIL import ImageDraw, ImageFont

    k = max(1, -(-min_side // x.shape[-1]))
    img = grid_image(x, nrow, padding)
    img = img.resize((img.width * k, img.height * k), Image.NEAREST)
    font = ImageFont.load_default(size=max(14, min_side // 16))
    draw = ImageDraw.Draw(img)
    lines, line = [], ""
    for word in caption.split():  # wrapped to the grid's width
        if line and draw.textlength(f"{line} {word}", font=font) > img.width - 20:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    lines.append(line)
    step = font.size + 6
    figure = Image.new("RGB", (img.width, img.height + step * len(lines) + 12), "white")
    figure.paste(img)
    draw = ImageDraw.Draw(figure)
    for i, text in enumerate(lines):
        draw.text((10, img.height + 6 + i * step), text, fill="black", font=font)
    atomic_save(figure, path)


def save_png_uint8(arr, path):
    """Write a raw uint8 array as-is: (H, W) -> mode 'L', (H, W, 3) -> 'RGB'."""
    arr = np.ascontiguousarray(np.asarray(arr, dtype=np.uint8))
    atomic_save(Image.fromarray(arr), path)
