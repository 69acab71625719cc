"""A decode step's inputs in one kernel (kernels/inputs_triton.py) against the model's ops, in
Triton's CPU interpreter (TRITON_INTERPRET=1), and compiled ahead of time for sm_90."""
import subprocess
import sys

import pytest

import interpret
import sm90

pytest.importorskip("triton")

SCRIPT = r"""
import torch
import triton.language as tl
from triton.runtime import interpreter
from fast_inference.kernels import inputs_triton
from test_reference import tiny_model

# The interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even (as torch does):
# give it the GPU's rounding, so the bfloat16 case can be compared bit for bit.
truncating = interpreter.InterpreterBuilder.cast_impl


def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = torch.from_numpy(src.data.copy()).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(bits.view("uint16"), tl.bfloat16)
    return truncating(self, src, dst_type)


interpreter.InterpreterBuilder.cast_impl = cast_impl

same = lambda a, b: a.shape == b.shape and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
checked = 0
for dtype in (torch.float32, torch.bfloat16):
    model = tiny_model(cls=8, seed=3, vocab_size=512, n_layer=2).to(dtype)
    D, Nc = model.args.dim, 10  # fewer control tokens than the RoPE grid has cells: positions past them
    g = torch.Generator().manual_seed(0)
    for batch, guided in ((1, True), (3, True), (2, False)):
        R = 2 * batch if guided else batch
        # more rows than the step uses (a padded batch's buffer); negative rows, whose multiply by 0 is -0.0
        controls = torch.randn(3, 2 * batch + 2, Nc, D, generator=g).to(dtype)
        controls[:, :, 0] = -controls[:, :, 0].abs()
        used = controls if guided else controls[:, :batch]  # as Sampler.step / step_conditional pass them
        token = torch.randint(0, model.args.vocab_size, (batch, 1), generator=g)
        emb = model.tok_embeddings(torch.cat([token, token]) if guided else token)
        # before the first control token, just before it, at it, the next, the last, past it, the grid's end
        for pos in (0, 6, 7, 8, 16, 17, 23):
            p = torch.tensor([pos])
            x, (freqs, picked) = inputs_triton.step_inputs(model, token, p, used, guided)
            want_freqs, want = model.step_inputs(p, used[:, :R])
            assert same(x, emb + want[0]), (dtype, batch, guided, pos)
            assert same(freqs, want_freqs) and picked[0] is None and len(picked) == 3
            assert all(same(a, b) for a, b in zip(picked[1:], want[1:])), (dtype, batch, guided, pos)
            checked += 1
print("ok", checked)
"""


def test_step_inputs_match_model_in_interpreter():
    """Embeddings plus the first control row, the RoPE row and the other control rows bit for bit (signed
    zeros included) as the model's ops: float32 and bfloat16, with CFG (1 and 3 images) and without (the
    conditional half of a larger controls buffer), at positions before, at, inside and past the control tokens."""
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=interpret.ENV, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["ok", "42"], out.stdout


WINDOW_SCRIPT = SCRIPT[: SCRIPT.index("same = lambda")] + r"""
same = lambda a, b: a.shape == b.shape and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
checked = 0
for dtype in (torch.float32, torch.bfloat16):
    model = tiny_model(cls=8, seed=3, vocab_size=512, n_layer=2).to(dtype)
    D, Nc = model.args.dim, 10
    g = torch.Generator().manual_seed(1)
    # a server's step (L = 1, each row its own position, no CFG duplication), Jacobi passes of 4 and 16 under CFG
    for batch, L, guided in ((3, 1, False), (2, 4, True), (1, 16, True)):
        R = 2 * batch if guided else batch
        controls = torch.randn(3, R + 2, Nc, D, generator=g).to(dtype)
        controls[:, :, 0] = -controls[:, :, 0].abs()
        tokens = torch.randint(0, model.args.vocab_size, (batch, L), generator=g)
        # ragged: each image from its own start, before, at and past the control tokens, clamped at the grid's end
        start = torch.randint(6, 20, (batch, 1), generator=g)
        positions = (start + torch.arange(L)).clamp(max=model.freqs_cis.shape[0] - 1)
        x, (freqs, picked) = inputs_triton.window_inputs(model, tokens, positions, controls, guided)
        rows = lambda t: torch.cat([t, t]) if guided else t
        want_freqs, want = model.step_inputs(rows(positions), controls[:, :R])
        assert same(x, model.tok_embeddings(rows(tokens)) + want[0]), (dtype, batch, L)
        assert same(freqs, want_freqs) and picked[0] is None and len(picked) == 3
        assert all(same(a, b) for a, b in zip(picked[1:], want[1:])), (dtype, batch, L)
        # a planted off-by-one: each image one position on gives other rows
        x1, (freqs1, _) = inputs_triton.window_inputs(model, tokens, positions + 1, controls, guided)
        assert not (same(freqs1, want_freqs) or same(x1, x))
        checked += 1
print("ok", checked)
"""


def test_window_inputs_match_model_in_interpreter():
    """Rows at their own positions, L queries each (the server's step, Jacobi passes under CFG): embeddings plus the
    first control row, the RoPE rows and the other control rows bit for bit as the model's ops with per-row
    positions, float32 and bfloat16; positions one on give other inputs."""
    out = subprocess.run([sys.executable, "-c", WINDOW_SCRIPT], env=interpret.ENV, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["ok", "6"], out.stdout


AOT_SCRIPT = r"""
import triton
from fast_inference.kernels import inputs_triton as di
from sm90 import build

for dt, D, hd in (("*bf16", 1280, 64), ("*fp32", 1280, 64), ("*bf16", 4096, 128)):
    sig = {"TOKEN": "*i64", "POS": "*i64", "EMB": dt, "CONTROLS": dt, "FREQS_TABLE": "*fp32", "X": dt,
           "FREQS": "*fp32", "PICKED": dt, "batch": "i32", "n_controls": "i32", "stride_cl": "i32",
           "stride_cr": "i32", "stride_cn": "i32", "cls_token_num": "i32", "window": "i32"}
    build(di._inputs_kernel, sig, dict(D=D, DP=triton.next_power_of_2(D), F=hd, FP=hd, LISTS=3, PDL=True, OWN=False),
          {"launch_pdl": True})
    build(di._inputs_kernel, sig, dict(D=D, DP=triton.next_power_of_2(D), F=hd, FP=hd, LISTS=3,
                                                            PDL=False, OWN=True), {})
print("compiled")
"""


def test_inputs_kernel_compiles_for_sm90():
    """GPT-XL in bf16 and float32 and GPT-7B's width, with PDL, and the window form (rows at their own positions):
    an H100/H200 cubin, no register spills."""
    sm90.run(AOT_SCRIPT)
