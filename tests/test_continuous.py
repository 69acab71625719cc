"""A server's batch (continuous.py): requests joining a running batch at any step, at their own positions, each
get the tokens the engine gives it alone with the same seed (CPU, fp32, tiny random models)."""
import dataclasses
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from fast_inference import engine as engine_module
from fast_inference import plan
from fast_inference.continuous import Batch, Request
from fast_inference.engine import Engine
from test_reference import tiny_inputs, tiny_model


def requests(model):
    """Five requests of one shape with their own inputs and settings, one of two images."""
    cond, mask, condition = tiny_inputs(model, B=2)
    made = []
    for i, kw in enumerate([dict(seed=1), dict(seed=2, num_images=2, temperature=0.7, top_k=5),
                            dict(seed=3, top_p=0.8, cfg_scale=2.0, control_strength=0.5),
                            dict(seed=4, top_k=0, condition_type="canny"), dict(seed=1, top_k=50, top_p=0.9)]):
        b = i % 2
        made.append(Request(cond=cond[b : b + 1], mask=mask[b : b + 1], control=condition[b], **kw))
    return made


def alone(model, request):
    """The tokens the engine's plain path (fast_engine.py's) gives a request alone, with its seed."""
    model.adapter.condition_type = request.condition_type  # fast_engine.py builds the model with the request's
    try:
        n = request.num_images
        torch.manual_seed(request.seed)
        return Engine(model, backend="eager").generate(
            request.cond.repeat_interleave(n, 0), request.num_tokens, emb_masks=request.mask.repeat_interleave(n, 0),
            cfg_scale=request.cfg_scale, condition=request.control[None].expand(n, -1, -1, -1),
            control_strength=request.control_strength, temperature=request.temperature, top_k=request.top_k,
            top_p=request.top_p)
    finally:
        model.adapter.condition_type = "hed"


def run(batch, schedule):
    """Admit schedule's requests in order, each from its step on (step -> [requests]) once its slots are free,
    removing each when done -> {index: tokens}."""
    order = [r for step in sorted(schedule) for r in schedule[step]]
    due = {id(r): step for step in schedule for r in schedule[step]}
    done, entries, step, waiting = {}, {}, 0, list(order)
    while len(done) < len(order):
        while waiting and due[id(waiting[0])] <= step and batch.fits(waiting[0]):
            r = waiting.pop(0)
            entries[batch.admit(r)] = [id(o) for o in order].index(id(r))
        for e in [e for e in batch.entries if e.finished] or batch.step():  # one token: done at its prefill
            done[entries[e]] = batch.tokens(e)
            batch.remove(e)
        step += 1
        assert step < 200
    return done


def test_requests_joining_mid_run_get_their_own_tokens():
    """Five requests join at steps 0, 0, 3, 7 and 9 (other positions, settings, seeds, condition types, one of two
    images) and leave when done, the batch packing its front (moves): each gets the tokens of the plain engine run for
    it alone; two of them share seed 1 and still differ (their inputs do)."""
    model = tiny_model()
    rs = requests(model)
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    got = run(batch, {0: rs[:2], 3: [rs[2]], 7: [rs[3]], 9: [rs[4]]})  # rs[2]: cfg 2, the same shape (CFG on)
    for i in range(5):
        assert torch.equal(got[i], want[i]), i
    assert not torch.equal(want[0], want[4])
    assert batch.used == 0 and int(batch.runner.live.sum()) == 0


