"""smem_gemv's CUDA kernels: built for sm_90 with nvcc where it is installed (no GPU needed), and on a GPU of compute
capability 9.0 or later against decode_block's Triton kernels, which compute the same roundings (skipped without
one: run there as `python -m pytest tests/test_smem_gemv.py`)."""
import ctypes
import shutil

import pytest
import torch

import sm90

from fast_inference import cuda_draw, cuda_inputs, decode_block, pdl, smem_attention, smem_gemv
from fast_inference.model import ModelArgs, TransformerBlock

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and smem_gemv.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernels_build_for_sm90_without_spills():
    """The entries the engine uses at 1-4 rows for GPT-XL (K = 1,280 and 3,584), each PDL mode, as NVRTC gets
    them; ptxas reports no stack frame."""
    entries = [(smem_gemv.KINDS[kind], k, *smem_gemv.CONFIG[name], rows, pdl)
               for kind, k, name in (("qkv", 1280, "qkv"), ("linear", 1280, "wo"), ("gate_up", 1280, "gate_up"),
                                     ("linear", 3584, "w2"), ("linear_add", 3584, "w2"))
               for rows in (1, 2, 3, 4) for pdl in (0, smem_gemv.PDL, smem_gemv.FIRST)]
    frames = sm90.nvcc_stack_frames(smem_gemv.source([(f"k{i}", e) for i, e in enumerate(entries)]))
    assert len(frames) == len(entries) and not any(frames), frames


def test_args_match_the_kernels_struct():
    """smem_gemv.cu's Args is 128 bytes (its static_assert); the launcher's ctypes mirror must be too."""
    assert ctypes.sizeof(smem_gemv.Args) == 128


def test_a_kernel_that_cannot_be_built_leaves_the_triton_kernels(monkeypatch):
    """NVRTC or the driver refusing a kernel (here NVRTC, or no driver at all on a CPU machine) marks the device
    unavailable rather than failing the step: decode_block then runs its Triton kernels."""
    monkeypatch.setattr(smem_gemv, "_kernels", {})
    monkeypatch.setattr(smem_gemv, "_available", {0: True})

    def refuse(src, arch, file):
        raise RuntimeError("smem_gemv: NVRTC failed: refused by the test")

    monkeypatch.setattr(smem_gemv, "_cubin", refuse)
    entry = (smem_gemv.KINDS["gate_up"], 1280, *smem_gemv.CONFIG["gate_up"], 2, smem_gemv.PDL)
    assert smem_gemv._kernel(torch.device("cuda", 0), entry) is None
    assert smem_gemv._available == {0: False} and not smem_gemv._kernels


