"""eager_ops_cuda's CUDA kernels (eager_ops_triton's without Triton): built for sm_90 with nvcc where it is installed (no GPU needed),
and on a GPU of compute capability 9.0 or later against the eager ops, RoPE and SiLU bit for bit, the norm within a
rounding (skipped without one: run there as `python -m pytest tests/test_eager_ops_cuda.py`)."""
import ctypes
import shutil

import pytest
import torch
import torch.nn.functional as F

import sm90

from fast_inference import plan
from fast_inference.kernels import eager_ops_cuda, nvrtc
from fast_inference.model import KVCache, rope_and_cache, rotations

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and nvrtc.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernels_build_for_sm90_without_spills():
    entries = [(f"k{i}", (op, f32)) for i, (op, f32) in enumerate((op, f) for op in eager_ops_cuda.KERNELS for f in (0, 1))]
    frames = sm90.nvcc_stack_frames(eager_ops_cuda.source(entries))
    assert frames == [0] * 6, frames


def test_args_match_the_kernels_structs():
    """eager_ops.cu's RopeArgs, SiluArgs and NormArgs are 152, 24 and 48 bytes (its static_assert); the ctypes mirrors
    must be too."""
    assert ctypes.sizeof(eager_ops_cuda.RopeArgs) == 152 and ctypes.sizeof(eager_ops_cuda.SiluArgs) == 24
    assert ctypes.sizeof(eager_ops_cuda.NormArgs) == 48


def test_not_built_where_they_cannot_run(monkeypatch):
    """Off a GPU, for float16, or where NVRTC refuses a kernel, they do not build (the plan keeps the eager ops)."""
    assert not eager_ops_cuda.builds("cpu", torch.bfloat16)
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    built = []
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: built.append(src()) or 1)
    assert not eager_ops_cuda.builds("cuda:0", torch.float16) and not built
    assert eager_ops_cuda.builds("cuda:0", torch.bfloat16) and len(built) == 3
    assert "rope_cache<0>(a)" in built[0] and "silu_mul<0>(a)" in built[1] and "rms_norm<0, 256, 16>(a)" in built[2]
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: None)  # NVRTC refused them
    assert not eager_ops_cuda.builds("cuda:0", torch.float32)


def test_the_plan_takes_them_where_triton_may_not_run():
    """The cudagraph backend (no Triton) takes these for the eager blocks, RMSNorm included; the inductor backend
    takes Triton's RoPE and SwiGLU, and in its prefill through the compiled block only Triton's RoPE (inductor traces
    it; it fuses the norm and SwiGLU itself; dynamo could not trace these kernels' ctypes launch)."""
    hopper = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16)
    cudagraph = plan.make(plan.Situation(backend="cudagraph", batch=3, **hopper))
    assert cudagraph.prefill_ops == cudagraph.eager == plan.EagerOps("cuda", "cuda", "cuda")
    assert cudagraph.step_ops == plan.EagerOps("cuda", "cuda", "attention")  # its attention rotates and writes
    inductor = plan.make(plan.Situation(backend="inductor", batch=9, **hopper))
    assert inductor.eager == plan.EagerOps("torch", "triton", "triton")
    assert inductor.prefill == "compiled_block" and inductor.prefill_ops == plan.EagerOps(rope="triton")
    refused = plan.make(plan.Situation(backend="cudagraph", builds=lambda kernel, *key: kernel != "eager_ops_cuda",
                                       **hopper))
    assert refused.prefill_ops == plan.EagerOps()