def test_a_one_token_request_gets_the_engines_token():
    """A 16x16 request (one token, drawn at its prefill) is finished when admitted: its token is the engine's alone for
    its seed (a step would draw it again), a request beside it keeps its own, and a step with it still in the batch is
    refused."""
    model = tiny_model(seed=3)
    one, two = (dataclasses.replace(r, control=r.control[:, :16, :16]) for r in requests(model)[:2])
    want = [alone(model, r) for r in (one, two)]
    batch = Batch(Engine(model, backend="eager"), one.shape, capacity=4)
    entry = batch.admit(one)
    assert entry.finished and entry.done == 1 == one.num_tokens
    with pytest.raises(RuntimeError, match="remove it"):
        batch.step()
    got = run(Batch(Engine(model, backend="eager"), one.shape, capacity=4), {0: [one], 1: [two]})
    assert want[0].shape == (1, 1) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_request_without_guidance_and_a_cancelled_one():
    """Without CFG (one row per image) a request gets its own tokens beside another, and one removed half way
    (cancelled) frees its slot for the next."""
    model = tiny_model(seed=2)
    rs = [dataclasses.replace(r, cfg_scale=1.0) for r in requests(model)[:3]]
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=3)
    cancelled = batch.admit(rs[0])
    kept = batch.admit(rs[1])  # two images: slots 1 and 2, full
    assert not batch.fits(rs[2])
    for _ in range(5):
        batch.step()
    batch.remove(cancelled)
    assert batch.used == 2 and kept.slot == 0 and batch.fits(rs[2])
    late = batch.admit(rs[2])
    done = {}
    while len(done) < 2:
        for e in batch.step():
            done[id(e)] = batch.tokens(e)
            batch.remove(e)
    assert torch.equal(done[id(kept)], want[1]) and torch.equal(done[id(late)], want[2])


def test_the_last_request_fills_a_finished_ones_slots_in_one_move(monkeypatch):
    """Three one-image requests joining at steps 0, 1 and 2: the first one cancelled half way, the last moves into its
    slot (one move, the middle one stays), and both still get their own tokens."""
    model = tiny_model(seed=4)
    rs = [dataclasses.replace(r, num_images=1) for r in requests(model)[:3]]
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=3)
    moves = []
    move = batch.runner.move
    monkeypatch.setattr(batch.runner, "move", lambda *a: (moves.append(a[:3]), move(*a)))
    entries = []
    for r in rs:
        entries.append(batch.admit(r))
        batch.step()
    filled = batch.runner.prefix_len + entries[2].done - 1  # its prefix and the keys of its tokens but the last
    caches = lambda slot: [torch.cat([layer.attention.kv_cache.k_cache[batch.runner.rows_of(slot, 1), :, :filled],
                                      layer.attention.kv_cache.v_cache[batch.runner.rows_of(slot, 1), :, :filled]])
                           for layer in model.layers]
    before = caches(2)
    batch.remove(entries[0])
    assert all(torch.equal(a, b) for a, b in zip(before, caches(0)))
    assert moves == [(2, 0, 1)] and [e.slot for e in batch.entries] == [0, 1] and batch.entries[0] is entries[2]
    done = {}
    while len(done) < 2:
        for e in batch.step():
            done[id(e)] = batch.tokens(e)
            batch.remove(e)
    assert torch.equal(done[id(entries[1])], want[1]) and torch.equal(done[id(entries[2])], want[2])


def test_captured_steps_per_bucket(monkeypatch):
    """Where the plan captures the steps (CUDA), one graph per bucket, replayed with the rows' buffers as they are
    then: stand-in graphs replay the captured function (CUDA graphs do not exist on the CPU), and the tokens are the
    engine's alone."""
    make, captured = plan.make, []
    monkeypatch.setattr(engine_module.plans, "make", lambda s: dataclasses.replace(
        make(s), own_positions=dataclasses.replace(make(s).own_positions, graph=True)) if s.own_positions else make(s))

    def capture(self, key, fn, state=None):
        captured.append(key)
        fn()
        self.graphs[key] = SimpleNamespace(replay=fn)

    monkeypatch.setattr(engine_module.Graphs, "capture", capture)
    model = tiny_model(seed=5)
    rs = [requests(model)[i] for i in (0, 2, 1)]  # 1, 2 then 4 images in the batch
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    got = run(batch, {0: [rs[0]], 2: [rs[1]], 4: [rs[2]]})
    assert all(torch.equal(got[i], want[i]) for i in range(3))
    assert batch.runner.buckets == (1, 2, 4) and sorted(set(captured)) == [1, 2, 4] and len(captured) == 3


