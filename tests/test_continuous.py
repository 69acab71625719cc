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
from fast_inference.continuous import Batch, ContinuousRunner, Request
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


def stand_in_graphs(monkeypatch):
    """Plans that capture the server's steps and joins (as on CUDA), with stand-in graphs that replay the captured
    function (CUDA graphs do not exist on the CPU) -> the lists of the keys captured and of (key, first slot) replayed
    (a join's slot: join_slot's value at its replay)."""
    make, captured, replayed = plan.make, [], []
    monkeypatch.setattr(engine_module.plans, "make", lambda s: dataclasses.replace(
        make(s), own_positions=dataclasses.replace(make(s).own_positions, graph=True)) if s.own_positions else make(s))

    def capture(self, key, fn, state=None):
        captured.append(key)
        fn()
        slot = lambda: int(state.join_slot) if is_join(key) else None
        self.graphs[key] = SimpleNamespace(replay=lambda: (replayed.append((key, slot())), fn()))

    monkeypatch.setattr(engine_module.Graphs, "capture", capture)
    return captured, replayed


def is_join(key):
    return isinstance(key, tuple) and key[0] == "join"  # a join's graph (a step's key is its bucket)


def join_at(batch, request, slot):
    """A request's join into slots slot.. of the batch's runner, as Batch.admit makes it (its generator's draws)."""
    r, n = batch.runner, request.num_images
    r.join_noise(n).exponential_(1, generator=torch.Generator().manual_seed(request.seed))
    r.join(slot, n, (request.cond, request.mask, request.control), batch.preparer(request), batch.join_key(request),
           (request.cfg_scale, request.temperature, request.top_k, request.top_p))


def test_captured_steps_per_bucket(monkeypatch):
    """Where the plan captures the steps (CUDA), one graph per bucket, replayed with the rows' buffers as they are
    then: stand-in graphs replay the captured function (CUDA graphs do not exist on the CPU), and the tokens are the
    engine's alone."""
    captured, _ = stand_in_graphs(monkeypatch)
    model = tiny_model(seed=5)
    rs = [requests(model)[i] for i in (0, 2, 1)]  # 1, 2 then 4 images in the batch
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    got = run(batch, {0: [rs[0]], 2: [rs[1]], 4: [rs[2]]})
    assert all(torch.equal(got[i], want[i]) for i in range(3))
    assert batch.runner.buckets == (1, 2, 4) and sorted(set(captured)) == [1, 2, 4] and len(captured) == 3


def test_a_warmed_batch_has_every_graph_and_gives_each_request_its_own_tokens(monkeypatch):
    """Batch.warm (a server's start) captures every bucket's step and the warming request's join, and leaves the
    batch empty; requests joining after it, of its join key and others, get the engine's tokens alone (a warm-up that
    left its requests' rows live, or their tokens, would change them)."""
    captured, replayed = stand_in_graphs(monkeypatch)
    model = tiny_model(seed=9)
    base = requests(model)
    warm = dataclasses.replace(base[0], seed=99)
    rs = [dataclasses.replace(base[0], seed=7), base[1], dataclasses.replace(base[2], seed=8)]
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    batch.warm(warm)
    assert sorted(k for k in captured if not is_join(k)) == [1, 2, 4]
    assert [k for k in captured if is_join(k)] == [batch.join_key(warm)]
    assert batch.used == 0 and not batch.entries and int(batch.runner.live.sum()) == 0
    captured.clear()
    got = run(batch, {0: rs[:2], 3: rs[2:]})
    for i in range(len(rs)):
        assert torch.equal(got[i], want[i]), i
    assert not [k for k in captured if not is_join(k)]  # the steps replay the warm-up's graphs
    assert any(k == batch.join_key(rs[0]) for k, _ in replayed)  # and a join of its key replays its graph