def same(a, b):
    return a.shape == b.shape and torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_match_the_eager_ops_bit_for_bit(dtype):
    """RoPE on q and k of one projection's split (strided views) with the cache write, at a decode step (one token,
    2 and 16 rows) and a prefill (37 tokens, positions not in order), and SiLU x up at those shapes: the eager ops'
    bits, signed zeros too, the cache's other positions and rows untouched."""
    g = torch.Generator().manual_seed(0)
    H, hd, L = 20, 64, 48
    for B, S in ((2, 1), (16, 1), (3, 37)):
        qkv = torch.randn(B, S, 3 * H * hd, generator=g).to("cuda", dtype)
        qkv[0, 0, :hd] = 0.0
        q, k, v = (t.view(B, S, H, hd) for t in qkv.split(H * hd, dim=-1))
        freqs = torch.randn(S, hd // 2, 2, generator=g).cuda()
        freqs[0, :4] = 0.0  # RoPE's zero rows (the text prefix)
        pos = torch.randperm(L, generator=g)[:S].cuda()
        caches = [KVCache(B + 1, H, L, hd, dtype).cuda() for _ in range(2)]
        for c in caches:
            c.k_cache.normal_(generator=torch.Generator("cuda").manual_seed(1))
            c.v_cache.normal_(generator=torch.Generator("cuda").manual_seed(2))
        want = rope_and_cache(q, k, v, rotations(freqs), caches[0], pos)
        assert eager_ops_cuda.builds(q.device, dtype)
        got = eager_ops_cuda.rope_and_cache(q, k, v, freqs, caches[1], pos)
        for w, o in zip(want, got):
            assert same(o, w), (B, S)
        assert same(caches[1].k_cache, caches[0].k_cache) and same(caches[1].v_cache, caches[0].v_cache)

        x = (torch.randn(B, S, 2 * 3584, generator=g) * 4).to("cuda", dtype)
        x[0, 0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 88.0, -88.0])
        gate, up = x.chunk(2, dim=-1)
        assert same(eager_ops_cuda.silu_mul(x), F.silu(gate) * up), (B, S)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_matches_the_eager_ops(dtype):
    """rms_norm after a residual add, at a decode step (2 and 16 rows) and a prefill (3 x 37), widths 1,280, 72 and
    MAX_D, against model.RMSNorm's eager ops: the sum bit for bit; the norm float32's to 1e-6 of the largest, bf16's
    a few bf16 steps off at most (its sum of squares added in another order can move the rounding of x rstd, which the
    weight scales), and rarely."""
    from fast_inference.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    for D in (1280, 72, eager_ops_cuda.MAX_D):
        norm = RMSNorm(D).to("cuda", dtype)
        norm.weight.data = (torch.randn(D, generator=g) + 1).to("cuda", dtype)
        for shape in ((2, 1, D), (16, 1, D), (3, 37, D)):
            x, delta = ((torch.randn(shape, generator=g) * 3).to("cuda", dtype) for _ in range(2))
            with torch.no_grad():
                h, want = x + delta, F.rms_norm(x + delta, (D,), eps=norm.eps) * norm.weight
                got_h, got = eager_ops_cuda.rms_norm(x, norm.weight, norm.eps, delta)
                alone = eager_ops_cuda.rms_norm(h, norm.weight, norm.eps)
            assert same(got_h, h) and same(alone, got), (D, shape)
            err = (got.float() - want.float()).abs()
            if dtype == torch.float32:
                assert err.max().item() <= 1e-6 * want.abs().max().item(), (D, shape)
            else:
                step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
                assert (err <= 3 * step).all() and (err > 0).float().mean().item() < 0.02, (D, shape)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_a_cuda_graph_replays_them():
    """SiLU x up captured once and replayed on new inputs; RoPE with the cache write at a position."""
    x = torch.randn(4, 2 * 256, device="cuda", dtype=torch.bfloat16)
    assert eager_ops_cuda.builds("cuda", torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = eager_ops_cuda.silu_mul(x)
    x.copy_(torch.randn(4, 2 * 256, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    gate, up = x.chunk(2, dim=-1)
    assert same(out, F.silu(gate) * up)
    q = k = v = torch.randn(1, 1, 2, 8, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(1, 2, 4, 8, torch.bfloat16).cuda()
    eager_ops_cuda.rope_and_cache(q, k, v, torch.randn(1, 4, 2, device="cuda"), cache, torch.tensor([2], device="cuda"))
    assert cache.v_cache[0, :, 2].equal(v[0, 0])


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_the_cudagraph_backends_eager_blocks_run_them(monkeypatch):
    """The cudagraph backend at 3 images under CFG (6 rows: past block_cuda's, the eager block): the prefill and every
    step's blocks rotate, write the cache, gate and norm with these kernels, captured (the steps' RoPE and cache write
    in attention_cuda's kernel: only the prefill's blocks call rope_and_cache, eagerly and in its capture), and the
    teacher-forced logits are the reference's (plain torch) within a few bf16 roundings of the largest."""
    from fast_inference.engine import Engine
    from fast_inference.generate import generate
    from test_reference import cuda_tiny

    launched = []
    for name in ("rope_and_cache", "silu_mul", "rms_norm"):
        fn = getattr(eager_ops_cuda, name)
        monkeypatch.setattr(eager_ops_cuda, name, lambda *a, fn=fn, name=name: launched.append((name, a[0])) or fn(*a))
    model, cond, mask, condition, forced = cuda_tiny(B=3, seed=4)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, forced=forced)
    engine = Engine(model, backend="cudagraph")
    for image in range(2):  # the prefill eager, then captured
        launched.clear()
        _, got = engine.generate(cond, 12, **kw)
        ropes = [q.shape[1] for name, q in launched if name == "rope_and_cache"]  # its tokens per row
        assert engine.runner.plan.block == "model" and len(ropes) >= len(model.layers) and min(ropes) > 1, ropes
        names = [name for name, _ in launched]
        assert names.count("rms_norm") >= 2 * (2 * 2 + 1), names  # two a block and the head's
    _, want = generate(model, cond, 12, return_logits=True, **kw)
    for i, (w, g) in enumerate(zip(want, got)):
        w = w if w.shape == g.shape else w.chunk(2)[0]
        assert (g.float() - w.float()).abs().max().item() <= 3e-2 * w.abs().max().item(), i
