# ViT-small control encoder for c2i (ControlAR ViT_Adapter), SPEC §6 (c2i paragraph).
# Names follow transformers 4.x ViTModel (with pooler) so checkpoints load with strict=True.
import torch
import torch.nn as nn
import torch.nn.functional as F

from .dinov2 import Attention, cached_table

HIDDEN, LAYERS, HEADS, MLP = 384, 12, 6, 1536
PATCH = 16
GRID = 14  # image 224 / patch 16
EPS = 1e-12


class PatchEmbeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.projection = nn.Conv2d(3, HIDDEN, PATCH, stride=PATCH)


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.cls_token = nn.Parameter(torch.zeros(1, 1, HIDDEN))
        self.position_embeddings = nn.Parameter(torch.zeros(1, GRID * GRID + 1, HIDDEN))
        self.patch_embeddings = PatchEmbeddings()


class Dense(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)


class Layer(nn.Module):
    # attribute order = HF named_parameters order (manifest order)
    def __init__(self):
        super().__init__()
        self.attention = Attention(HIDDEN, HEADS)
        self.intermediate = Dense(HIDDEN, MLP)
        self.output = Dense(MLP, HIDDEN)
        self.layernorm_before = nn.LayerNorm(HIDDEN, eps=EPS)
        self.layernorm_after = nn.LayerNorm(HIDDEN, eps=EPS)

    def forward(self, x):
        x = x + self.attention(self.layernorm_before(x))
        return x + self.output.dense(F.gelu(self.intermediate.dense(self.layernorm_after(x))))


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.ModuleList(Layer() for _ in range(LAYERS))


def resize_table(table, h, w):
    # unlike DINOv2, ViT resizes in the model dtype (no float32 round trip), and the
    # "+0.1" scale factor means kernel coordinates use 14/(h+0.1), not 14/h
    cls, grid = table[:, :1], table[:, 1:]
    grid = grid.reshape(1, GRID, GRID, HIDDEN).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((h + 0.1) / GRID, (w + 0.1) / GRID), mode="bicubic", align_corners=False)
    assert grid.shape[-2:] == (h, w), grid.shape
    return torch.cat([cls, grid.permute(0, 2, 3, 1).reshape(1, h * w, HIDDEN)], dim=1)


class ViTModel(nn.Module):
    """HF ViTModel forward with interpolate_pos_encoding=True (transformers <= 4.44 rule)."""

    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.encoder = Encoder()
        self.layernorm = nn.LayerNorm(HIDDEN, eps=EPS)
        self.pooler = Dense(HIDDEN, HIDDEN)  # unused (tanh(dense(CLS))), kept for checkpoint parity

    def pos_embed(self, H, W):
        table = self.embeddings.position_embeddings
        h, w = H // PATCH, W // PATCH
        if h * w == GRID * GRID and H == W:
            return table
        return cached_table(self, table, h, w, lambda: resize_table(table, h, w))

    def forward(self, pixel_values):
        emb = self.embeddings
        proj = emb.patch_embeddings.projection
        x = proj(pixel_values.to(proj.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([emb.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed(*pixel_values.shape[-2:])
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)


class ViTAdapter(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = ViTModel()
        self.out_dim = HIDDEN

    def forward(self, x, condition_type=None):  # the type changes nothing here (c2i takes the map as is)
        # no to_patch14: 256x256 -> 16x16 tokens directly; drop CLS
        return self.model(x)[:, 1:]
