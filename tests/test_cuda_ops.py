"""cuda_ops' CUDA kernels (fused_ops' without Triton): built for sm_90 with nvcc where it is installed (no GPU needed),
and on a GPU of compute capability 9.0 or later against the eager ops, RoPE and SiLU bit for bit, the norm within a
rounding (skipped without one: run there as `python -m pytest tests/test_cuda_ops.py`)."""
import ctypes
import shutil
import types

import pytest
import torch
import torch.nn.functional as F

import sm90

from fast_inference import cuda_ops, fused_ops, smem_gemv
from fast_inference.model import KVCache, rope_and_cache, rotations

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and smem_gemv.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernels_build_for_sm90_without_spills():
    entries = [(f"k{i}", (op, f32)) for i, (op, f32) in enumerate((op, f) for op in cuda_ops.KERNELS for f in (0, 1))]
    frames = sm90.nvcc_stack_frames(cuda_ops.source(entries))
    assert frames == [0] * 6, frames


def test_args_match_the_kernels_structs():
    """cuda_ops.cu's RopeArgs, SiluArgs and NormArgs are 152, 24 and 48 bytes (its static_assert); the ctypes mirrors
    must be too."""
    assert ctypes.sizeof(cuda_ops.RopeArgs) == 152 and ctypes.sizeof(cuda_ops.SiluArgs) == 24
    assert ctypes.sizeof(cuda_ops.NormArgs) == 48


def test_not_built_where_they_cannot_run(monkeypatch):
    """Off a GPU, for float16, with FAST_CUDA_OPS=0 or where NVRTC refuses a kernel, the eager ops stay."""
    assert not cuda_ops.builds("cpu", torch.bfloat16) and not fused_ops.fuses(torch.zeros(2, dtype=torch.bfloat16))
    monkeypatch.setattr(smem_gemv, "_available", {0: True})
    monkeypatch.setattr(cuda_ops, "_builds", {})
    built = []
    monkeypatch.setattr(smem_gemv, "compiled", lambda device, name, src, smem, file: built.append(src()) or 1)
    assert not cuda_ops.builds("cuda:0", torch.float16)
    monkeypatch.setattr(cuda_ops, "ENABLED", False)
    assert not cuda_ops.builds("cuda:0", torch.bfloat16) and not built
    monkeypatch.setattr(cuda_ops, "ENABLED", True)
    assert cuda_ops.builds("cuda:0", torch.bfloat16) and len(built) == 3
    assert "rope_cache<0>(a)" in built[0] and "silu_mul<0>(a)" in built[1] and "rms_norm<0, 256, 16>(a)" in built[2]
    monkeypatch.setattr(smem_gemv, "compiled", lambda device, name, src, smem, file: None)  # NVRTC refused them
    assert not cuda_ops.builds("cuda:0", torch.float32)