def test_per_row_settings_filter_each_row_as_it_would_be_alone():
    """sampling.filter_logits with one setting per row (tensors) gives each row the bits its numbers give it alone:
    top-k with ties at the k-th value, top-k 0 (none), top-p 1 (none), temperatures."""
    from fast_inference.sampling import filter_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    logits[2, :10] = logits[2, 10]  # ties at the k-th value
    settings = [(5, 1.0, 1.0), (0, 0.9, 0.7), (11, 1.0, 1.3), (1, 0.5, 1.0), (50, 0.95, 2.0), (0, 1.0, 1e-5)]
    k, p, t = (torch.tensor([[s[i]] for s in settings]) for i in range(3))
    rows = filter_logits(logits, t.float(), k, p.float())
    for i, (top_k, top_p, temperature) in enumerate(settings):
        alone = filter_logits(logits[i : i + 1], torch.tensor(temperature), top_k, top_p)
        assert torch.equal(rows[i : i + 1], alone), i
    assert torch.isinf(rows[0]).sum() == 45 and not torch.isinf(rows[5]).any()


def test_the_plan_of_a_servers_steps():
    """A server's steps: inductor's compiled block where it compiles, one graph per bucket on CUDA, eager on the eager
    backend; the prefill eager with torch's RoPE (its rows inside the batch), no cache windows or text partial; and
    speculative passes refused."""
    hopper = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, builds=lambda *key: True)
    p = plan.make(plan.Situation(backend="inductor", batch=32, own_positions=True, **hopper))
    o = p.own_positions
    assert (o.block, o.head, o.graph, o.buckets) == ("compiled", "compiled", True, (1, 2, 4, 8, 16, 32))
    assert (p.prefill, p.prefill_ops.rope, p.windows, p.text_sums, p.prefetch) == ("eager", "torch", 1, "none", "none")
    assert "rows apart" in plan.explain(p)
    p = plan.make(plan.Situation(backend="eager", batch=6, own_positions=True))
    assert (p.own_positions.block, p.own_positions.graph, p.own_positions.buckets) == ("model", False, (1, 2, 4, 6))
    assert plan.make(plan.Situation(backend="eager", batch=6)).own_positions is None
    with pytest.raises(plan.PlanError, match="one token per step"):
        plan.make(plan.Situation(backend="eager", own_positions=True, draft_window=4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_steps_on_cuda_give_the_reference_greedy_tokens():
    """On CUDA (inductor: the compiled block and head, a CUDA graph per bucket, float32): requests joining at other
    steps get the reference's greedy tokens; the same seeds sampled twice give the same tokens."""
    from fast_inference.generate import generate

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(seed=6).cuda()
    rs = [dataclasses.replace(r, top_k=1, cond=r.cond.cuda(), mask=r.mask.cuda(), control=r.control.cuda())
          for r in requests(model)[:3]]
    want = []
    for r in rs:
        n = r.num_images
        want.append(generate(model, r.cond.repeat_interleave(n, 0), r.num_tokens,
                             emb_masks=r.mask.repeat_interleave(n, 0), cfg_scale=r.cfg_scale,
                             condition=r.control[None].expand(n, -1, -1, -1), control_strength=r.control_strength,
                             top_k=1))
    engine = Engine(model, backend="inductor")
    batch = Batch(engine, rs[0].shape, capacity=4)
    got = run(batch, {0: [rs[0]], 2: [rs[1]], 5: [rs[2]]})
    assert sorted(batch.runner.graphs.graphs) == [1, 4]
    for i in range(3):
        assert torch.equal(got[i], want[i]), i
    sampled = [dataclasses.replace(r, top_k=50) for r in rs]
    twice = [run(batch, {0: sampled[:1], 3: sampled[1:]}) for _ in range(2)]
    assert all(torch.equal(twice[0][i], twice[1][i]) for i in range(3))


def test_server_step_tool_runs_on_a_tiny_model(tmp_path):
    """tools/server_step.py --tiny (its CPU smoke run): a table row per size and the JSON beside it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "server_step.py"), "--tiny", "--sizes", "1,2",
                          "--steps", "5", "--json", str(tmp_path / "s.json")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [1, 2] and all(r["batch_ms"] > 0 and r["plain_ms"] > 0 for r in rows)
    assert out.stdout.count("\n| ") >= 3  # the header's separator and a row per size
