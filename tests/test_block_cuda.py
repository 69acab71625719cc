"""block_cuda's CUDA kernels: built for sm_90 with nvcc where it is installed (no GPU needed), and on a GPU of compute
capability 9.0 or later against block_triton's kernels, which compute the same roundings (skipped without
one: run there as `python -m pytest tests/test_block_cuda.py`)."""
import ctypes
import shutil

import pytest
import torch

import sm90

from fast_inference import plan
from fast_inference.kernels import attention_cuda, block_cuda, block_triton, draw_cuda, inputs_cuda, nvrtc

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and nvrtc.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernels_build_for_sm90_without_spills():
    """The entries the engine uses at 1-4 rows for GPT-XL (K = 1,280 and 3,584), each PDL mode, as NVRTC gets
    them; ptxas reports no stack frame."""
    entries = [block_cuda.entry(name, k, rows, pdl, add)
               for name, k, add in (("qkv", 1280, False), ("wo", 1280, False), ("gate_up", 1280, False),
                                    ("w2", 3584, False), ("w2", 3584, True))
               for rows in (1, 2, 3, 4) for pdl in (0, plan.EARLY, plan.FIRST)]
    frames = sm90.nvcc_stack_frames(block_cuda.source([(f"k{i}", e) for i, e in enumerate(entries)]))
    assert len(frames) == len(entries) and not any(frames), frames


def test_args_match_the_kernels_struct():
    """block.cu's Args is 128 bytes (its static_assert); the launcher's ctypes mirror must be too."""
    assert ctypes.sizeof(block_cuda.Args) == 128


def test_a_kernel_that_cannot_be_built_is_refused_once(monkeypatch):
    """NVRTC or the driver refusing a kernel (here NVRTC) makes `builds` say no, which the plan asks before it takes
    the kernel: block_triton's kernel runs there instead. The refusal is kept, not tried again per shape."""
    monkeypatch.setattr(nvrtc, "_kernels", {})
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    monkeypatch.setattr(nvrtc, "_driver", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: __import__("contextlib").nullcontext())
    tries = []

    def refuse(src, arch, names, smem, file):
        tries.append(file)
        raise RuntimeError("nvrtc: NVRTC failed: refused by the test")

    monkeypatch.setattr(nvrtc, "functions", refuse)
    entry = block_cuda.entry("gate_up", 1280, 2, plan.EARLY)
    assert not block_cuda.builds(torch.device("cuda", 0), entry) and not block_cuda.builds("cuda:0", entry)
    assert tries == ["block.cu"]
    s = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16,
                       builds=lambda kernel, *key: block_cuda.builds("cuda:0", *key))
    assert plan.make(s).guided.projection("gate_up") == plan.Projection("triton_gemv", plan.FIRST)


@pytest.mark.parametrize("dim, fits", [(1280, True), (2048, False)])
def test_only_projections_whose_weights_fit_run_here(dim, fits):
    """GPT-XL's gate/up runs here; GPT-1B's (K = 2,048) would ask for more shared memory than a program may have, so
    the plan leaves it to Triton rather than have the driver refuse it."""
    s = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, dim=dim, n_head=dim // 64,
                       ffn_hidden=plan.Situation().ffn_hidden if dim == 1280 else 5632)
    assert block_cuda.fits("gate_up", 2, dim, s.ffn_hidden) == fits
    assert (plan.make(s).guided.projection("gate_up").impl == "cuda") == fits


def _built():
    """The entries of the projection kernels built so far (nvrtc._kernels holds them by name)."""
    return [tuple(map(int, name.split("_")[2:])) for _, name in nvrtc._kernels if name.startswith("block_cuda_")]


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
    first = plan.FIRST
    for e in (block_cuda.entry(n, k, rows, first, add) for n, k, add in
              (("qkv", D, False), ("wo", D, False), ("gate_up", D, False), ("w2", F, True))):
        assert block_cuda.builds(dev, e)
    want = (block_triton.qkv_rope(x, norm, wqkv, None, freqs, pos, *caches[:2], H, pdl=first),
            block_triton.linear(x, wo, residual=x, name="wo", pdl=first),
            block_triton.gate_up(x, norm, w13, pdl=first),
            block_triton.linear(a, w2, residual=x, name="w2", pdl=first, then=then))
    got = (block_cuda.qkv_rope(x, norm, wqkv, freqs, pos, *caches[2:], H, first),
           block_cuda.linear(x, wo, x, "wo", first), block_cuda.gate_up(x, norm, w13, first),
           block_cuda.linear(a, w2, x, "w2", first, then=then))
    for g, w in zip(got, want):
        _close(g, w)
    _close(caches[2][:, :, 37], caches[0][:, :, 37])  # the step's key and value
    _close(caches[3][:, :, 37], caches[1][:, :, 37])
    assert not caches[2][:, :, :37].any() and not caches[2][:, :, 38:].any()