def test_a_compiled_block_keeps_tritons_kernels(monkeypatch):
    """Where only compiling keeps `supported` false (the default engine's prefill through its compiled block),
    fused_ops' functions still launch Triton's kernels, which inductor traces, and the norm stays torch's; cuda_ops'
    only where Triton's are off or missing (dynamo cannot trace their ctypes launch)."""
    cuda = types.SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(fused_ops, "triton", object())
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert fused_ops.ENABLED and not fused_ops.supported(cuda)
    assert not fused_ops.in_cuda_ops(cuda) and not fused_ops.norms(cuda, None)
    monkeypatch.setattr(fused_ops, "ENABLED", False)
    assert fused_ops.in_cuda_ops(cuda) and not fused_ops.norms(cuda, None)  # (nor compiled there)
    monkeypatch.setattr(fused_ops, "ENABLED", True)
    monkeypatch.setattr(fused_ops, "triton", None)
    assert fused_ops.in_cuda_ops(cuda) and not fused_ops.in_cuda_ops(types.SimpleNamespace(is_cuda=False))


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
        assert cuda_ops.builds(q.device, dtype)
        got = cuda_ops.rope_and_cache(q, k, v, freqs, caches[1], pos)
        for w, o in zip(want, got):
            assert same(o, w), (B, S)
        assert same(caches[1].k_cache, caches[0].k_cache) and same(caches[1].v_cache, caches[0].v_cache)

        x = (torch.randn(B, S, 2 * 3584, generator=g) * 4).to("cuda", dtype)
        x[0, 0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 88.0, -88.0])
        gate, up = x.chunk(2, dim=-1)
        assert same(cuda_ops.silu_mul(x), F.silu(gate) * up), (B, S)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_matches_the_eager_ops(dtype):
    """rms_norm after a residual add, at a decode step (2 and 16 rows) and a prefill (3 x 37), widths 1,280, 72 and
    MAX_D, against model.RMSNorm's eager ops: the sum bit for bit; the norm float32's to 1e-6 of the largest, bf16's
    a few bf16 steps off at most (its sum of squares added in another order can move the rounding of x rstd, which the
    weight scales), and rarely."""
    from fast_inference.model import RMSNorm

    g = torch.Generator().manual_seed(0)
    for D in (1280, 72, cuda_ops.MAX_D):
        norm = RMSNorm(D).to("cuda", dtype)
        norm.weight.data = (torch.randn(D, generator=g) + 1).to("cuda", dtype)
        for shape in ((2, 1, D), (16, 1, D), (3, 37, D)):
            x, delta = ((torch.randn(shape, generator=g) * 3).to("cuda", dtype) for _ in range(2))
            with torch.no_grad():
                h, want = x + delta, F.rms_norm(x + delta, (D,), eps=norm.eps) * norm.weight
                got_h, got = cuda_ops.rms_norm(x, norm.weight, norm.eps, delta)
                alone = cuda_ops.rms_norm(h, norm.weight, norm.eps)
            assert same(got_h, h) and same(alone, got), (D, shape)
            err = (got.float() - want.float()).abs()
            if dtype == torch.float32:
                assert err.max().item() <= 1e-6 * want.abs().max().item(), (D, shape)
            else:
                step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
                assert (err <= 3 * step).all() and (err > 0).float().mean().item() < 0.02, (D, shape)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_fused_ops_take_them_where_triton_may_not_run(monkeypatch):
    """With Triton's kernels off (the cudagraph backend), fused_ops' two functions run these, and a CUDA graph replays
    them."""
    monkeypatch.setattr(fused_ops, "ENABLED", False)
    launched = []
    for name in ("rope_and_cache", "silu_mul"):
        fn = getattr(cuda_ops, name)
        monkeypatch.setattr(cuda_ops, name, lambda *a, fn=fn, name=name: launched.append(name) or fn(*a))
    x = torch.randn(4, 2 * 256, device="cuda", dtype=torch.bfloat16)
    assert fused_ops.fuses(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_ops.silu_mul(x)
    x.copy_(torch.randn(4, 2 * 256, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    gate, up = x.chunk(2, dim=-1)
    assert same(out, F.silu(gate) * up) and launched == ["silu_mul"]
    q = k = v = torch.randn(1, 1, 2, 8, device="cuda", dtype=torch.bfloat16)
    cache = KVCache(1, 2, 4, 8, torch.bfloat16).cuda()
    fused_ops.rope_and_cache(q, k, v, torch.randn(1, 4, 2, device="cuda"), cache, torch.tensor([2], device="cuda"))
    assert launched == ["silu_mul", "rope_and_cache"] and cache.v_cache[0, :, 2].equal(v[0, 0])


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_the_cudagraph_backends_eager_blocks_run_them(monkeypatch):
    """The cudagraph backend at 3 images under CFG (6 rows: past smem_gemv's, the eager block) with Triton off, as its
    CLIs set it: the prefill and every step's blocks rotate, write the cache, gate and norm with these kernels,
    captured (the steps' RoPE and cache write in smem_attention's kernel: only the prefill's blocks call
    rope_and_cache, eagerly and in its capture), and the teacher-forced logits are the reference's within a few bf16
    roundings of the largest."""
    from fast_inference.engine import Engine
    from fast_inference.generate import generate
    from test_reference import cuda_tiny

    monkeypatch.setattr(fused_ops, "ENABLED", False)
    launched = []
    for name in ("rope_and_cache", "silu_mul", "rms_norm"):
        fn = getattr(cuda_ops, name)
        monkeypatch.setattr(cuda_ops, name, lambda *a, fn=fn, name=name: launched.append((name, a[0])) or fn(*a))
    model, cond, mask, condition, forced = cuda_tiny(B=3, seed=4)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, forced=forced)
    engine = Engine(model, backend="cudagraph")
    for image in range(2):  # the prefill eager, then captured
        launched.clear()
        _, got = engine.generate(cond, 12, **kw)
        ropes = [q.shape[1] for name, q in launched if name == "rope_and_cache"]  # its tokens per row
        assert engine.sampler.block_fn is None and len(ropes) >= len(model.layers) and min(ropes) > 1, ropes
        names = [name for name, _ in launched]
        assert names.count("rms_norm") >= 2 * (2 * 2 + 1), names  # two a block and the head's
    monkeypatch.setattr(cuda_ops, "ENABLED", False)
    _, want = generate(model, cond, 12, return_logits=True, **kw)
    for i, (w, g) in enumerate(zip(want, got)):
        w = w if w.shape == g.shape else w.chunk(2)[0]
        assert (g.float() - w.float()).abs().max().item() <= 3e-2 * w.abs().max().item(), i
