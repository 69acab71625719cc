"""inputs_cuda's CUDA kernel: built for sm_90 with nvcc where it is installed (no GPU needed), and on a GPU of compute
capability 9.0 or later bit for bit against the model's ops (skipped without one: run there as `python -m pytest
tests/test_inputs_cuda.py`)."""
import ctypes
import shutil

import pytest
import torch

import sm90

from fast_inference.kernels import inputs_cuda, nvrtc
from test_reference import tiny_model

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and nvrtc.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernel_builds_for_sm90_without_spills():
    frames = sm90.nvcc_stack_frames(inputs_cuda.source([("k0", 0), ("k1", 1)]))
    assert frames == [0, 0], frames


def test_args_match_the_kernels_struct():
    """inputs.cu's Args is 112 bytes (its static_assert); the launcher's ctypes mirror must be too."""
    assert ctypes.sizeof(inputs_cuda.Args) == 112


def test_not_built_where_it_cannot_run(monkeypatch):
    """Off a GPU with NVRTC, or where NVRTC refuses it, it does not build (the plan then keeps the model's ops); else
    the kernel of the embeddings' dtype is built at once."""
    assert not inputs_cuda.builds("cpu", torch.bfloat16)
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    built = []
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: built.append(src()) or 1)
    assert inputs_cuda.builds("cuda:0", torch.bfloat16) and "inputs<0>" in built[0]
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: None)  # NVRTC refused it
    assert not inputs_cuda.builds("cuda:0", torch.bfloat16)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 320])
def test_matches_the_models_ops(dtype, dim):
    """x, the RoPE row and the later control rows bit for bit (signed zeros too) as the model's ops make them: guided
    and not, 1-3 images, a padded batch's larger buffer, positions before, at, through and past the control tokens; a
    row in one program and in two (the second partly past the row's end: 320 = 256 + 64)."""
    same = lambda a, b: a.shape == b.shape and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
    model = tiny_model(cls=8, seed=3, vocab_size=512, n_layer=2, dim=dim, n_head=dim // 32).to("cuda", dtype)
    model.setup_caches(8, 24, dtype)  # the RoPE table in float32, as the engine's runner leaves it
    assert inputs_cuda.builds("cuda", dtype)
    D, Nc = model.args.dim, 10
    g = torch.Generator().manual_seed(0)
    for batch, guided in ((1, True), (3, True), (2, False)):
        R = 2 * batch if guided else batch
        controls = torch.randn(3, 2 * batch + 2, Nc, D, generator=g).to("cuda", dtype)
        controls[:, :, 0] = -controls[:, :, 0].abs()  # negative rows, whose multiply by 0 is -0.0
        used = controls if guided else controls[:, :batch]  # as the runner's guided and conditional steps pass them
        token = torch.randint(0, model.args.vocab_size, (batch, 1), generator=g).cuda()
        emb = model.tok_embeddings(torch.cat([token, token]) if guided else token)
        for pos in (0, 6, 7, 8, 16, 17, 23):
            p = torch.tensor([pos], device="cuda")
            x, (freqs, picked) = inputs_cuda.step_inputs(model, token, p, used, guided)
            want_freqs, want = model.step_inputs(p, used[:, :R])
            assert same(x, emb + want[0]), (batch, guided, pos)
            assert same(freqs, want_freqs) and picked[0] is None and len(picked) == 3
            assert all(same(a, b) for a, b in zip(picked[1:], want[1:])), (batch, guided, pos)