def test_the_cudagraph_block_is_all_four_kernels_or_none():
    """The cudagraph backend's plan for GPT-XL's bf16 block at 2 rows (CFG) and 1 (after cfg_interval), and 4 (n = 2):
    its five kernels per row count (w2 with and without the control rows) built first, FIRST up to CUDA_FIRST_ROWS
    rows, EARLY past them; one that NVRTC refuses, float32 weights or more rows than the GEMV path's leave the eager
    block."""
    built = []
    hopper = dict(backend="cudagraph", device="cuda", capability=(9, 0), dtype=torch.bfloat16)
    s = plan.Situation(batch=1, builds=lambda kernel, *key: kernel != "block_cuda" or built.append(key[0]) or True,
                       **hopper)
    p = plan.make(s)
    assert p.block == "fused" and p.cuda_block
    assert p.guided.projections == tuple((n, plan.Projection("cuda", plan.FIRST)) for n in plan.PROJECTIONS)
    mode = lambda rows: plan.FIRST if rows <= plan.CUDA_FIRST_ROWS else plan.EARLY
    want = {block_cuda.entry(n, k, rows, mode(rows), add) for rows in (1, 2) for n, k, add in
            (("qkv", 1280, False), ("wo", 1280, False), ("gate_up", 1280, False), ("w2", 3584, False),
             ("w2", 3584, True))}
    assert set(built) == want, set(built) ^ want
    assert plan.CUDA_FIRST_ROWS == 2
    p4 = plan.make(plan.Situation(batch=2, **hopper))
    assert {proj.pdl for _, proj in p4.guided.projections} == {plan.EARLY}
    assert plan.make(plan.Situation(batch=4, **hopper)).block == "model"
    assert plan.make(plan.Situation(**dict(hopper, dtype=torch.float32))).block == "model"
    refused = block_cuda.KINDS["linear_add"]
    s = plan.Situation(builds=lambda kernel, *key: kernel != "block_cuda" or key[0][0] != refused, **hopper)
    assert plan.make(s).block == "model"


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_the_cudagraph_backend_runs_its_blocks_here(monkeypatch):
    """The cudagraph backend at GPT-XL's widths (2 layers, bf16, one image under CFG and, after cfg_interval, without):
    every projection of every step as these kernels, the attention as attention_cuda's, the draw and the inputs as
    draw_cuda's and inputs_cuda's, none of block_triton's kernels (unreachable here), and teacher-forced logits as
    with the eager block and SDPA (cuda_projections=none, attention=sdpa), within a few bf16 roundings of the
    largest."""
    from fast_inference.engine import Engine
    from test_reference import cuda_tiny

    model, cond, mask, condition, forced = cuda_tiny(B=1, seed=3)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=6, forced=forced)

    def logits(here):
        if here:
            monkeypatch.setattr(block_triton, "triton", None)  # a Triton kernel's launch would fail
        engine = Engine(model, backend="cudagraph", overrides=() if here else ("cuda_projections=none",
                                                                               "attention=sdpa"))
        _, out = engine.generate(cond, 12, **kw)
        r = engine.runner
        assert (r.plan.block, r.plan.cuda_block) == (("fused", True) if here else ("model", False))
        # and attention_cuda's decode attention between them, no cache windows (SDPA's), the text as one partial
        attention = r.contexts[True].attention
        assert (getattr(attention, "func", None) is attention_cuda.decode_attention) == here, attention
        assert (len(r.kv_lens) == 1) == here and (r.cache.text is not None) == here
        # the draw and the step's inputs in CUDA C++ too, in either arm
        assert r.draw_fn is draw_cuda.draw and r.inputs_fn is inputs_cuda.step_inputs
        return torch.cat([l[:1].float() for l in out])  # the conditional row

    want = logits(False)
    monkeypatch.setattr(nvrtc, "_kernels", {})  # built here, not by an earlier test
    got = logits(True)
    kinds = {entry[0] for entry in _built()}
    assert kinds == set(block_cuda.KINDS.values()), kinds
    rel = (got - want).abs().max().item() / want.abs().max().item()
    assert rel < 3e-2, rel
