# DINOv2 control encoder (ControlAR Dinov2_Adapter), SPEC §4.
# Module/parameter names follow transformers 4.x Dinov2Model so ControlAR checkpoints
# (keys adapter.model.*) load with strict=True.
import torch
import torch.nn as nn
import torch.nn.functional as F

DINOV2_CONFIGS = {
    "small": dict(hidden=384, layers=12, heads=6, mlp=1536),
    "base": dict(hidden=768, layers=12, heads=12, mlp=3072),
    "tiny": dict(hidden=128, layers=4, heads=4, mlp=512),  # not DINOv2's: the trained demo model's encoder
}
PATCH = 14
GRID = 37  # image 518 / patch 14 -> 37x37 position table (+ CLS row)
EPS = 1e-6


def interp_pos_table(table, h, w, pos_interp="v444"):
    """Resize the (1, 1 + 37*37, C) table to an h x w grid, keeping the CLS row.

    v444 (transformers <= 4.44): scale_factor=((h+0.1)/37, (w+0.1)/37). The output size floors
    to (h, w) but the kernel samples at dst/scale, i.e. coordinates use 37/(h+0.1), not 37/h.
    v445 (transformers >= 4.45): size=(h, w), coordinates use 37/h.
    Both resize in float32 and cast back to the table dtype.
    """
    cls, grid = table[:, :1], table[:, 1:]
    n = int(grid.shape[1] ** 0.5)
    grid = grid.reshape(1, n, n, -1).permute(0, 3, 1, 2).float()
    if pos_interp == "v444":
        grid = F.interpolate(grid, scale_factor=((h + 0.1) / n, (w + 0.1) / n), mode="bicubic", align_corners=False)
    elif pos_interp == "v445":
        grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
    else:
        raise ValueError(f"pos_interp must be 'v444' or 'v445', got {pos_interp!r}")
    assert grid.shape[-2:] == (h, w), grid.shape
    grid = grid.to(table.dtype).permute(0, 2, 3, 1).reshape(1, h * w, -1)
    return torch.cat([cls, grid], dim=1)


def cached_table(module, table, h, w, resize):
    """resize() -> the table for an h x w grid, made once per size and table: PyTorch's bicubic kernel loops over
    every channel in each output pixel's thread (3.6 ms on an H200 for DINOv2-small at 512 px, most of the control
    encoder's GPU time). A new size, a new table or an in-place write to it (its version) makes it again; so does
    autograd, which must see the resize."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and table.requires_grad):
        return resize()
    key = (h, w, table.data_ptr(), table._version, table.dtype, table.device)
    if getattr(module, "_table", (None,))[0] != key:
        module._table = key, resize()
    return module._table[1]


class PatchEmbeddings(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.projection = nn.Conv2d(3, hidden, PATCH, stride=PATCH)


class Embeddings(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.mask_token = nn.Parameter(torch.zeros(1, hidden))  # unused, kept for checkpoint parity
        self.position_embeddings = nn.Parameter(torch.zeros(1, GRID * GRID + 1, hidden))
        self.patch_embeddings = PatchEmbeddings(hidden)


class SelfAttention(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class Output(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class Attention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.attention = SelfAttention(hidden)
        self.output = Output(hidden)

    def forward(self, x):
        B, T, C = x.shape
        a = self.attention
        q, k, v = (l(x).view(B, T, self.heads, C // self.heads).transpose(1, 2) for l in (a.query, a.key, a.value))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.output.dense(y.transpose(1, 2).reshape(B, T, C))


class LayerScale(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.lambda1 = nn.Parameter(torch.ones(hidden))


class Mlp(nn.Module):
    def __init__(self, hidden, mlp):
        super().__init__()
        self.fc1 = nn.Linear(hidden, mlp)
        self.fc2 = nn.Linear(mlp, hidden)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))  # exact erf GELU


class Layer(nn.Module):
    # attribute order = HF named_parameters order (manifest order)
    def __init__(self, hidden, heads, mlp):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden, eps=EPS)
        self.attention = Attention(hidden, heads)
        self.layer_scale1 = LayerScale(hidden)
        self.norm2 = nn.LayerNorm(hidden, eps=EPS)
        self.mlp = Mlp(hidden, mlp)
        self.layer_scale2 = LayerScale(hidden)

    def forward(self, x):
        x = x + self.layer_scale1.lambda1 * self.attention(self.norm1(x))
        return x + self.layer_scale2.lambda1 * self.mlp(self.norm2(x))


class Encoder(nn.Module):
    def __init__(self, hidden, layers, heads, mlp):
        super().__init__()
        self.layer = nn.ModuleList(Layer(hidden, heads, mlp) for _ in range(layers))


class Dinov2Model(nn.Module):
    def __init__(self, size="small", pos_interp="v444"):
        super().__init__()
        cfg = DINOV2_CONFIGS[size]
        assert pos_interp in ("v444", "v445"), pos_interp
        self.pos_interp = pos_interp
        self.hidden = cfg["hidden"]
        self.embeddings = Embeddings(cfg["hidden"])
        self.encoder = Encoder(cfg["hidden"], cfg["layers"], cfg["heads"], cfg["mlp"])
        self.layernorm = nn.LayerNorm(cfg["hidden"], eps=EPS)

    def pos_embed(self, H, W):
        table = self.embeddings.position_embeddings
        h, w = H // PATCH, W // PATCH
        # same early-out as HF: square *pixel* input with exactly 37*37 patches
        if h * w == GRID * GRID and H == W:
            return table
        return cached_table(self, table, h, w, lambda: interp_pos_table(table, h, w, self.pos_interp))

    def forward(self, pixel_values):
        emb = self.embeddings
        proj = emb.patch_embeddings.projection
        x = proj(pixel_values.to(proj.weight.dtype)).flatten(2).transpose(1, 2)  # (B, h*w, C)
        x = torch.cat([emb.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed(*pixel_values.shape[-2:])
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)


def to_patch14(x, condition_type):
    """Resize (B,3,H,W) to the 14-px grid giving (H//16) x (W//16) DINOv2 tokens (SPEC §4.1)."""
    H, W = x.shape[-2:]
    size = ((H // 16) * 14, (W // 16) * 14)
    # ControlAR picks the mode by the exact string: only 'canny'/'seg' get legacy nearest
    if condition_type in ("canny", "seg"):
        return F.interpolate(x, size=size, mode="nearest")
    return F.interpolate(x, size=size, mode="bicubic", align_corners=True)


class Dinov2Adapter(nn.Module):
    def __init__(self, size="small", condition_type="hed", pos_interp="v444"):
        super().__init__()
        self.condition_type = condition_type
        self.model = Dinov2Model(size, pos_interp)
        self.out_dim = self.model.hidden

    def forward(self, x, condition_type=None):
        # x in [-1, 1]; ControlAR applies no mean/std normalisation. condition_type: the resize's, if not the model's
        return self.model(to_patch14(x, condition_type or self.condition_type))[:, 1:]
