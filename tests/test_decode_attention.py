"""The split-KV Triton decode kernel (one tile per span and several, with the online softmax) against SDPA with the model's mask rule, in Triton's CPU
interpreter (TRITON_INTERPRET=1), so CI checks the kernel the GPU engine runs."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import torch
from fast_inference.decode_attention import decode_attention
from fast_inference.model import attention_mask

torch.manual_seed(0)
worst = 0.0
cases = [(2, 3, 40, 30, (16, 16)), (3, 2, 48, 47, (32, 16)), (2, 2, 40, 9, (32, 32)), (1, 2, 24, 3, (128, 128)),
         (2, 2, 72, 70, (64, 16)), (2, 2, 72, 5, (64, 16))]
for R, H, L, pos, (split, block) in cases:
    q = torch.randn(R, H, 1, 64)
    k = torch.randn(R, H, L, 64)
    v = torch.randn(R, H, L, 64)
    key_valid = torch.ones(R, L, dtype=torch.bool)
    key_valid[:, :8] = torch.rand(R, 8) > 0.5
    key_valid[0, :8] = False  # a row whose text is all padding
    p = torch.tensor([pos])
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask(key_valid, p))
    got = decode_attention(q, k, v, key_valid, p, config=(split, block, 4))
    worst = max(worst, (got - want).abs().max().item())
print(worst)
"""


def test_kernel_matches_sdpa_in_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=root)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) < 1e-5
