"""The VQ decoder's GroupNorm + SiLU kernels (fast_inference/group_norm.py) against torch's GroupNorm, in Triton's
CPU interpreter (TRITON_INTERPRET=1), and compiled ahead of time for sm_90."""
import subprocess
import sys

import pytest
import torch

import interpret
import sm90
from fast_inference import group_norm

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import torch.nn.functional as F
from fast_inference import group_norm

torch.manual_seed(0)
checked = 0
# one group's pixels over several programs and a partial last tile; a mean 300 times the spread (the shift: float32
# sums of x and x squared are off by 0.17 there, torch's own float32 GroupNorm by 1.4e-4, as a x + b rounds);
# 4 to 16 channels a group, as the decoder's 128 to 512 channels have
for B, C, H, W, G, scale, mean, silu in ((1, 128, 24, 20, 32, 3.0, 5.0, True), (2, 64, 9, 7, 32, 1.0, 0.0, False),
                                         (1, 512, 8, 8, 32, 1.0, -2.0, True), (2, 128, 31, 33, 32, 1.0, 300.0, False)):
    x = torch.randn(B, C, H, W) * torch.rand(B, C, 1, 1) * scale + mean + torch.randn(B, C, 1, 1) * scale
    x = x.contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(C), torch.randn(C)
    want = F.group_norm(x.double(), G, w.double(), b.double(), 1e-6)
    want = (F.silu(want) if silu else want).float()
    got = group_norm.group_norm(x, G, w, b, 1e-6, silu)
    assert got.is_contiguous(memory_format=torch.channels_last) and got.shape == x.shape
    err = (got - want).abs().max().item()
    assert err < 2e-5 * max(1.0, abs(mean) / scale), (B, C, H, W, err)
    checked += 1
print("ok", checked)
"""


def test_group_norm_matches_torch_in_interpreter():
    """Against torch's GroupNorm in float64 (then SiLU), to float32's rounding: images over several programs each
    and with a partial last tile, 64 to 512 channels, and a mean 300 times the spread, whose variance plain float32
    sums of x and x squared lose to cancellation."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=interpret.ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["ok", "4"], out.stdout


def test_supported_only_channels_last_float32_on_cuda():
    x = torch.zeros(1, 128, 4, 4).contiguous(memory_format=torch.channels_last)
    assert not group_norm.supported(x, 32)  # on the CPU the eager path runs
    meta = x.to("meta")
    assert group_norm.supported(meta, 32) == (group_norm.triton is not None and meta.is_cuda)


AOT_SCRIPT = r"""
from fast_inference import group_norm as gn
from sm90 import build

for C in (128, 256, 512):
    block_p = 4096 // C
    build(gn._partials_kernel, {"X": "*fp32", "PARTS": "*fp32", "HW": "i32", "per_prog": "i32"},
          dict(C=C, G=32, BLOCK_P=block_p), {})
    build(gn._scale_shift_kernel, {"PARTS": "*fp32", "W": "*fp32", "BIAS": "*fp32", "AB": "*fp32", "n_parts": "i32",
                                   "eps": "fp32"}, dict(C=C, G=32, P=128), {})
    for silu in (True, False):
        build(gn._apply_kernel, {"X": "*fp32", "AB": "*fp32", "Y": "*fp32", "HW": "i32"},
              dict(C=C, BLOCK_P=block_p, SILU=silu), {})
print("compiled")
"""


def test_group_norm_kernels_compile_for_sm90():
    """The decoder's widths (128, 256, 512 channels): an H100/H200 cubin, no register spills."""
    sm90.run(AOT_SCRIPT)