def test_captured_joins_replay_into_other_slots(monkeypatch):
    """Where the plan captures the steps it captures joins too, per images and what prepare() bakes in: a key's first
    join runs as it comes, its second captures, later ones replay into other slots with their own inputs, settings
    and seeds; every request gets the engine's tokens alone (a replay that wrote the capture's slot, or read its
    inputs or settings, would not)."""
    captured, replayed = stand_in_graphs(monkeypatch)
    model = tiny_model(seed=8)
    base = requests(model)
    one = [dataclasses.replace(base[i % 2], seed=10 + i, cfg_scale=2.0 + i, temperature=0.6 + 0.2 * i, top_k=3 * i,
                               top_p=1.0 - 0.1 * (i % 2), num_images=1) for i in range(4)]
    two = [dataclasses.replace(base[1 - i], seed=20 + i, num_images=2) for i in range(3)]
    rs = [one[0], two[0], one[1], one[2], two[1], one[3], two[2]]
    want = [alone(model, r) for r in rs]
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    got = run(batch, {0: rs[:2], 2: rs[2:4], 5: rs[4:]})
    for i in range(len(rs)):
        assert torch.equal(got[i], want[i]), i
    joins = [k for k in captured if is_join(k)]
    assert joins == [batch.join_key(one[0]), batch.join_key(two[0])]  # each at its second join
    slots = {key: {slot for k, slot in replayed if k == key} for key in joins}
    assert slots[joins[0]] and slots[joins[1]]  # one-image joins replayed, and two-image ones
    assert len(set().union(*slots.values())) > 1


def test_a_replayed_join_is_the_eager_join_and_writes_its_own_rows_only(monkeypatch):
    """A join replayed from its graph (captured at other slots) into slots 1 and 2 of a batch whose caches and buffers
    hold random values leaves them all as the eager join does (on a runner that captures nothing, from the same
    values), and changes nothing outside its rows' prefix positions and its slots."""
    model = tiny_model(seed=9)
    shape, T = (64, 64, True), model.args.prefix_len
    a, b = (dataclasses.replace(q, num_images=2) for q in requests(model)[:2])
    g = torch.Generator().manual_seed(1)
    start = {}  # the random values both runners start from

    def randomised(r):
        """The runner's caches and the buffers a join reads or writes (not its constants) at start's values."""
        state = {}
        for i, layer in enumerate(model.layers):
            cache = layer.attention.kv_cache
            state[f"cache k{i}"], state[f"cache v{i}"] = cache.k_cache, cache.v_cache
        state.update({name: getattr(r, name) for name in r.SLOT_BUFFERS + ("key_valid", "controls", "token",
                                                                           "input_pos", "live", "noise")})
        for name, t in state.items():
            if name not in start:
                start[name] = (torch.randint(0, 7, t.shape, generator=g) if t.dtype in (torch.long, torch.int32)
                               else torch.rand(t.shape, generator=g) > 0.3 if t.dtype == torch.bool
                               else torch.randn(t.shape, generator=g))
            t.copy_(start[name])
        return state

    captured, replayed = stand_in_graphs(monkeypatch)
    batch = Batch(Engine(model, backend="eager"), shape, capacity=4)
    join_at(batch, a, 0)
    join_at(batch, b, 2)  # captured at slots 2 and 3
    assert captured == [batch.join_key(a)] and not replayed
    state = randomised(batch.runner)
    join_at(batch, a, 1)
    assert replayed == [(batch.join_key(a), 1)]
    graphed = {name: t.clone() for name, t in state.items()}
    monkeypatch.undo()
    plain = Batch(Engine(model, backend="eager"), shape, capacity=4)
    assert plain.runner.graphs is None
    state = randomised(plain.runner)
    join_at(plain, a, 1)
    for name, t in state.items():
        assert torch.equal(graphed[name], t), name
    rows, slots = plain.runner.rows_of(1, 2), [1, 2]
    others = [i for i in range(8) if i not in rows.tolist()]
    for name, t in graphed.items():
        if name.startswith("cache"):  # its rows' prefix positions only
            assert torch.equal(t[others], start[name][others]) and torch.equal(t[:, :, T:], start[name][:, :, T:]), name
        elif name in ("key_valid", "token", "input_pos", "live"):
            assert torch.equal(t[others], start[name][others]), name
        elif name == "controls":
            assert torch.equal(t[:, others], start[name][:, others]), name
        else:  # the slots' buffers: its slots and the staging slots
            kept = [i for i in range(4) if i not in slots]
            assert torch.equal(t[kept], start[name][kept]), name


