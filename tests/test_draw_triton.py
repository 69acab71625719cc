"""The fused draw (kernels/draw_triton.py) against sampling.py, in Triton's CPU interpreter
(TRITON_INTERPRET=1), and compiled ahead of time for sm_90."""

import pytest

import early
import interpret
import sm90

pytest.importorskip("triton")

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import math
import torch
import triton
import triton.language as tl
from fast_inference.kernels import draw_triton as ds
from fast_inference.sampling import cfg_merge, filter_logits, kth_largest


@triton.jit
def noise_kernel(NOISE, POS, SEED, batch, V, VP: tl.constexpr, CHUNK: tl.constexpr):
    j = tl.arange(0, VP)
    b = tl.program_id(0)
    tl.store(NOISE + b * V + j, ds.race_noise(tl.load(SEED), tl.load(POS), b, batch, j, VP, CHUNK), mask=j < V)


@triton.jit
def kth_kernel(X, OUT, V, K, VP: tl.constexpr):
    offs = tl.arange(0, VP)
    x = tl.load(X + tl.program_id(0) * V + offs, mask=offs < V, other=0.0)
    tl.store(OUT + tl.program_id(0), ds._kth_largest(x, offs < V, K))


# The k-th largest, exactly as sampling.py's: ties, infinities, both zeros, a width not a power of two
g = torch.Generator().manual_seed(0)
V = 37
x = torch.randn(6, V, generator=g)
x[1, :10] = 0.25  # a tie across the k-th
x[2, ::2] = float("-inf")
x[3, :5], x[3, 5:9] = -0.0, 0.0
x[4] = x[4].round()  # many ties
x[5, 3] = float("inf")
for k in (1, 2, 5, 19, 20, 36):
    got = torch.empty(6)
    kth_kernel[(6,)](x, got, V, k, VP=64)
    assert torch.equal(got, kth_largest(x, k).view(-1)), (k, got, kth_largest(x, k).view(-1))

# Greedy: the arg-max of the merged, tempered logits; out at the position
B, V, prefix = 3, 300, 4
for dtype, guided in ((torch.float32, True), (torch.bfloat16, True), (torch.float32, False)):
    rows = 2 * B if guided else B
    logits = torch.randn(rows, V, generator=g).to(dtype)
    token = torch.zeros(B, 1, dtype=torch.long)
    out = torch.full((B, 10), -1, dtype=torch.long)
    pos, seed, scale, temp = torch.tensor([prefix + 3]), torch.tensor(5), torch.tensor(3.0), torch.tensor(0.7)
    ds.draw(logits, token, out, pos, seed, scale, temp, prefix, 8, guided, False)
    merged = cfg_merge(logits.float(), scale) if guided else logits.float()
    want = filter_logits(merged, temp, 8).argmax(-1, keepdim=True)
    assert torch.equal(token, want) and torch.equal(out[:, 4:5], want) and (out[:, :4] == -1).all()

# Sampling: 400 images' first draws over one row of logits (a tie at the k-th value: 7 of 48 kept),
# against sampling.py's filtered softmax: every kept token and nothing else drawn, and a chi-square
# goodness-of-fit test that must not reject at p = 0.001.
n, V, k = 400, 48, 6
scale, temp = torch.tensor(1.5), torch.tensor(2.0)
row = torch.randn(2, V, generator=g)
row[1] = row[0] - 0.3 * torch.randn(V, generator=g)
top7 = torch.topk(cfg_merge(row, scale)[0], 7).indices
row[:, top7[6]] = row[:, top7[5]]  # the 7th merged value equals the 6th
logits = torch.cat([row[:1].repeat(n, 1), row[1:].repeat(n, 1)])
probs = torch.softmax(filter_logits(cfg_merge(row, scale), temp, k), -1)[0].double()
token, out = torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 4, dtype=torch.long)
args = (token, out, torch.tensor([0]))
ds.draw(logits, *args, torch.tensor(11), scale, temp, 0, k, True, True)
first = token.clone()
counts = torch.bincount(first.view(-1), minlength=V).double()
kept = probs > 0
assert kept.sum() == 7 and torch.equal(counts > 0, kept), (counts, probs)
expected = n * probs[kept]
chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
dof = int(kept.sum()) - 1
bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3  # Wilson-Hilferty, z = 3.09
assert chi2 < bound, (chi2, bound)
# The same seed and position draw the same tokens; another seed or position others.
draws = []
for seed, pos in ((11, 0), (11, 0), (12, 0), (11, 1)):
    t = torch.zeros(8, 1, dtype=torch.long)
    ds.draw(torch.cat([row[:1].repeat(8, 1), row[1:].repeat(8, 1)]), t, torch.zeros(8, 4, dtype=torch.long),
            torch.tensor([pos]), torch.tensor(seed), scale, temp, 0, k, True, True)
    draws.append(t)
