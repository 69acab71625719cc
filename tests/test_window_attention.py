"""The window form of the Triton attention (attention_triton.window_attention: L >= 1 queries per row, each row at its
own position, the window's mask as data) against plain torch, in Triton's CPU interpreter: ragged per-row positions,
L in {1, 4, 16}, windows running past the cache's end, CFG pairs (two rows at one position), draft-tree masks, the
text as a partial, float32 and bfloat16; and a planted off-by-one position that the comparison must catch. On a CUDA
device the same comparison runs on the GPU (`-k cuda`)."""
import subprocess
import sys

import pytest

import early
import interpret
import sm90

pytest.importorskip("triton")

CHECK = r"""
import torch
from fast_inference.kernels import attention_triton as da
from fast_inference.model import attention_mask


def reference(q, k, v, key_valid, seqlens, masks, text_len=0):
    # query j of row r sees filled key t < seqlens[r] where key_valid lets it, window key i (at seqlens[r] + i) where
    # bit i of masks[r, j] is set; the softmax in float64
    R, H, L, hd = q.shape
    N = k.shape[2]
    t = torch.arange(N)
    start = seqlens[:, None, None]
    i = (t - start).clamp(0, 62)
    bit = (masks[..., None] >> i) & 1
    window = (t >= start) & (t < start + L) & (bit != 0)
    visible = ((t < start) & key_valid[:, None, :N]) | window  # (R, L, N)
    kk = k[:R].double().clone()
    kk[:, :, :text_len] = 0.0
    s = (q.double() @ kk.transpose(-1, -2)) * hd**-0.5
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v[:R].double()


def case(R, H, N, L, seqlens, block, dtype=torch.float32, tree=False, text_len=0, cfg=False, seed=0, device="cpu",
         form=None):
    # -> the largest difference from the reference over the queries inside the cache, and the same with the
    # kernel given positions one too far (a planted off-by-one: it must show); form: window_attention's fold/splits
    g = torch.Generator().manual_seed(seed)
    hd = 32
    q = torch.randn(R, H, L, hd, generator=g).to(dtype)
    k, v = (torch.randn(R + 1, H, N, hd, generator=g).to(dtype) for _ in range(2))  # a spare row, never read
    seqlens = torch.tensor(seqlens, dtype=torch.int64)
    if cfg:  # both rows of an image at its position, the halves as the pass orders them
        seqlens = torch.cat([seqlens, seqlens])
    key_valid = torch.ones(R, N, dtype=torch.bool)
    key_valid[:, :8] = torch.rand(R, 8, generator=g) > 0.4  # a padded text prefix
    key_valid[:, 0] = True  # every query sees a key
    masks = da.chain_masks(L).expand(R, L)
    if tree:  # each query sees itself and a random subset of the window's earlier keys
        j = torch.arange(L)
        below = torch.randint(0, 2**62, (R, L), generator=g) & ((1 << j) - 1)
        masks = below | (1 << j)
    if tree or R % 2:
        masks = masks.contiguous()
    text = None
    if text_len:  # the text's keys zero (RoPE's zero rows): one partial of their values' sum and count
        k[:, :, :text_len] = float("nan")  # never read
        sums, counts = torch.zeros(R + 1, H, hd), torch.zeros(R + 1)
        da.text_sums(v.float(), key_valid, text_len, sums, counts)
        text = (sums, counts, text_len)
    to = lambda t: t.to(device) if torch.is_tensor(t) else t
    args = [to(t) for t in (q, k, v, key_valid)]
    text = None if text is None else tuple(to(t) for t in text)
    form = form or {}
    count = to(torch.zeros(1, dtype=torch.int32))  # a prefetcher's count: one a call, whatever the splits
    got = da.window_attention(*args, to(seqlens), to(masks), text=text, config=(block, 4, 1), progress=count,
                              **form).cpu()
    assert count.item() == 1, (form, count)
    assert got.transpose(1, 2).is_contiguous() or device != "cpu"
    want = reference(q, k.nan_to_num(0.0), v, key_valid, seqlens, masks, text_len)
    inside = (seqlens[:, None] + torch.arange(L) < N)[:, None, :, None]  # queries inside the cache
    worst = (got.double() - want).abs().masked_fill(~inside, 0).nan_to_num(float("inf")).max().item()
    if (seqlens + L <= N).all() and not tree and not text_len:  # a chain inside the cache: the model's own rule
        pos = seqlens[:, None] + torch.arange(L)
        model = torch.nn.functional.scaled_dot_product_attention(q.double(), k[:R].double(), v[:R].double(),
                                                                 attn_mask=attention_mask(key_valid, pos))
        worst = max(worst, (got.double() - model).abs().max().item())
    off = da.window_attention(*args, to(seqlens + 1), to(masks), text=text, config=(block, 4, 1), **form).cpu()
    planted = (off.double() - want).abs().masked_fill(~inside, 0).nan_to_num(float("inf")).max().item()
    return worst, planted


# (rows, heads, cache length, window, each image's filled keys, tile) + options
CASES = [
    (3, 2, 40, 1, [9, 30, 39], 16, {}),  # a server's step: every row at its own position
    (2, 2, 40, 4, [8, 21], 16, {}),
    (4, 2, 72, 16, [8, 50], 32, dict(cfg=True)),  # CFG pairs, the window crossing tiles
    (2, 2, 40, 16, [12, 30], 16, {}),  # a window running past the cache's end (30 + 16 > 40)
    (2, 2, 48, 16, [20, 9], 16, dict(tree=True)),  # draft-tree masks
    (2, 2, 72, 4, [40, 9], 16, dict(text_len=8)),  # the text as a partial
    (2, 2, 40, 4, [30, 12], 16, dict(dtype=torch.bfloat16)),
]


# window_attention's forms: a split per tile and the merge kernel (window_splits=merge); the fold form with one split
# over the cache (every row writes its output), with splits of two tiles (short rows one split, long ones merged by
# their last split, in one launch), with a split per tile (many merged), and as window_tiles chooses
FORMS = [dict(fold=False), dict(splits=1), dict(splits=2), dict(splits=99), {}]


def run_cases(device="cpu"):
    # the worst float32 difference over every case and form, and the least planted difference of each form
    worst, planted = 0.0, []
    for form in FORMS:
        least = float("inf")
        for R, H, N, L, seqlens, block, kw in CASES:
            w, p = case(R, H, N, L, seqlens, block, device=device, form=form, **kw)
            tol = 2e-2 if kw.get("dtype") == torch.bfloat16 else 1e-5
            assert w < tol, (form, R, H, N, L, seqlens, kw, w)
            least = min(least, p)
            worst = max(worst, w if tol < 1e-4 else 0.0)
        planted.append(least)
    return worst, min(planted)
"""

SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch


def poisoned(make):  # scratch as garbage: a partial the kernel did not write poisons the merge
    def make_nan(*args, **kwargs):
        t = make(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    return make_nan


torch.empty, torch.empty_like = poisoned(torch.empty), poisoned(torch.empty_like)

# The interpreter multiplies bfloat16 operands as their bits (integers) and truncates float32 -> bfloat16 where the
# GPU rounds to nearest even: give it the GPU's arithmetic
import numpy as np
import triton.language as tl
from triton.runtime import interpreter

dot, truncating = interpreter.InterpreterBuilder.create_dot, interpreter.InterpreterBuilder.cast_impl


def as_float(x):
    if x.dtype.scalar != tl.bfloat16:
        return x
    bits = (x.data.astype(np.uint32) << 16).view(np.float32)
    return interpreter.TensorHandle(bits, tl.float32)


def cast_impl(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        bits = torch.from_numpy(src.data.copy()).to(torch.bfloat16).view(torch.int16).numpy()
        return interpreter.TensorHandle(bits.view("uint16"), tl.bfloat16)
    return truncating(self, src, dst_type)


interpreter.InterpreterBuilder.create_dot = lambda self, a, b, *args: dot(self, as_float(a), as_float(b), *args)
interpreter.InterpreterBuilder.cast_impl = cast_impl
""" + CHECK + r"""
worst, planted = run_cases()
assert all(not c.any() for c in da._COUNTS.values()), "the fold form left a count set: the next launch would misread it"
print(worst, planted)
"""


def check(out):
    assert out.returncode == 0, out.stderr[-3000:]
    worst, planted = map(float, out.stdout.split()[-2:])
    assert worst < 1e-5, worst
    assert planted > 1e-2, f"a window one position off went unnoticed ({planted})"


def test_window_attention_matches_torch_in_interpreter():
    """Every case within 1e-5 of float64 torch (bfloat16 within 2e-2), the chains also of SDPA with the model's mask;
    with every row's position one too far, some case differs by more than 1e-2."""
    check(early.result(SCRIPT, interpret.ENV))


def test_window_tiles_leave_enough_programs():
    """The fold form's split size: the most tiles (a power of two) that leave WINDOW_PROGRAMS programs at the full
    cache; one split (no partials) where the rows alone give that many; a tile each where even that gives fewer."""
    from fast_inference.kernels import attention_triton as da

    least = da.WINDOW_PROGRAMS
    for pairs, tiles in ((40, 17), (320, 17), (8, 3), (40, 1), (least, 40), (least // 2, 5)):
        per = da.window_tiles(pairs, tiles)
        assert per == 1 or pairs * -(-tiles // per) >= least, (pairs, tiles, per)
        assert per >= tiles or pairs * -(-tiles // (per * 2)) < least, (pairs, tiles, per)
    assert da.window_tiles(least, 40) >= 40 and da.window_tiles(8, 3) == 1


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="needs a CUDA device")
def test_window_attention_matches_torch_on_cuda():
    out = subprocess.run([sys.executable, "-c", CHECK + "\nprint(*run_cases('cuda'))"], env=sm90.env(),
                         capture_output=True, text=True, timeout=600)
    check(out)


AOT_SCRIPT = r"""
import itertools

import torch
from fast_inference.kernels import attention_triton as da
from sm90 import build

ints = ["stride_qr", "stride_qh", "stride_ql", "stride_kr", "stride_kh", "stride_kn", "stride_vr", "stride_vh",
        "stride_vn", "stride_valid", "stride_mr", "stride_or", "stride_oh", "stride_ol", "n_heads", "n_splits",
        "n_keys", "text_len", "window"]
for dt, hd, text in itertools.product(("*bf16", "*fp32"), (64, 128), (False, True)):
    sig = {"Q": dt, "K": dt, "V": dt, "KEY_VALID": "*i1", "SEQLENS": "*i64", "MASKS": "*i64", "M_OUT": "*fp32",
           "L_OUT": "*fp32", "ACC_OUT": "*fp32", "OUT": dt, "COUNT": "*i32", "TEXT_SUM": "*fp32",
           "TEXT_COUNT": "*fp32", "PROGRESS": "*i32", **{n: "i32" for n in ints}}
    for LP, (tiles, fold) in itertools.product((16, 32), ((1, False), (1, True), (2, True), (16, True))):
        block, warps, merge_warps = da.window_config(torch.float32 if dt == "*fp32" else torch.bfloat16, hd, LP)
        # float32 (the equivalence checks' path, never timed) spills up to 40 bytes once its strides are aligned
        build(da._window_partial_kernel, sig, dict(SCALE=hd**-0.5, BLOCK=block, TILES=tiles, HEAD_DIM=hd, LP=LP,
                                                   TEXT=text, IEEE=dt == "*fp32", FOLD=fold, BUMP=fold),
              {"num_warps": warps}, stack=40 if dt == "*fp32" else 0)
        merge = {"M": "*fp32", "L": "*fp32", "ACC": "*fp32", "OUT": dt, "TEXT_SUM": "*fp32", "TEXT_COUNT": "*fp32",
                 "SEQLENS": "*i64", "stride_or": "i32", "stride_oh": "i32", "stride_ol": "i32", "n_heads": "i32",
                 "n_splits": "i32", "n_keys": "i32", "text_len": "i32", "window": "i32"}
        build(da._window_merge_kernel, merge, dict(HEAD_DIM=hd, LP=LP, BLOCK=block, TEXT=text),
              {"num_warps": merge_warps})
print("compiled")
"""


def test_window_kernels_compile_for_sm90():
    """The window form's kernels as an H100/H200 cubin (Triton's bundled ptxas), bf16 and float32, GPT-XL's head dim
    and 128, windows of up to 16 and 32 queries, the merge form and the fold form at 1, 2 and 16 tiles a split: no
    register spills."""
    sm90.run(AOT_SCRIPT)


EARLY = {"test_window_attention_matches_torch_in_interpreter": (SCRIPT, interpret.ENV),
         "test_window_kernels_compile_for_sm90": (AOT_SCRIPT, sm90.env())}
