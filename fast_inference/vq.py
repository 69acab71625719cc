"""LlamaGen VQ image tokenizer (VQ-16 / VQ-8), inference only.

Module and parameter names follow the official checkpoint (vq_ds16_t2i.pt, ckpt['model']) so it
loads strictly. Always run in float32: the scripts never cast the tokenizer.
"""
import json
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VQConfig:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    ch: int = 128
    ch_mult: tuple = (1, 1, 2, 2, 4)
    z_channels: int = 256
    num_res_blocks: int = 2  # the decoder uses one more per level
    in_channels: int = 3
    out_channels: int = 3
    # GroupNorm's groups (not in the state dict). Official: 32, i.e. 4 channels per group at its 128-channel levels;
    # a narrower VQ keeps that ratio (ch 32: 8 groups). At one channel per group the last norm would be an instance
    # norm, and a flat image would decode to one colour whatever its own.
    norm_groups: int = 32

    def __post_init__(self):
        self.ch_mult = tuple(self.ch_mult)
        g = self.norm_groups
        if any(self.ch * m % g for m in self.ch_mult) or self.z_channels % g:
            raise ValueError(f"every level's channels (ch * ch_mult) and z_channels must be multiples of norm_groups "
                             f"{g}, got ch {self.ch}, ch_mult {list(self.ch_mult)}, z_channels {self.z_channels}")

    @classmethod
    def from_json(cls, path, **overrides):
        """A JSON of VQConfig fields (the official ModelArgs' encoder_ch_mult / decoder_ch_mult, when equal, as
        ch_mult; its training-only fields ignored); overrides that are not None win. One-line errors."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"VQ config {path} not found")
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f'{path} must hold a JSON object of VQ arguments, e.g. {{"ch": 32}}')
        enc, dec = config.pop("encoder_ch_mult", None), config.pop("decoder_ch_mult", None)
        if enc is not None or dec is not None:
            if enc is not None and dec is not None and list(enc) != list(dec):
                raise ValueError(f"{path}: encoder_ch_mult {enc} != decoder_ch_mult {dec}; this VQ takes one ch_mult")
            config.setdefault("ch_mult", enc if enc is not None else dec)
        config = {k: v for k, v in config.items() if k not in VQ_TRAINING_ONLY}
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{path}: unknown VQ argument(s) {unknown}; use {', '.join(sorted(known))}")
        config.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**config)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: {e}") from None


# Fields of the official VQ ModelArgs that only training reads.
VQ_TRAINING_ONLY = {"codebook_show_usage", "commit_loss_beta", "entropy_loss_ratio", "dropout_p"}


class GroupNorm(nn.GroupNorm):
    """nn.GroupNorm of x + x_bias (per channel, if given: the bias of the convolution before), then SiLU if silu.
    Its statistics from var_mean, which spreads each group over many thread blocks: PyTorch's CUDA kernel gives an
    (image, group) one block, 32 blocks at batch 1 for up to 128 MB of activations (8.7 of a 512 px decode's 17.5 ms
    on an H200). Then y = a * x + b with a and b per (image, channel), as that kernel computes it. With kernels
    (VQModel.use_kernels: the engine's group_norm_triton), theirs where they take x."""

    kernels = None

    def forward(self, x, silu=False, x_bias=None):
        if self.kernels is not None and self.kernels.supported(x, self.num_groups):
            return self.kernels.group_norm(x, self.num_groups, self.weight, self.bias, self.eps, silu, x_bias)
        if x_bias is not None:
            x = x + x_bias.view(1, -1, *(1,) * (x.dim() - 2))
        B, C = x.shape[:2]
        g = x.unflatten(1, (self.num_groups, -1))  # (B, G, C/G, H, W): a view in either memory format
        var, mean = torch.var_mean(g, dim=tuple(range(2, g.dim())), correction=0)
        per = C // self.num_groups
        a = torch.rsqrt(var + self.eps).repeat_interleave(per, 1) * self.weight  # (B, C)
        b = self.bias - mean.repeat_interleave(per, 1) * a
        shape = (B, C) + (1,) * (x.dim() - 2)
        y = torch.addcmul(b.view(shape), x, a.view(shape))
        return F.silu(y) if silu else y


def norm(c, groups=32):
    return GroupNorm(groups, c, eps=1e-6, affine=True)


def conv3(cin, cout, stride=1, padding=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=padding)


def conv1(cin, cout):
    return nn.Conv2d(cin, cout, 1)


def conv(m, x):
    """The Conv2d m on x without its bias, which what reads the output adds (GroupNorm's x_bias, the residual)."""
    return F.conv2d(x, m.weight, None, m.stride, m.padding)


class ResBlock(nn.Module):
    kernels = None  # VQModel.use_kernels

    def __init__(self, cin, cout, groups=32):
        super().__init__()
        self.norm1, self.conv1 = norm(cin, groups), conv3(cin, cout)
        self.norm2, self.conv2 = norm(cout, groups), conv3(cout, cout)
        if cin != cout:
            self.nin_shortcut = conv1(cin, cout)

    def forward(self, x):
        # the two convolutions' biases are added where their outputs are read: one pass less over each
        h = conv(self.conv1, self.norm1(x, silu=True))
        h = conv(self.conv2, self.norm2(h, silu=True, x_bias=self.conv1.bias))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        if self.kernels is not None:
            return self.kernels.residual(x, h, self.conv2.bias)
        return x + (h + self.conv2.bias.view(1, -1, 1, 1))


class AttnBlock(nn.Module):
    """Single-head self-attention over all h*w positions, scale c^-1/2."""

    def __init__(self, c, groups=32):
        super().__init__()
        self.norm = norm(c, groups)
        self.q, self.k, self.v, self.proj_out = conv1(c, c), conv1(c, c), conv1(c, c), conv1(c, c)

    def forward(self, x):
        b, c, h, w = x.shape
        hn = self.norm(x)
        # (b, hw, c), one head, the official explicit softmax: in float32 SDPA would take its memory-efficient
        # kernel for channels-last inputs, 4x slower here (1.1 ms per 512 px image on an H200)
        q, k, v = (m(hn).flatten(2).transpose(1, 2) for m in (self.q, self.k, self.v))
        o = torch.softmax(q @ k.transpose(1, 2) * c**-0.5, dim=-1) @ v
        return x + self.proj_out(o.transpose(1, 2).reshape(b, c, h, w))


class Downsample(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv = conv3(c, c, stride=2, padding=0)

    def forward(self, x):
        # asymmetric pad (right/bottom only) as in the original taming code
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    kernels = None  # VQModel.use_kernels

    def __init__(self, c):
        super().__init__()
        self.conv = conv3(c, c)

    def forward(self, x):
        if self.kernels is not None:
            return self.conv(self.kernels.upsample(x))  # F.interpolate's nearest 2x, the same values
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def level(cin, cout, n_res, attn, resample=None, groups=32):
    """One resolution level: n_res ResBlocks (each followed by an AttnBlock if attn), then resample."""
    m = nn.Module()
    m.res = nn.ModuleList([ResBlock(cin if i == 0 else cout, cout, groups) for i in range(n_res)])
    m.attn = nn.ModuleList([AttnBlock(cout, groups) for _ in range(n_res)] if attn else [])
    if resample == "down":
        m.downsample = Downsample(cout)
    elif resample == "up":
        m.upsample = Upsample(cout)
    return m


def run_level(m, h):
    for i, res in enumerate(m.res):
        h = res(h)
        if len(m.attn):
            h = m.attn[i](h)
    if hasattr(m, "downsample"):
        h = m.downsample(h)
    if hasattr(m, "upsample"):
        h = m.upsample(h)
    return h


def mid_block(c, groups=32):
    return nn.ModuleList([ResBlock(c, c, groups), AttnBlock(c, groups), ResBlock(c, c, groups)])


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        chs = [cfg.ch * m for m in cfg.ch_mult]
        n = len(chs)
        self.conv_in = conv3(cfg.in_channels, cfg.ch)
        self.conv_blocks = nn.ModuleList([
            level(cfg.ch if i == 0 else chs[i - 1], chs[i], cfg.num_res_blocks,
                  attn=(i == n - 1), resample=None if i == n - 1 else "down", groups=cfg.norm_groups)
            for i in range(n)])
        self.mid = mid_block(chs[-1], cfg.norm_groups)
        self.norm_out = norm(chs[-1], cfg.norm_groups)
        self.conv_out = conv3(chs[-1], cfg.z_channels)

    def forward(self, x):
        h = self.conv_in(x)
        for m in self.conv_blocks:
            h = run_level(m, h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(self.norm_out(h, silu=True))


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        chs = [cfg.ch * m for m in reversed(cfg.ch_mult)]  # deepest level first
        n = len(chs)
        self.conv_in = conv3(cfg.z_channels, chs[0])
        self.mid = mid_block(chs[0], cfg.norm_groups)
        self.conv_blocks = nn.ModuleList([
            level(chs[0] if i == 0 else chs[i - 1], chs[i], cfg.num_res_blocks + 1,
                  attn=(i == 0), resample=None if i == n - 1 else "up", groups=cfg.norm_groups)
            for i in range(n)])
        self.norm_out = norm(chs[-1], cfg.norm_groups)
        self.conv_out = conv3(chs[-1], cfg.out_channels)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for m in self.conv_blocks:
            h = run_level(m, h)
        return self.conv_out(self.norm_out(h, silu=True))


class Quantizer(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        self.l2_norm = cfg.codebook_l2_norm
        self.embedding = nn.Embedding(cfg.codebook_size, cfg.codebook_embed_dim)
        # training-time usage ring buffer; only kept so the official checkpoint loads strictly
        self.register_buffer("codebook_used", torch.zeros(65536))

    def codebook(self):
        w = self.embedding.weight
        return F.normalize(w, p=2, dim=-1, eps=1e-12) if self.l2_norm else w

    def lookup(self, indices, shape):
        """indices (B, h*w) raster order -> (B, C, h, w)."""
        b, c, h, w = shape
        return self.codebook()[indices].reshape(b, h, w, c).permute(0, 3, 1, 2).contiguous()

    def nearest(self, z):
        """z (B, C, h, w) -> (B, h*w) nearest codebook indices."""
        b, c = z.shape[:2]
        zf = z.permute(0, 2, 3, 1).reshape(-1, c)
        e = self.codebook()
        if self.l2_norm:
            zf = F.normalize(zf, p=2, dim=-1)
        # same expansion as the original (|z|^2 + |e|^2 - 2 z.e) so argmin ties break the same way
        d = zf.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1) - 2 * zf @ e.t()
        return d.argmin(1).reshape(b, -1)


class VQModel(nn.Module):
    # decode at most this many output pixels per chunk: the 128-ch full-resolution activations are 512 B/pixel each,
    # so 4 images of 512^2 is ~0.5 GB per tensor (memory.py counts one chunk)
    max_decode_pixels = 4 * 512 * 512

    def __init__(self, cfg: VQConfig = None):
        super().__init__()
        self.cfg = cfg = cfg or VQConfig()
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quantize = Quantizer(cfg)
        self.quant_conv = conv1(cfg.z_channels, cfg.codebook_embed_dim)
        self.post_quant_conv = conv1(cfg.codebook_embed_dim, cfg.z_channels)
        # Channels-last convolutions: cuDNN's NHWC kernels run without transposing every activation in and out
        # (512 px on an H200: 15.4 -> 13.5 ms per image, 38.9 -> 34.4 ms for 4). load_weights copies into
        # these tensors, so the layout stays.
        self.to(memory_format=torch.channels_last)

    def use_kernels(self, kernels):
        """The decoder's GroupNorms, residual adds and upsampling through `kernels` (a module with group_norm, residual,
        upsample and supported: the engine's group_norm_triton, where the plan takes it), or torch's ops (None)."""
        for m in self.modules():
            if isinstance(m, (GroupNorm, ResBlock, Upsample)):
                m.kernels = kernels
        return self

    @classmethod
    def images_per_chunk(cls, H, W, max_pixels=None):
        """Images of H x W pixels decode_code decodes at once."""
        return max(1, (max_pixels or cls.max_decode_pixels) // (H * W))

    @property
    def downsample(self):
        return 2 ** (len(self.cfg.ch_mult) - 1)

    @torch.no_grad()
    def encode(self, x):
        """x (B, 3, H, W) in [-1, 1] -> (B, (H/ds)*(W/ds)) token indices, raster order."""
        return self.quantize.nearest(self.quant_conv(self.encoder(x)))

    @torch.no_grad()
    def decode_code(self, indices, shape=None):
        """indices (B, N) -> (B, 3, ds*h, ds*w) float32, not clamped. shape = (B, C, h, w)."""
        b, n = indices.shape
        if shape is None:
            side = int(round(n ** 0.5))
            shape = (b, self.cfg.codebook_embed_dim, side, side)
        _, c, h, w = shape
        per = self.images_per_chunk(h * self.downsample, w * self.downsample, self.max_decode_pixels)
        outs = []
        for i in range(0, b, per):
            idx = indices[i:i + per]
            if b > per:  # every chunk of `per` images (the last padded): a convolution's sums vary with the batch
                idx = torch.cat([idx, idx[-1:].expand(per - idx.shape[0], -1)])
            z = self.quantize.lookup(idx, (idx.shape[0], c, h, w))
            z = z.contiguous(memory_format=torch.channels_last)
            outs.append(self.decoder(self.post_quant_conv(z)).float())
        return torch.cat(outs)[:b].contiguous()


def VQ_16(**kw):
    return VQModel(VQConfig(ch_mult=(1, 1, 2, 2, 4), **kw))


def VQ_8(**kw):
    return VQModel(VQConfig(ch_mult=(1, 2, 2, 4), **kw))


VQ_models = {"VQ-16": VQ_16, "VQ-8": VQ_8}