assert torch.equal(draws[0], first[:8]) and torch.equal(draws[0], draws[1])
assert not torch.equal(draws[0], draws[2]) and not torch.equal(draws[0], draws[3])
# The race's noise made apart (race_noise, as the fused head makes it) draws the same tokens as the draw's
# own, over several chunks and a width not a power of two; and so do the race's winners checked against
# top-k (TRIES: one alone, the first two from one pass, and more after them), the last falling back, and
# the k-th largest searched at once (TRIES = 0), k = 20 of 48 and k = 3 (the first winners mostly outside
# it). With a count the draw advances the position (once for all 64 images) and leaves the count at zero.
# The row split over 1, 2 and 4 programs per image (PROGRAMS) draws the same tokens too.
ds.CHUNK, ds.RACE_CHUNK, m = 16, 16, 64
for guided, k in ((True, 20), (False, 20), (True, 3)):
    logits = torch.randn(2 * m if guided else m, V, generator=g)
    got = []
    for apart, tries, programs in ((False, 5, 128), (True, 5, 128), (True, 1, 64), (True, 2, 256), (True, 3, 128),
                                   (True, 0, 256)):
        ds.TRIES, ds.PROGRAMS = tries, programs
        assert ds.splits(m, 64, 16) == programs // m
        t = torch.zeros(m, 1, dtype=torch.long)
        noise = torch.full((m, V), float("nan"))
        pos, seed = torch.tensor([9]), torch.tensor(13)
        noise_kernel[(m,)](noise, pos, seed, m, V, VP=64, CHUNK=16)
        count = torch.zeros(1 + m, dtype=torch.long) if apart else None  # the position advanced by the draw
        ds.draw(logits, t, torch.zeros(m, 12, dtype=torch.long), pos, seed, scale, temp, 0, k, guided, True,
                noise if apart else None, apart, count)
        assert pos.item() == (10 if apart else 9) and (count is None or not count.any()), (pos, count)
        got.append(t)
    assert all(torch.equal(got[0], t) for t in got) and len(got[0].unique()) > 2, got
    kept = filter_logits(cfg_merge(logits, scale) if guided else logits, temp, k) > float("-inf")
    assert kept.gather(1, got[0]).all()
# Ties in the race's scores (6 values; the noise is the logit less its score): the winners go in (score,
# -index) order, so the first two from one pass, one at a time and the k-th largest at once draw the same
# tokens. Two lanes per chunk put the second winner in the first's lane often; k = 24 of 48 drops about
# half the first winners.
ds.RACE_CHUNK = 2
score = torch.randint(0, 6, (m, V), generator=g).float()
logits = torch.randint(0, V, (m, V), generator=g).float()
got = []
for tries, programs in ((5, 64), (2, 256), (1, 64), (0, 64), (5, 512)):  # 1, 4 or 8 programs per image
    ds.TRIES, ds.PROGRAMS = tries, programs
    t = torch.zeros(m, 1, dtype=torch.long)
    ds.draw(logits, t, torch.zeros(m, 12, dtype=torch.long), torch.tensor([9]), torch.tensor(13),
            scale, torch.tensor(1.0), 0, 24, False, True, logits - score, True)
    got.append(t)
