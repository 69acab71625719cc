"""The prefetcher's fetch plans (prefetch_triton.schedule): every projection weight once, each released by a count the
step reaches before that weight is read, none by a count the step never reaches (the step would wait forever)."""
import subprocess
import sys

import torch

from fast_inference.kernels import prefetch_triton as prefetch
import interpret
from test_reference import tiny_model


def test_fused_schedule_fetches_each_weight_as_the_projection_before_starts():
    model = tiny_model()
    model.fuse_projections()
    plan = prefetch.schedule(model, compiled=False)
    assert [w for w, _ in plan] == prefetch.segments(model)
    # projection j starts as the count goes to j + 1: weight j is released by projection j - AHEAD's start
    assert [wait for _, wait in plan] == [max(0, j - prefetch.AHEAD + 1) for j in range(len(plan))]
    assert max(wait for _, wait in plan) <= 4 * len(model.layers)


def test_compiled_schedule_is_paced_by_each_layers_attention():
    model = tiny_model(n_layer=4)
    model.fuse_projections()
    plan = prefetch.schedule(model, compiled=True)
    weights = [w.data_ptr() for w, _ in plan]
    assert sorted(weights) == sorted(w.data_ptr() for w in prefetch.segments(model))  # each weight once
    for i, layer in enumerate(model.layers):
        wait = {w.data_ptr(): c for w, c in plan}
        # the attention of layer i is its (i + 1)-th count: it releases wo, gate/up and w2 of layer i, which the
        # step reads after it, and the next layer's qkv; the first qkv goes at once
        assert wait[layer.attention.wqkv.weight.data_ptr()] == i
        for w in (layer.attention.wo.weight, layer.feed_forward.w13, layer.feed_forward.w2.weight):
            assert wait[w.data_ptr()] == i + 1
    waits = [c for _, c in plan]
    assert waits == sorted(waits) and waits[-1] == len(model.layers)  # in order; the last count is the step's


def test_fused_schedule_fetches_each_layers_keys_with_its_qkv():
    model = tiny_model()
    model.fuse_projections()
    model.setup_caches(2, 24, torch.float32)
    plan = prefetch.schedule(model, compiled=False, kv=True)
    weights = [(s, w) for s, w in plan if isinstance(s, torch.Tensor)]
    assert weights == prefetch.schedule(model, compiled=False)  # the weights as without the keys
    for i, layer in enumerate(model.layers):
        at = [j for j, (s, _) in enumerate(plan) if s is layer.attention.kv_cache]
        # once, right after the layer's qkv, released by the same count: the down projection before it started
        assert len(at) == 1 and plan[at[0] - 1][0] is layer.attention.wqkv.weight
        assert plan[at[0]][1] == plan[at[0] - 1][1] == max(0, 4 * i - prefetch.AHEAD + 1)


def test_compiled_schedule_with_down_fetches_the_next_keys_as_down_starts():
    model = tiny_model(n_layer=4)
    model.fuse_projections()
    model.setup_caches(2, 24, torch.float32)
    assert not any(not isinstance(s, torch.Tensor) for s, _ in prefetch.schedule(model, compiled=True, kv=True))
    plan = prefetch.schedule(model, compiled=True, down=True, kv=True)
    wait = {id(s): c for s, c in plan}
    assert len(wait) == len(plan) == 5 * len(model.layers)  # each weight and each layer's keys once
    for i, layer in enumerate(model.layers):
        # two counts per layer: its attention (2i + 1) and its down projection (2i + 2)
        for w in (layer.attention.wo.weight, layer.feed_forward.w13, layer.feed_forward.w2.weight):
            assert wait[id(w)] == 2 * i + 1
        assert wait[id(layer.attention.wqkv.weight)] == max(0, 2 * i - 1)
        assert wait[id(layer.attention.kv_cache)] == 2 * i  # the down projection before it
    waits = [c for _, c in plan]
    assert waits == sorted(waits) and waits[-1] <= 2 * len(model.layers)


def test_kv_rows_are_each_row_and_heads_keys_after_the_text(monkeypatch):
    model = tiny_model(n_layer=1)
    model.setup_caches(6, 24, torch.bfloat16)
    cache = model.layers[0].attention.kv_cache
    R, H, L, hd = cache.k_cache.shape
    monkeypatch.setattr(prefetch, "KV_BYTES", ((None, 1 << 30),))
    rows = prefetch.kv_rows(cache, 4, 8)  # 4 of the 6 rows (CFG off), keys from 8 on, the budget past the cache
    assert [r[0] for r in rows] == [t.data_ptr() + 8 * hd * 2 for t in (cache.k_cache, cache.v_cache)]
    assert {r[1:] for r in rows} == {((L - 8) * hd * 2, L * hd * 2, 4 * H, hd * 2, 8)}
    monkeypatch.setattr(prefetch, "KV_BYTES", ((2, 0), (None, 2 * 4 * H * hd * 2 * 5)))  # five keys per (row, head)
    assert {r[1] for r in prefetch.kv_rows(cache, 4, 8)} == {5 * hd * 2}
    assert prefetch.kv_rows(cache, 2, 8) == []  # none at 2 rows


KERNEL_SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import torch
from fast_inference.kernels import prefetch_triton as prefetch

fetched = []  # (address, bytes) of every bulk prefetch the kernel issues, from the interpreter's arrays


def record(addr, size, EVICT_LAST):
    a, s = addr.handle.data.reshape(-1), size.handle.data.reshape(-1)
    fetched.extend((int(x), int(n), bool(EVICT_LAST)) for x, n in zip(a, s) if n)
    return size


prefetch._l2_prefetch = record
prefetch.CHUNK = 64
weight = torch.zeros(1000, dtype=torch.uint8)  # 1,000 bytes: 15 whole chunks and a tail of 40
keys, first, pos, key, stride, ranges = 9, 3, 7, 16, 160, 5  # 5 ranges of at most 9 keys of 16 bytes, from key 3
segs = torch.tensor([[weight.data_ptr(), 1000, 0, 0, 1, 0, 0], [4096, keys * key, 2, stride, ranges, key, first],
                     [1 << 20, keys * key, 2, stride, ranges, key, pos + 1]], dtype=torch.int64)
progress = torch.tensor([2, 0], dtype=torch.int32)  # every count reached
prefetch._prefetch_kernel[(3,)](segs, progress, torch.tensor([pos]), 3, 2, CHUNK=64, EVICT_LAST=True,
                                KV_EVICT_LAST=False, num_warps=1)
want = [(weight.data_ptr() + o, min(64, 1000 - o) // 16 * 16, True) for o in range(0, 1000, 64)]
# the keys before the position, (pos - first) x 16 = 64 bytes: one chunk per range; none past the cache's first key
want += [(4096 + i * stride, (pos - first) * key, False) for i in range(ranges)]
assert sorted(fetched) == sorted(want), (sorted(fetched), sorted(want))
assert progress.tolist() == [0, 0]  # put back once every program is done
print("fetched", len(fetched))
"""


def test_prefetch_kernel_fetches_the_weights_and_the_keys_before_the_position():
    """The prefetcher's kernel in Triton's interpreter, its bulk prefetch recorded: every chunk of a weight (in
    16-byte multiples), each (row, head)'s keys from the first one to the position's (not written yet), nothing of
    a cache whose first key is past it; the counts reset at the end."""
    out = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT], env=interpret.ENV, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1] == str(16 + 5)
