"""attention_cuda's CUDA kernel: built for sm_90 with nvcc where it is installed (no GPU needed), and on a GPU of
compute capability 9.0 or later against the attention in float32 with model.attention_mask's rule (skipped without
one: run there as `python -m pytest tests/test_attention_cuda.py`)."""
import ctypes
import shutil

import pytest
import torch

import sm90

from fast_inference.kernels import attention_cuda, attention_triton, nvrtc
from fast_inference.model import (ModelArgs, apply_rotary_emb, attention_mask,
                                  precompute_freqs_cis_2d, rotations)

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and nvrtc.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernel_builds_for_sm90_without_spills():
    entries = [("attend", hd, attention_cuda.WARPS, pdl) for hd in (64, 128, 256) for pdl in (0, attention_cuda.PDL)]
    entries += [("loop", hd, attention_cuda.LOOP_WARPS, attention_cuda.U) for hd in (64, 128, 256)]
    frames = sm90.nvcc_stack_frames(attention_cuda.source([(f"k{i}", e) for i, e in enumerate(entries)]))
    assert len(frames) == len(entries) and not any(frames), frames


def test_args_match_the_kernels_struct():
    """attention.cu's Args is 152 bytes (its static_assert); the launcher's ctypes mirror must be too."""
    assert ctypes.sizeof(attention_cuda.Args) == 152


def test_not_built_where_it_cannot_run(monkeypatch):
    """Off a GPU with NVRTC, or where NVRTC refuses it, it does not build; an unsupported head dim or too many rows x
    heads does not fit (the plan then keeps SDPA); else the form asked for is built at once."""
    assert attention_cuda.fits(64, 20, 4, 1144) and not attention_cuda.fits(32, 40, 4, 1144)  # head dim 32
    assert not attention_cuda.fits(64, 20, attention_cuda.MAX_HEADS // 20 + 1, 1144)
    assert not attention_cuda.builds("cpu", 64, False)
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    built = []
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: built.append(src()) or object())
    monkeypatch.setattr(attention_cuda, "_counts_for", lambda device: None)
    assert attention_cuda.builds("cuda:0", 64, False) and len(built) == 1 and "attend<64, 4, 1>" in built[0]
    # past the plan's CUDA_LOOP_ROWS rows (the cudagraph backend's eager blocks) the loop
    assert attention_cuda.builds("cuda:0", 64, True) and len(built) == 2
    assert "attend_loop<64, 4, 4>" in built[1]
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: None)  # NVRTC refused it
    assert not attention_cuda.builds("cuda:0", 64, False)


def test_slices_cover_the_cache():
    """A program's shared memory holds the longest slice: the cache's length over the splits, rounded up."""
    for length in (1, 7, 120, 1144, 4096):
        for n in (1, 3, 7, 8, 13):
            span = attention_cuda._span(length, n)
            assert span % 4 == 0 and span * n >= length and (span - 4) * n < length


def reference(q, k, v, key_valid, pos):
    """float32 attention of q (R, H, 1, hd) over keys 0..pos with model.attention_mask's rule."""
    n = pos + 1
    mask = attention_mask(key_valid[:, :n], torch.tensor([pos], device=q.device))  # (R, 1, 1, n)
    scores = (q.float() * q.shape[-1] ** -0.5) @ k[:, :, :n].float().transpose(-1, -2)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v[:, :, :n].float()