assert all(torch.equal(got[-1], t) for t in got), got
first = score.argmax(-1, keepdim=True)
assert (filter_logits(logits, 1.0, 24).gather(1, first) == float("-inf")).sum() > m // 4
print("ok", chi2, bound)
"""


ENV = interpret.ENV


def test_draw_matches_sampling_in_interpreter():
    """Top-k's k-th value identical to sampling.kth_largest (ties, infinities, signed zeros), greedy
    draws identical to sampling.py's arg-max with and without CFG (float32 and bfloat16 logits), and
    400 sampled draws: the kept set exactly (a tie at the k-th value included), a chi-square fit to
    sampling.py's filtered softmax, the same draws for the same seed and position, and the same draws
    with the race's noise made apart (race_noise)."""
    out = early.result(SCRIPT, ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-3] == "ok", out.stdout


IMAGES_SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
from fast_inference.kernels import draw_triton as ds

# A server's batch of three requests (2, 1 and 2 images), each with its own seed, position, cfg scale, temperature and
# top-k: draw_images over the batch gives each image the token draw() gives it in its request's batch alone, and the
# token to its out row at its position. The counter taken as the slot and the batch (not the image's place in its
# request) draws other tokens: the check can fail.
g = torch.Generator().manual_seed(3)
V, prefix = 300, 4
requests = [dict(n=2, seed=5, pos=prefix + 2, cfg=3.0, temp=0.7, k=5), dict(n=1, seed=9, pos=prefix - 1, cfg=1.5,
            temp=1.0, k=0), dict(n=2, seed=5, pos=prefix + 6, cfg=4.0, temp=1.3, k=2000)]
m = sum(r["n"] for r in requests)
for guided in (True, False):
    parts = [torch.randn(2 * r["n"] if guided else r["n"], V, generator=g) for r in requests]
    halves = lambda i: parts[i].chunk(2) if guided else (parts[i],)
    logits = torch.cat([torch.cat([halves(i)[h] for i in range(3)]) for h in range(2 if guided else 1)])
    per = lambda key, dtype=None: torch.tensor([r[key] for r in requests for _ in range(r["n"])], dtype=dtype)
    image = torch.tensor([b for r in requests for b in range(r["n"])], dtype=torch.int32)
    images = per("n", torch.int32)
    k = torch.tensor([ds.image_k(r["k"], V) for r in requests for _ in range(r["n"])], dtype=torch.int32)
    want_token, want_out = [], []
    for i, r in enumerate(requests):
        token, out = torch.zeros(r["n"], 1, dtype=torch.long), torch.full((r["n"], 12), -1, dtype=torch.long)
        ds.draw(parts[i], token, out, torch.tensor([r["pos"]]), torch.tensor(r["seed"]), torch.tensor(r["cfg"]),
                torch.tensor(r["temp"]), prefix, r["k"], guided, True)
        want_token.append(token)
        want_out.append(out)
    want_token, want_out = torch.cat(want_token), torch.cat(want_out)
    draws = []
    for counter in ((image, images), (torch.arange(m, dtype=torch.int32), torch.full((m,), m, dtype=torch.int32))):
        token, out = torch.zeros(m, 1, dtype=torch.long), torch.full((m, 12), -1, dtype=torch.long)
        count = torch.zeros(1 + m, dtype=torch.long)
        pos = per("pos")
        ds.draw_images(logits, token, out, pos, per("seed"), *counter, per("cfg", torch.float32),
                       per("temp", torch.float32), k, prefix, guided, torch.empty(m, V), count)
        assert not count.any() and torch.equal(pos, per("pos"))
        draws.append((token, out))
    assert torch.equal(draws[0][0], want_token) and torch.equal(draws[0][1], want_out), (draws[0], want_token)
    assert not torch.equal(draws[1][0], want_token)
    assert len(want_token.unique()) > 2
