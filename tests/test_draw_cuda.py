"""draw_cuda's CUDA kernel: built for sm_90 with nvcc where it is installed (no GPU needed), and on a GPU of compute
capability 9.0 or later against sampling.py's filter and the race over the same noise, its Philox computed here
(skipped without one: run there as `python -m pytest tests/test_draw_cuda.py`)."""
import ctypes
import math
import shutil

import numpy as np
import pytest
import torch

import sm90

from fast_inference.kernels import draw_cuda, nvrtc
from fast_inference.sampling import cfg_merge, filter_logits

GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9 and nvrtc.available("cuda")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
def test_kernel_builds_for_sm90_without_spills():
    entries = [(draw_cuda.THREADS, *draw_cuda.layout(V), f32) for V in (64, 3000, 5000, 12288, 16384) for f32 in (0, 1)]
    frames = sm90.nvcc_stack_frames(draw_cuda.source([(f"k{i}", e) for i, e in enumerate(entries)]))
    assert len(frames) == len(entries) and not any(frames), frames


def test_args_match_the_kernels_struct():
    """draw.cu's Args is 128 bytes (its static_assert); the launcher's ctypes mirror must be too."""
    assert ctypes.sizeof(draw_cuda.Args) == 128


def test_not_built_where_it_cannot_run(monkeypatch):
    """Off a GPU with NVRTC, or where NVRTC refuses it, it does not build (the plan then keeps sampling.py's ops); a
    vocabulary past MAX_PER logits a thread does not fit; else the kernel is built at once."""
    assert not draw_cuda.builds("cpu", 16384, torch.bfloat16)
    assert draw_cuda.fits(16384) and not draw_cuda.fits(draw_cuda.THREADS * draw_cuda.MAX_PER + 1)
    monkeypatch.setattr(nvrtc, "available", lambda device: True)
    built = []
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: built.append((src(), smem)) or 1)
    assert draw_cuda.builds("cuda:0", 16384, torch.float32)
    assert "draw<512, 4, 8, 1>" in built[0][0]  # 8 programs an image, 4 logits a thread each
    monkeypatch.setattr(nvrtc, "compiled", lambda device, name, src, smem, file: None)  # NVRTC refused it
    assert not draw_cuda.builds("cuda:0", 16384, torch.bfloat16)


def test_layout_covers_the_vocabulary():
    """Each thread's share of the logits split over the programs of an image: PER each where it divides the share."""
    for V in (1, 64, 1000, 1025, 4096, 5000, 12288, 16383, 16384):
        per, n = draw_cuda.layout(V)
        share = -(-V // draw_cuda.THREADS)
        assert per * n == share and (per == draw_cuda.PER or n == 1)


def philox(counter, key):
    """Philox4x32-10 of counters (4, n) uint64 (32-bit values) under key (2,): its four outputs (4, n)."""
    c = [np.asarray(x, dtype=np.uint64) for x in counter]
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c)