def step_inputs(rows, H, hd, p, table, dev):
    """A step's query, key and value before RoPE as views of one projection's output (R, H, 1, hd) each, as the model
    hands them over, and the RoPE row of position p (1, hd / 2, 2); with them rotated by the model's RoPE."""
    qkv = torch.randn(rows, 1, 3, H, hd, device=dev, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (R, H, 1, hd), rows 3 H hd apart
    freqs = table[p : p + 1].to(dev)
    rot = rotations(freqs)
    qr, kr = (apply_rotary_emb(t.transpose(1, 2), rot).transpose(1, 2) for t in (q, k))
    return (q, k, v, freqs), (qr, kr)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("fresh", [False, True])
@pytest.mark.parametrize("text", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 33])
def test_matches_the_attention_in_float32(rows, text, fresh):
    """Positions in the text, at its end and past it, and at the cache's last; one row's caption left-padded, one's
    text all padding; repeated calls (the merge's counts re-zeroed) and a CUDA graph replayed at new positions. With
    the text as one partial (its keys zero, as RoPE's zero rows make them; then poisoned, as it must not read them)
    the positions past it. Past LOOP_ROWS rows attend_loop (1-16 programs per (row, head): 16 at 5 rows, 2 at 16, 1 at
    33 on an H200's 132 SMs). fresh: q, k and v before RoPE, which the kernel rotates as the model does, writing k and
    v to the caches at the position bit for bit, and nothing else there."""
    torch.manual_seed(rows)
    H, hd, L, T = 20, 64, 1144, 120
    dev, bf = "cuda", torch.bfloat16
    k = torch.randn(rows + 1, H, L, hd, device=dev, dtype=bf)  # a cache row past R, untouched
    v = torch.randn(rows + 1, H, L, hd, device=dev, dtype=bf)
    key_valid = torch.ones(rows, L, dtype=torch.bool, device=dev)
    key_valid[0, :37] = False
    if rows > 1:
        key_valid[1, :T] = False
    args = ModelArgs(dim=H * hd, n_head=H, cls_token_num=T, block_size=L - T)
    table = precompute_freqs_cis_2d(args)
    loop = rows > 4  # the plan's CUDA_LOOP_ROWS
    assert attention_cuda.fits(hd, H, rows, L) and attention_cuda.builds(dev, hd, loop)
    partial, positions, replays = None, (0, 5, 36, 119, 120, 121, 700, L - 1, 700), (3, 200, 1000, 9)
    if text:
        k[:, :, :T] = 0
        sums, counts = torch.zeros(rows, H, hd, device=dev), torch.zeros(rows, device=dev)
        attention_triton.text_sums(v, key_valid, T, sums, counts)
        partial, positions, replays = (sums, counts, T), positions[4:], (125, 200, 1000, 130)
    if fresh:  # the zero RoPE rows of the text are no step's
        positions, replays = [p for p in positions if p >= T], [p for p in replays if p >= T]
    k_ref, v_ref, key_valid_ref = k[:rows].clone(), v[:rows].clone(), key_valid.clone()
    if text:
        k[:, :, :T] = v[:, :, :T] = float("nan")
        key_valid[:, :T] = ~key_valid[:, :T]
    pos = torch.zeros(1, dtype=torch.long, device=dev)

    def step(p):  # -> the kernel's arguments q and fresh at position p, and the reference's (rotated) query
        inputs, (qr, kr) = step_inputs(rows, H, hd, p, table, dev)
        if not fresh:
            qr = torch.randn(rows, H, 1, hd, device=dev, dtype=bf)
            return qr, None, qr
        k_ref[:, :, p], v_ref[:, :, p] = kr[:, :, 0], inputs[2][:, :, 0]
        return inputs[0], inputs[1:], qr

    def check(out, qr, p):
        want = reference(qr, k_ref, v_ref, key_valid_ref, p)
        diff = (out.float() - want).abs().max().item()
        assert diff <= 2 ** -8 * want.abs().max().item() + 1e-6, (p, diff)
        if fresh:  # the step's key and value written, nothing else in the caches' real rows and the spare row untouched
            assert k[:rows, :, T:].equal(k_ref[:, :, T:]) and v[:rows, :, T:].equal(v_ref[:, :, T:])
            assert k[rows, :, T:].equal(spare[0]) and v[rows, :, T:].equal(spare[1])

    spare = k[rows, :, T:].clone(), v[rows, :, T:].clone()  # past the text, poisoned (NaN) in its case
    for p in positions:
        pos.fill_(p)
        q, f, qr = step(p)
        check(attention_cuda.decode_attention(q, k, v, key_valid, pos, fresh=f, text=partial, loop=loop), qr, p)

    q, f, _ = step(replays[0])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the capture runs nothing: each replay, the first too, gets its own inputs
        out = attention_cuda.decode_attention(q, k, v, key_valid, pos, fresh=f, text=partial, loop=loop)
    for p in replays:
        pos.fill_(p)
        q2, f2, qr = step(p)
        q.copy_(q2)
        if fresh:
            for a, b in zip(f, f2):
                a.copy_(b)
        else:
            qr = q
        graph.replay()
        check(out, qr, p)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_the_cudagraph_backends_eager_blocks_attend_here():
    """The cudagraph backend at 3 images under CFG (6 rows, past block_cuda's 4): the eager block, its decode attention
    this module's (the loop form; staging at 3 rows after cfg_interval) over the filled keys, no cache windows, the
    kernel rotating and writing the step's key (fresh); teacher-forced logits as with SDPA's windows (the plan's
    attention=sdpa), within a few bf16 roundings of the largest."""
    from fast_inference.engine import Engine
    from test_reference import cuda_tiny

    model, cond, mask, condition, forced = cuda_tiny(B=3, seed=4)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=6, forced=forced)

    def logits(here):
        engine = Engine(model, backend="cudagraph", overrides=() if here else ("attention=sdpa",))
        _, out = engine.generate(cond, 12, **kw)
        r = engine.runner
        assert r.plan.block == "model" and r.contexts[True].block is None  # the eager block
        attention = r.contexts[True].attention
        assert (getattr(attention, "func", None) is attention_cuda.decode_attention) == here
        assert (len(r.kv_lens) == 1) == here and (r.cache.text is not None) == here
        return torch.cat([l[:3].float() for l in out])  # the conditional rows

    want, got = logits(False), logits(True)
    rel = (got - want).abs().max().item() / want.abs().max().item()
    assert rel < 3e-2, rel


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_the_cudagraph_backend_draws_a_seeds_tokens_again_past_four_rows():
    """At 3 images under CFG (the eager block, this module's attention) two engines, each capturing its own graphs,
    draw the same tokens for the same seed: what cuDNN's SDPA plans, chosen per capture, did not promise."""
    from fast_inference.engine import Engine
    from test_reference import cuda_tiny

    model, cond, mask, condition, _ = cuda_tiny(B=3, seed=4)

    def tokens():
        engine = Engine(model, backend="cudagraph")
        torch.manual_seed(11)
        out = engine.generate(cond, 16, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=100)
        assert engine.runner.contexts[True].attention.func is attention_cuda.decode_attention
        return out

    assert tokens().equal(tokens())