@pytest.mark.parametrize("dim, kernels", [(1280, ("gate_up",)), (2048, ())])
def test_the_log_names_only_projections_whose_weights_fit(monkeypatch, dim, kernels):
    """GPT-XL's gate/up runs here; GPT-1B's (K = 2,048) would ask for more shared memory than a program may have, so
    it is left to Triton rather than refused by the driver (which marks the device unavailable), and the engine's log
    does not name it."""
    monkeypatch.setattr(smem_gemv, "_available", {0: True})
    with torch.device("meta"):
        layer = TransformerBlock(ModelArgs(dim=dim, n_head=dim // 64))
        layer.feed_forward.fuse()
    assert smem_gemv.used(2, torch.bfloat16, "cuda:0", layer) == kernels


def _built():
    """The entries of the projection kernels built so far (smem_gemv._kernels holds them by name)."""
    return [tuple(map(int, name.split("_")[2:])) for _, name in smem_gemv._kernels if name.startswith("smem_gemv_")]


def _close(got, want):
    """Within one bf16 rounding: the float32 sums are added in another order."""
    diff = (got.float() - want.float()).abs()
    assert diff.max() <= 2 ** -7 * want.float().abs().max() + 1e-6, diff.max()
    assert (diff > 0).float().mean() < 0.02


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_projections_match_the_triton_kernels(rows):
    torch.manual_seed(rows)
    D, F, H = 1280, 3584, 20
    dev, bf = "cuda", torch.bfloat16
    norm = torch.nn.RMSNorm(D, eps=1e-5).to(dev, bf)
    norm.weight.data.normal_(1, 0.1)
    x = torch.randn(rows, D, device=dev, dtype=bf)
    wqkv, wo = torch.randn(3 * D, D, device=dev, dtype=bf) * 0.03, torch.randn(D, D, device=dev, dtype=bf) * 0.03
    w13, w2 = torch.randn(2 * F, D, device=dev, dtype=bf) * 0.03, torch.randn(D, F, device=dev, dtype=bf) * 0.03
    a, then = torch.randn(rows, F, device=dev, dtype=bf), torch.randn(rows, D, device=dev, dtype=bf)
    freqs = torch.randn(D // H // 2, 2, device=dev)
    pos = torch.tensor([37], device=dev)
    caches = [torch.zeros(rows, H, 64, D // H, device=dev, dtype=bf) for _ in range(4)]

    def run(enabled):  # all four projections here, not only smem_gemv.KERNELS
        saved = smem_gemv.ENABLED, smem_gemv.KERNELS
        smem_gemv.ENABLED, smem_gemv.KERNELS = enabled, ("qkv", "wo", "gate_up", "w2")
        try:
            q = decode_block.qkv_rope(x, norm, wqkv, None, freqs, pos, *caches[2 * enabled:2 * enabled + 2], H,
                                      pdl=decode_block.FIRST)
            return (q, decode_block.linear(x, wo, residual=x, name="wo", pdl=decode_block.FIRST),
                    decode_block.gate_up(x, norm, w13, pdl=decode_block.FIRST),
                    decode_block.linear(a, w2, residual=x, name="w2", pdl=decode_block.FIRST, then=then))
        finally:
            smem_gemv.ENABLED, smem_gemv.KERNELS = saved

    want, got = run(False), run(True)
    kinds = {entry[0] for entry in _built() if entry[4] == rows}
    assert kinds == set(smem_gemv.KINDS.values()), kinds  # each ran here, not Triton's in its place
    for g, w in zip(got, want):
        _close(g, w)
    _close(caches[2][:, :, 37], caches[0][:, :, 37])  # the step's key and value
    _close(caches[3][:, :, 37], caches[1][:, :, 37])
    assert not caches[2][:, :, :37].any() and not caches[2][:, :, 38:].any()


def test_the_cudagraph_block_is_all_four_kernels_or_none(monkeypatch):
    """builds_block, asked before the cudagraph backend captures a step: GPT-XL's bf16 block at 2 rows (CFG) and 1
    (after cfg_interval), and 4 (n = 2), builds its five kernels per row count (w2 with and without the control rows)
    then; one that NVRTC refuses, float32 weights, more rows than the GEMV path's or no fused gate/up leave the eager
    block."""
    monkeypatch.setattr(smem_gemv, "_available", {0: True})
    built = []
    monkeypatch.setattr(smem_gemv, "_kernel", lambda device, entry: built.append(entry) or object())
    with torch.device("meta"):
        layer = TransformerBlock(ModelArgs(dim=1280, n_head=20)).to(torch.bfloat16)
        unfused = TransformerBlock(ModelArgs(dim=1280, n_head=20)).to(torch.bfloat16)
        fp32 = TransformerBlock(ModelArgs(dim=1280, n_head=20))
    for block in (layer, fp32):
        block.feed_forward.fuse()
    assert smem_gemv.builds_block(layer, {2, 1, 4}, "cuda:0")
    kinds = {(kind, k, rows, pdl) for kind, k, _, _, rows, pdl in built}
    # PDL's FIRST launch up to ALL_FIRST_ROWS rows (n = 1 under CFG), EARLY past them
    mode = lambda rows: pdl.FIRST if rows <= smem_gemv.ALL_FIRST_ROWS else smem_gemv.PDL
    want = {(smem_gemv.KINDS[kind], k, rows, mode(rows)) for rows in (1, 2, 4) for kind, k in
            (("qkv", 1280), ("linear", 1280), ("gate_up", 1280), ("linear", 3584), ("linear_add", 3584))}
    assert len(built) == 15 and kinds == want, built
    assert smem_gemv.ALL_FIRST_ROWS == 2 and smem_gemv.PDL == pdl.EARLY
    assert not smem_gemv.builds_block(layer, {8}, "cuda:0")
    assert not smem_gemv.builds_block(fp32, {2}, "cuda:0") and not smem_gemv.builds_block(unfused, {2}, "cuda:0")
    refused = smem_gemv.KINDS["linear_add"]
    monkeypatch.setattr(smem_gemv, "_kernel", lambda device, entry: None if entry[0] == refused else object())
    assert not smem_gemv.builds_block(layer, {2}, "cuda:0")


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_the_cudagraph_backend_runs_its_blocks_here(monkeypatch):
    """The cudagraph backend at GPT-XL's widths (2 layers, bf16, one image under CFG and, after cfg_interval, without):
    every projection of every step as these kernels, the attention as smem_attention's, the draw and the inputs as
    cuda_draw's and cuda_inputs', none of decode_block's Triton kernels (unreachable here), and
    teacher-forced logits as with the eager block and SDPA, within a few bf16 roundings of the largest."""
    from fast_inference import fused_ops
    from fast_inference.engine import Engine
    from test_reference import cuda_tiny

    monkeypatch.setattr(fused_ops, "ENABLED", False)  # the cudagraph backend's setting (fast_engine, bench.py)
    model, cond, mask, condition, forced = cuda_tiny(B=1, seed=3)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=6, forced=forced)

    def logits(here):
        monkeypatch.setattr(smem_gemv, "ENABLED", here)
        monkeypatch.setattr(smem_attention, "ENABLED", here)  # else the eager block takes it too (since #78)
        if here:
            monkeypatch.setattr(decode_block, "triton", None)  # a Triton kernel's launch would fail
        engine = Engine(model, backend="cudagraph")
        _, out = engine.generate(cond, 12, **kw)
        fn = engine.sampler.block_fn
        assert (fn is not None and fn.keywords == dict(kernels=smem_gemv.ALL)) == here, fn
        # and smem_attention's decode attention between them, no cache windows (SDPA's), the text as one partial
        attention = engine.sampler.decode_attention
        assert (attention is smem_attention.decode_attention) == here, attention
        assert (len(engine.sampler.kv_lens) == 1) == here and (engine.sampler.cache.text_len > 0) == here
        # the draw and the step's inputs in CUDA C++ too, in either arm
        assert engine.sampler.draw_fn is cuda_draw.draw and engine.sampler.inputs_fn is cuda_inputs.step_inputs
        return torch.cat([l[:1].float() for l in out])  # the conditional row

    want = logits(False)
    monkeypatch.setattr(smem_gemv, "_kernels", {})  # built here, not by an earlier test
    got = logits(True)
    kinds = {entry[0] for entry in _built()}
    assert kinds == set(smem_gemv.KINDS.values()), kinds
    rel = (got - want).abs().max().item() / want.abs().max().item()
    assert rel < 3e-2, rel