def test_the_least_recently_used_join_key_is_forgotten(monkeypatch):
    """A join key per control strength (prepare() bakes it in) is unbounded: beyond JOIN_KEYS the least recently used
    is forgotten and its graph dropped, so that it runs as it comes again, and captures at its next join."""
    captured, replayed = stand_in_graphs(monkeypatch)
    monkeypatch.setattr(ContinuousRunner, "JOIN_KEYS", 2)
    model = tiny_model(seed=10)
    a, b, c = (dataclasses.replace(requests(model)[0], control_strength=s) for s in (1.0, 0.5, 0.25))
    batch = Batch(Engine(model, backend="eager"), a.shape, capacity=2)
    for r in (a, a, a, b, c, a, a, b):  # a captured at its second join, replayed, forgotten at c's, captured again
        join_at(batch, r, 0)
    key = batch.join_key
    assert captured == [key(a), key(a)] and replayed == [(key(a), 0)]
    assert list(batch.runner.joined) == [key(a), key(b)] and key(a) in batch.runner.graphs
    assert key(b) not in batch.runner.graphs and key(c) not in batch.runner.graphs


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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_joins_on_cuda_give_the_eager_joins_tokens():
    """On CUDA (inductor: steps and joins captured, float32): requests of one and two images whose joins are captured
    at their key's second join and replayed into other slots (their inputs pinned and copied from the host, their own
    seeds and settings; keyed draws, and top-p < 1 on their generators) get the tokens of the same schedule whose joins
    all run as they come, and the keyed ones the plain engine's alone with their seeds."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(seed=6).cuda()
    base = requests(model)[:2]  # on the host, as serve.py makes them
    one = [dataclasses.replace(base[i % 2], seed=10 + i, num_images=1, top_k=50, temperature=0.8 + 0.2 * i,
                               cfg_scale=3.0 + i) for i in range(4)]
    two = [dataclasses.replace(base[1 - i % 2], seed=20 + i, num_images=2, top_k=50) for i in range(3)]
    drawn = [dataclasses.replace(base[i % 2], seed=30 + i, num_images=1, top_p=0.9) for i in range(3)]
    rs = [one[0], two[0], one[1], drawn[0], one[2], two[1], drawn[1], one[3], two[2], drawn[2]]
    schedule = {0: rs[:2], 2: rs[2:4], 4: rs[4:7], 9: rs[7:]}
    engine = Engine(model, backend="inductor")
    eager = Batch(engine, rs[0].shape, capacity=4)
    eager.runner.JOIN_KEYS = 0  # every key forgotten at once: each join as it comes
    want = run(eager, schedule)
    assert not any(is_join(k) for k in eager.runner.graphs.graphs)
    batch = Batch(engine, rs[0].shape, capacity=4)
    replay, replayed = batch.runner.graphs.replay, []
    batch.runner.graphs.replay = lambda key: (replayed.append(key), replay(key))
    got = run(batch, schedule)
    joins = {batch.join_key(r) for r in (one[0], two[0], drawn[0])}
    assert joins <= set(batch.runner.graphs.graphs) and joins <= set(replayed)
    for i, r in enumerate(rs):
        assert torch.equal(got[i], want[i]), i
        if r.top_p >= 1.0:
            n = r.num_images
            torch.manual_seed(r.seed)
            alone = engine_module.Engine(model).generate(
                r.cond.cuda().repeat_interleave(n, 0), r.num_tokens, emb_masks=r.mask.cuda().repeat_interleave(n, 0),
                cfg_scale=r.cfg_scale, condition=r.control.cuda()[None].expand(n, -1, -1, -1),
                temperature=r.temperature, top_k=r.top_k)
            assert torch.equal(got[i].cpu(), alone.cpu()), i


def test_server_step_tool_runs_on_a_tiny_model(tmp_path):
    """tools/server_step.py --tiny (its CPU smoke run): a table row per size and the JSON beside it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "tools", "server_step.py"), "--tiny", "--sizes", "1,2",
                          "--steps", "5", "--json", str(tmp_path / "s.json")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [r["n"] for r in rows] == [1, 2] and all(r["batch_ms"] > 0 and r["plain_ms"] > 0 for r in rows)
    assert all(r["first_admit_ms"] > 0 and r["admit_ms"] > 0 and r["capture_ms"] is None for r in rows)  # none on CPU
    assert out.stdout.count("\n| ") >= 3  # the header's separator and a row per size