print("ok")
"""


def test_per_image_draw_gives_each_image_its_requests_draw_in_interpreter():
    """draw_images over a server's batch of three requests (2, 1 and 2 images; their own seeds, positions, cfg scales,
    temperatures and top-k, none included), with and without CFG: each image's token and out row equal draw()'s for
    its request's batch alone; the counter taken as the slot's draws others."""
    out = early.result(IMAGES_SCRIPT, ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "ok", out.stdout


AOT_SCRIPT = r"""
import itertools

from fast_inference.kernels import draw_triton as ds
from sm90 import build

race = {"LOGITS": "*bf16", "NOISE": "*fp32", "CAND_S": "*fp32", "CAND_T": "*i32", "POS": "*i64", "SEED": "*i64",
        "CFG_SCALE": "*fp32", "TEMPERATURE": "*fp32", "batch": "i32"}
draw = {"LOGITS": "*bf16", "NOISE": "*fp32", "CAND_S": "*fp32", "CAND_T": "*i32", "TOKEN": "*i64", "OUT": "*i64",
        "POS": "*i64", "CFG_SCALE": "*fp32", "TEMPERATURE": "*fp32", "COUNT": "*i64", "batch": "i32",
        "stride_out": "i32", "prefix_len": "i32"}
for V, logits, guided, noise in itertools.chain(itertools.product([16384], ("*bf16", "*fp32"), (True, False),
                                                                  (False, True)), [(1000, "*bf16", True, True)]):
    VP, chunk = ds.layout(V)
    RC = min(VP, ds.RACE_CHUNK)
    warps, registers = ds.warps_and_registers(VP)
    options = {"num_warps": warps, "maxnreg": registers, "enable_fp_fusion": False, "launch_pdl": True}
    for batch in (1, 32):
        n = ds.splits(batch, VP, RC)
        common = {"V": V, "GUIDED": guided, "SAMPLE": True, "SPLITS": n, "SPAN": VP // n, "VP": VP, "RC": RC, "PDL": 1}
        plain = {"IMAGE": None, "IMAGES": None, "PER_IMAGE": False}
        build(ds._race_kernel, {**race, "LOGITS": logits}, {**common, **plain, "NOISE_READY": noise, "CHUNK": chunk},
              options)
        build(ds._draw_kernel, {**draw, "LOGITS": logits}, {**common, "TOPK": None, "PER_IMAGE": False,
              "TOP_K": 2000 if V > 2000 else 100, "ADVANCE": noise, "TRIES": ds.TRIES}, options)
        if noise:  # a server's batch (draw_images): each image's own seed, position, settings and counter
            images = {"IMAGE": "*i32", "IMAGES": "*i32"}
            build(ds._race_kernel, {**race, **images, "LOGITS": logits, "batch": "i32"},
                  {**common, "PER_IMAGE": True, "NOISE_READY": False, "CHUNK": chunk}, options)
            build(ds._draw_kernel, {**draw, "TOPK": "*i32", "LOGITS": logits}, {**common, "PER_IMAGE": True,
                  "TOP_K": 0, "ADVANCE": False, "TRIES": ds.TRIES}, options)
print("compiled")
"""


def test_draw_kernel_compiles_for_sm90():
    """Both kernels of the draw for GPT-XL's 16,384-token vocabulary, bf16 and float32 logits, with and without
    CFG, the race's noise read or made (and the position advanced or not), one and 32 images' splits, and a
    1,000-token one (one warp: the register bound within ptxas's 255), with PDL: H100/H200 cubins with Triton's
    bundled ptxas, and no register spills (a row of logits in local memory would be slow)."""
    sm90.run(AOT_SCRIPT)


# Minutes in the interpreter, seconds of ptxas: started beside the other tests (early.py)
EARLY = {"test_draw_matches_sampling_in_interpreter": (SCRIPT, ENV),
         "test_per_image_draw_gives_each_image_its_requests_draw_in_interpreter": (IMAGES_SCRIPT, ENV),
         "test_draw_kernel_compiles_for_sm90": (AOT_SCRIPT, sm90.env())}
