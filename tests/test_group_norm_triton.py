"""The VQ decoder's GroupNorm + SiLU kernels (kernels/group_norm_triton.py) against torch's GroupNorm, in Triton's
CPU interpreter (TRITON_INTERPRET=1), and compiled ahead of time for sm_90."""
import subprocess
import sys

import pytest
import torch

import interpret
import sm90
from fast_inference.kernels import group_norm_triton

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
import torch.nn.functional as F
from fast_inference.kernels import group_norm_triton

torch.manual_seed(0)
checked = 0
# one group's pixels over several programs and a partial last tile; a mean 300 times the spread (the shift: float32
# sums of x and x squared are off by 0.17 there, torch's own float32 GroupNorm by 1.4e-4, as a x + b rounds);
# 4 to 16 channels a group, as the decoder's 128 to 512 channels have; with the convolution's bias and without; and
# more pixels than MAX_PARTS tiles, so that a program sums several tiles
for B, C, H, W, G, scale, mean, silu, with_bias in ((1, 128, 24, 20, 32, 3.0, 5.0, True, True),
                                                    (2, 64, 9, 7, 32, 1.0, 0.0, False, False),
                                                    (1, 512, 23, 23, 32, 1.0, -2.0, True, False),
                                                    (2, 128, 31, 33, 32, 1.0, 300.0, False, True),
                                                    (1, 512, 72, 72, 32, 2.0, 1.0, True, True)):
    x = torch.randn(B, C, H, W) * torch.rand(B, C, 1, 1) * scale + mean + torch.randn(B, C, 1, 1) * scale
    x = x.contiguous(memory_format=torch.channels_last)
    w, b, x_bias = torch.randn(C), torch.randn(C), torch.randn(C) if with_bias else None
    biased = x + x_bias.view(1, C, 1, 1) if with_bias else x  # the float32 add PyTorch's convolution does
    want = F.group_norm(biased.double(), G, w.double(), b.double(), 1e-6)
    want = (F.silu(want) if silu else want).float()
    got = group_norm_triton.group_norm(x, G, w, b, 1e-6, silu, x_bias)
    assert got.is_contiguous(memory_format=torch.channels_last) and got.shape == x.shape
    err = (got - want).abs().max().item()
    assert err < 2e-5 * max(1.0, abs(mean) / scale), (B, C, H, W, err)
    checked += 1
# the residual add with the convolution's bias: x + (h + bias), bit for bit, over a partial last block
group_norm_triton.supported = lambda x, num_groups=1: x.is_contiguous(memory_format=torch.channels_last)
for shape in ((1, 128, 24, 20), (2, 64, 9, 7)):
    x, h = (torch.randn(shape).contiguous(memory_format=torch.channels_last) for _ in range(2))
    bias = torch.randn(shape[1])
    got = group_norm_triton.residual(x, h, bias)
    assert got.is_contiguous(memory_format=torch.channels_last) and torch.equal(got, x + (h + bias.view(1, -1, 1, 1)))
    checked += 1
# nearest 2x upsampling, bit for bit, over images whose pixels end in a partial block
for shape in ((2, 128, 5, 7), (1, 512, 3, 3)):
    x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
    got = group_norm_triton.upsample(x)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, F.interpolate(x, scale_factor=2.0, mode="nearest"))
    checked += 1
print("ok", checked)
"""


def test_group_norm_matches_torch_in_interpreter():
    """Against torch's GroupNorm of x plus the convolution's bias in float64 (then SiLU), to float32's rounding, and
    the residual add bit for bit: images over several programs each, several tiles a program and a partial last
    tile, 64 to 512 channels, and a mean 300 times the spread, whose variance plain float32 sums of x and x squared
    lose to cancellation."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=interpret.ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["ok", "9"], out.stdout


def test_supported_only_channels_last_float32_on_cuda():
    x = torch.zeros(1, 128, 4, 4).contiguous(memory_format=torch.channels_last)
    assert not group_norm_triton.supported(x, 32)  # on the CPU the eager path runs
    meta = x.to("meta")
    assert group_norm_triton.supported(meta, 32) == (group_norm_triton.triton is not None and meta.is_cuda)


AOT_SCRIPT = r"""
from fast_inference.kernels import group_norm_triton as gn
from sm90 import build

for C in (128, 256, 512):
    block_p = 4096 // C
    for has_bias in (True, False):
        build(gn._partials_kernel, {"X": "*fp32", "XBIAS": "*fp32", "PARTS": "*fp32", "HW": "i32", "per_prog": "i32",
                                    "n_parts": "i32"}, dict(C=C, G=32, BLOCK_P=block_p, HAS_BIAS=has_bias), {})
        for silu in (True, False):
            build(gn._apply_kernel, {"X": "*fp32", "XBIAS": "*fp32", "AB": "*fp32", "Y": "*fp32", "HW": "i32"},
                  dict(C=C, BLOCK_P=block_p, SILU=silu, HAS_BIAS=has_bias), {})
    build(gn._scale_shift_kernel, {"PARTS": "*fp32", "W": "*fp32", "BIAS": "*fp32", "AB": "*fp32", "n_parts": "i32",
                                   "eps": "fp32"}, dict(C=C, G=32, P=gn.MAX_PARTS), {})
    build(gn._residual_kernel, {"X": "*fp32", "H": "*fp32", "HBIAS": "*fp32", "Y": "*fp32", "n": "i32"},
          dict(C=C, BLOCK=4096), {})
    build(gn._upsample_kernel, {"X": "*fp32", "Y": "*fp32", "n_pix": "i32", "W": "i32"}, dict(C=C, BLOCK_P=block_p), {})
print("compiled")
"""


def test_group_norm_kernels_compile_for_sm90():
    """The decoder's widths (128, 256, 512 channels), with a bias and without: an H100/H200 cubin, no register
    spills."""
    sm90.run(AOT_SCRIPT)