def test_philox_matches_random123():
    """The reference's Philox (the kernel's, written out again here) against Random123's known-answer vectors."""
    assert philox([[0], [0], [0], [0]], (0, 0))[:, 0].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    out = philox([[0xFFFFFFFF]] * 4, (0xFFFFFFFF, 0xFFFFFFFF))[:, 0].tolist()
    assert out == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def log_e(V, b, pos, seed, device):
    """The kernel's race noise log E for image b's logits 0..V-1 at pos: logit j = i * THREADS + t takes Philox output
    i % 4 at counter (i // 4, t, pos, b) under the seed's two words."""
    T = draw_cuda.THREADS
    j = np.arange(V)
    i, t = j // T, j % T
    r = philox([i // 4, t, np.full(V, pos), np.full(V, b)], (seed & 0xFFFFFFFF, seed >> 32))[i % 4, j]
    u = torch.tensor(((r >> np.uint64(9)) * np.uint64(2) + np.uint64(1)).astype(np.float32), device=device) * 2.0 ** -24
    return torch.log(-torch.log(u))


def expected(logits, guided, scale, temperature, top_k, sample, pos, seed):
    """sampling.py's filter of the merged logits, then the race over the kernel's noise (greedy: argmax)."""
    x = logits.float()
    x = cfg_merge(x, torch.tensor(scale, device=x.device)) if guided else x
    x = filter_logits(x, torch.tensor(temperature, device=x.device), top_k)
    if sample:
        x = x - torch.stack([log_e(x.shape[1], b, pos, seed, x.device) for b in range(x.shape[0])])
    return x.argmax(-1)


def run(logits, guided, scale, temperature, top_k, sample, pos, seed, prefix_len=10, tokens=2000):
    batch = logits.shape[0] // (2 if guided else 1)
    dev = logits.device
    token = torch.full((batch, 1), -1, dtype=torch.long, device=dev)
    out = torch.full((batch, tokens), -1, dtype=torch.long, device=dev)
    input_pos = torch.tensor([pos], device=dev)
    count = torch.zeros(1 + batch, dtype=torch.long, device=dev)
    args = (torch.tensor(seed, device=dev), torch.tensor(scale, device=dev), torch.tensor(temperature, device=dev))
    draw_cuda.draw(logits, token, out, input_pos, *args, prefix_len, top_k, guided, sample, count=count)
    assert input_pos.item() == pos + 1 and not count.any()
    col = pos - prefix_len + 1
    assert torch.equal(out[:, col], token[:, 0]) and (out[:, :col] == -1).all() and (out[:, col + 1:] == -1).all()
    return token[:, 0]


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("V", [16384, 1000, 64])
def test_matches_the_filter_and_the_race(dtype, V):
    """The same tokens as sampling.py's filter and the race over the same noise: guided and not, 1-4 images,
    top-k from 1 to past V (also where the race's winner is rarely kept, k = 1 and 2, so that the k-th largest is
    searched), greedy, a temperature, and ties (logits rounded to a few values)."""
    torch.manual_seed(V)
    assert draw_cuda.builds("cuda", V, dtype)
    seed = 0x1234_5678_9ABC_DEF
    for trial, (batch, guided, top_k, sample, temperature) in enumerate([
            (1, True, 2000, True, 1.0), (1, False, 2000, True, 1.0), (2, True, 1, True, 1.0), (3, True, 2, True, 0.7),
            (4, False, 50, True, 1.3), (2, True, 0, True, 1.0), (2, True, V + 5, True, 1.0), (2, True, 7, False, 1.0),
            (4, True, 3, True, 1.0)]):
        rows = 2 * batch if guided else batch
        logits = (torch.randn(rows, V, device="cuda") * 3).to(dtype)
        if trial == 8:  # ties: a few distinct values
            logits = logits.round()
        pos = 10 + 97 * trial
        want = expected(logits, guided, 4.0, temperature, top_k, sample, pos, seed + trial)
        got = run(logits, guided, 4.0, temperature, top_k, sample, pos, seed + trial)
        assert torch.equal(got, want), (trial, got, want)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_draws_follow_the_softmax_of_the_kept_logits():
    """4,096 images with the same 8 logits (top-k 6), 8 seeds: the tokens' counts against softmax over the kept 6,
    a chi-square test at p = 1e-4 (fixed seeds: not flaky), and the 2 dropped never drawn."""
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0, -3.0, 0.2, 1.5]], device="cuda").repeat(2 * 4096, 1)
    counts = torch.zeros(8, device="cuda")
    for seed in range(8):
        tokens = run(logits, True, 1.0, 1.0, 6, True, 100 + seed, 2**40 + seed)
        counts += torch.bincount(tokens, minlength=8)
    p = torch.softmax(filter_logits(logits[:1], 1.0, 6), -1)[0]
    assert counts[p == 0].sum() == 0
    kept = p > 0
    chi2 = ((counts[kept] - counts.sum() * p[kept]) ** 2 / (counts.sum() * p[kept])).sum().item()
    assert chi2 < 25.7, (chi2, counts, p)  # 5 degrees of freedom, p = 1e-4
    assert math.isfinite(chi2)


@pytest.mark.skipif(not GPU, reason="needs a GPU of compute capability 9.0+ with NVRTC")
def test_replays_in_a_cuda_graph():
    """Captured once, replayed: each replay draws at the position it finds and advances it, with the step's noise."""
    V, dev = 16384, "cuda"
    logits = torch.randn(2, V, device=dev).to(torch.bfloat16)
    token = torch.zeros(1, 1, dtype=torch.long, device=dev)
    out = torch.zeros(1, 64, dtype=torch.long, device=dev)
    pos = torch.tensor([20], device=dev)
    count = torch.zeros(2, dtype=torch.long, device=dev)
    seed, scale, temp = torch.tensor(77, device=dev), torch.tensor(4.0, device=dev), torch.tensor(1.0, device=dev)
    assert draw_cuda.builds(dev, V, torch.bfloat16)
    draw_cuda.draw(logits, token, out, pos, seed, scale, temp, 20, 2000, True, True, count=count)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        draw_cuda.draw(logits, token, out, pos, seed, scale, temp, 20, 2000, True, True, count=count)
    pos.fill_(30)
    for p in range(30, 35):
        graph.replay()
        want = expected(logits, True, 4.0, 1.0, 2000, True, p, 77)
        assert out[0, p - 19].item() == token.item() == want.item(), p
    assert pos.item() == 35 and not count.any()
