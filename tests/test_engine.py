"""The fast engine against the reference sampler (CPU, fp32, tiny random models)."""
import dataclasses
import math
import os
from types import SimpleNamespace

import pytest
import torch

from fast_inference import engine as engine_module
from fast_inference import plan
from fast_inference.engine import Engine
from fast_inference.runner import cache_windows
from fast_inference.plan import CACHE_WINDOWS
from fast_inference.generate import generate
from fast_inference.quantize import quantize_int8
from test_reference import FIXTURES, build_fixture_model, tiny_inputs, tiny_model


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_greedy_tokens_equal_official(name):
    model, fx, data = build_fixture_model(name)
    engine = Engine(model, backend="eager")
    tokens = engine.generate(
        data["caption_emb_left_padded"], data["tokens"].shape[1], emb_masks=data["emb_mask_left_padded"],
        cfg_scale=fx["cfg_scale"], cfg_interval=fx["cfg_interval"], condition=data["condition"],
        control_strength=fx["control_strength"], top_k=1)
    assert torch.equal(tokens, data["tokens"])


@pytest.mark.parametrize("cfg_scale,cfg_interval", [(1.0, -1), (4.0, -1), (4.0, 5)])
def test_teacher_forced_logits_match_reference(cfg_scale, cfg_interval):
    model = tiny_model(cls=120, seed=3)
    cond, mask, condition = tiny_inputs(model)
    forced = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    kw = dict(cfg_scale=cfg_scale, cfg_interval=cfg_interval, control_strength=0.8)
    _, ref_logits = generate(model, cond, 16, emb_masks=mask, condition=condition, forced=forced, return_logits=True,
                             **kw)
    fast = Engine(model, backend="eager")
    fast.generate(cond, 16, emb_masks=mask, condition=condition, **kw)  # first a run whose steps keep no logits
    _, fast_logits = fast.generate(cond, 16, emb_masks=mask, condition=condition, forced=forced, **kw)
    assert len(ref_logits) == len(fast_logits) == 16
    for i, (r, f) in enumerate(zip(ref_logits, fast_logits)):
        if f.shape != r.shape:  # after cfg_interval the fast step runs the conditional half only
            r = r.chunk(2)[0]
        assert (r - f).abs().max().item() <= 1e-4, f"position {i}"


@pytest.mark.parametrize("prefix,tokens,max_seq", [(120, 1024, 1144), (8, 16, 24), (3, 2, 8), (120, 257, 384)])
def test_cache_windows_cover_every_step(prefix, tokens, max_seq):
    """Each decode step's window holds every key up to its position; windows grow, stay within the
    cache, and (for a real image) the first reads far less than the whole cache."""
    lengths, step_window = cache_windows(prefix, tokens, max_seq, CACHE_WINDOWS)
    assert 1 <= len(lengths) <= CACHE_WINDOWS and lengths == sorted(set(lengths)) and lengths[-1] <= max_seq
    assert len(step_window) == max(tokens - 1, 1) and step_window == sorted(step_window)
    for i in range(tokens - 1):  # step i attends up to position prefix + i
        assert prefix + i < lengths[step_window[i]] <= max_seq
    if tokens == 1024:  # 8 runs of 128 steps
        assert lengths == [248, 376, 504, 632, 760, 888, 1016, 1144]


def test_eager_steps_read_cache_windows(monkeypatch):
    """The backends without the Triton attention read a window of the cache per run of steps: the
    windows are really used (most shorter than the cache), and teacher-forced logits with CFG and a
    cfg_interval stay within 1e-4 of the reference's whole-cache attention."""
    import torch.nn.functional as F

    sdpa, used = F.scaled_dot_product_attention, []

    def recording(q, k, v, **kw):
        if q.shape[2] == 1:  # a decode step (the prefill's queries are the whole prefix)
            used.append(k.shape[2])
        return sdpa(q, k, v, **kw)

    model = tiny_model(cls=8, seed=4)
    cond, mask, condition = tiny_inputs(model)
    forced = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=9, forced=forced)
    _, ref_logits = generate(model, cond, 16, return_logits=True, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    _, fast_logits = Engine(model, backend="eager").generate(cond, 16, **kw)
    lengths, _ = cache_windows(model.args.cls_token_num, 16, model.max_seq, CACHE_WINDOWS)
    assert len(lengths) > 1 and sorted(set(used)) == lengths and min(used) < model.max_seq
    for r, f in zip(ref_logits, fast_logits):
        r = r if r.shape == f.shape else r.chunk(2)[0]
        assert (r - f).abs().max().item() <= 1e-4


def test_same_seed_same_tokens_and_partial_batch():
    model = tiny_model()
    cond, mask, condition = tiny_inputs(model)
    engine = Engine(model, backend="eager")
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(engine.generate(cond, 16, emb_masks=mask, condition=condition, cfg_scale=1.0, top_k=50))
    assert torch.equal(runs[0], runs[1])
    assert engine.generate(cond[:1], 16, emb_masks=mask[:1], condition=condition[:1], top_k=50).shape == (1, 16)
    assert engine.runner.batch == 2  # a smaller batch reuses the captured shape, padded
    # Padded greedy results equal the reference on the real rows.
    engine.generate(cond, 16, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1)
    greedy = engine.generate(cond[1:], 16, emb_masks=mask[1:], condition=condition[1:], cfg_scale=4.0, top_k=1)
    assert engine.runner.batch == 2
    want = generate(model, cond[1:], 16, emb_masks=mask[1:], condition=condition[1:], cfg_scale=4.0, top_k=1)
    assert torch.equal(greedy, want)


def test_last_timings_are_each_phase_without_its_compile_time(monkeypatch):
    model = tiny_model()
    cond, mask, condition = tiny_inputs(model)
    engine = Engine(model, backend="eager")
    assert engine.last_timings == {}
    engine.generate(cond, 8, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=50)
    timings = engine.last_timings
    assert set(timings) == {"condition", "prefill", "decode"} and min(timings.values()) > 0
    # The phases' spans, from one mark to the next; a phase's compile seconds are taken off, the set-up's dropped.
    clock = iter([1.0, 1.5, 3.0, 3.25, 9.0])
    monkeypatch.setattr(engine_module.time, "perf_counter", lambda: next(clock))
    marks = engine_module.Marks(torch.device("cpu"))
    marks.mark("condition")
    marks.mark(None)
    marks.mark("prefill", 0.125)
    marks.mark("decode", 2.0)
    assert marks.seconds() == {"condition": 0.5, "prefill": 0.125, "decode": 3.75}


def hand_captured(monkeypatch):
    """Plans as on CUDA (the steps, the eager prefill and prepare() captured by hand) with stand-in graphs that replay
    the captured function, as CUDA graphs do not exist on the CPU -> the list of the captured graphs' keys. A capture
    leaves the state of one run, and the first token's draw stays out of the prefill's graph."""
    make, captured = plan.make, []
    monkeypatch.setattr(engine_module.plans, "make",
                        lambda s: dataclasses.replace(make(s), step="hand_graph", prefill="eager_graph"))

    def capture(self, key, fn, state=None):
        captured.append(key)
        drawn = None if state is None else (state.out.clone(), state.input_pos.clone(), state.token.clone())
        fn()
        if key == "prefill":
            assert all(torch.equal(a, b) for a, b in zip(drawn or (), (state.out, state.input_pos, state.token)))
        self.graphs[key] = SimpleNamespace(replay=fn)

    monkeypatch.setattr(engine_module.Graphs, "capture", capture)
    return captured


@pytest.mark.parametrize("int8", [False, True])
def test_captured_prefill_replays_each_images_prefix(monkeypatch, int8):
    """Where the steps are captured by hand the eager prefill is captured too: a shape's first image runs it as
    it comes, the second captures it, later ones copy their prefix in and replay; the first token is drawn
    outside the graph. The tokens must equal those of the engine that never captures the prefill, with int8 weights
    too."""
    model = quantize_int8(tiny_model()) if int8 else tiny_model()
    cond, mask, condition = tiny_inputs(model)
    a, b = (cond, mask, condition), (cond.flip(0), mask.flip(0), condition)  # one shape, other prefixes
    run = lambda engine, p: engine.generate(p[0], 16, emb_masks=p[1], condition=p[2], cfg_scale=4.0, top_k=50)
    plain = Engine(model, backend="eager")
    want = [torch.manual_seed(3) and run(plain, p) for p in (a, b, a)]
    assert not torch.equal(want[0], want[1])  # a stale prefix would show
    captured = hand_captured(monkeypatch)
    hand = Engine(model, backend="eager")
    prefills = []
    for i, p in enumerate((a, b, a)):
        torch.manual_seed(3)
        assert torch.equal(run(hand, p), want[i]), i
        prefills.append(captured.count("prefill"))
    assert hand.hand_capture and hand.runner.capture_prefill and prefills == [0, 1, 1]


def test_captured_condition_replays_each_images_inputs(monkeypatch):
    """prepare() (control encoder, prefix, control tokens) is captured where the steps are captured by hand, per set
    of inputs' shapes and settings: the first image runs it as it comes, the second captures it, later ones copy
    their inputs in and replay. A stand-in graph replays the captured function from the graph's own inputs, so a
    stale input shows as other tokens than those of the engine that never captures."""
    model = tiny_model()
    cond, mask, condition = tiny_inputs(model)
    a = (cond, mask, condition)
    b = (cond.flip(0), mask.flip(0), condition.flip(0))  # one shape, other inputs
    c = (cond[:1], mask[:1], condition[:1])  # another shape
    run = lambda engine, p, strength: engine.generate(p[0], 16, emb_masks=p[1], condition=p[2], cfg_scale=4.0,
                                                      top_k=50, control_strength=strength)
    order = [(a, 1.0), (b, 1.0), (a, 1.0), (b, 1.0), (a, 0.5), (a, 0.5), (c, 0.5), (c, 0.5), (b, 0.5)]
    plain = Engine(model, backend="eager")
    want = [torch.manual_seed(3) and run(plain, *o) for o in order]
    assert not torch.equal(want[0], want[1]) and not torch.equal(want[0], want[4])
    captured = hand_captured(monkeypatch)
    hand = Engine(model, backend="eager")
    graphs = []
    for i, o in enumerate(order):
        torch.manual_seed(3)
        assert torch.equal(run(hand, *o), want[i]), i
        graphs.append(captured.count("prepare"))
    # captured at a set's second image; a new control strength or shape runs eagerly first
    assert graphs == [0, 1, 1, 1, 1, 2, 2, 3, 3]


def test_prefill_captured_where_the_steps_are_and_it_runs_eagerly():
    hopper = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, builds=lambda *key: False)
    assert plan.make(plan.Situation(backend="cudagraph", **hopper)).prefill == "eager_graph"
    assert plan.make(plan.Situation(backend="inductor", **hopper)).prefill == "eager_graph"  # the fused block
    assert plan.make(plan.Situation(backend="inductor", batch=9, **hopper)).prefill == "compiled_block"
    assert plan.make(plan.Situation(compile_scope="step", compile_prefill=True, **hopper)).prefill == "compiled_whole"
    assert plan.make(plan.Situation(compile_scope="step", **hopper)).prefill == "eager"  # steps not captured by hand
    assert plan.make(plan.Situation(backend="eager", **hopper)).prefill == "eager"


def test_sampling_distribution_matches_reference():
    """Histograms of 2,000 first tokens from both samplers (CFG 2, temperature 1.5, top-k 8,
    top-p 0.9): a chi-square two-sample test over the surviving tokens must not reject at p = 0.001."""
    model = tiny_model(cls=8, seed=11, block_size=4)
    cond, mask, condition = tiny_inputs(model, B=1, valid=(6,))
    condition = condition[..., :32, :32]  # a 2x2 control grid keeps the 2,000 adapter passes cheap
    n = 2000
    kw = dict(emb_masks=mask.expand(n, -1), condition=condition.expand(n, -1, -1, -1), cfg_scale=2.0,
              temperature=1.5, top_k=8, top_p=0.9)
    torch.manual_seed(0)
    ref = generate(model, cond.expand(n, -1, -1), 1, **kw)[:, 0]
    torch.manual_seed(1)
    fast = Engine(model, backend="eager").generate(cond.expand(n, -1, -1), 1, **kw)[:, 0]
    values = torch.unique(torch.cat([ref, fast]))
    a = torch.stack([(ref == v).sum() for v in values]).double()
    b = torch.stack([(fast == v).sum() for v in values]).double()
    assert len(values) >= 2, "the test needs a non-degenerate distribution"
    chi2 = (((a - b) ** 2) / (a + b)).sum().item()
    dof = len(values) - 1
    # Wilson-Hilferty upper quantile of chi-square at p = 0.001 (z = 3.09).
    bound = dof * (1 - 2 / (9 * dof) + 3.09 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, f"chi2 {chi2:.1f} over {dof} dof exceeds {bound:.1f}"


def test_compiled_step_matches_eager():
    """torch.compile (inductor) of the whole step and the prefill on the CPU: the tiniest config, greedy."""
    model = tiny_model(n_layer=3, n_head=2, dim=32, block_size=4)
    cond, mask, condition = tiny_inputs(model)
    condition = condition[..., :32, :32]
    engine = Engine(model, backend="inductor", compile_prefill=True, compile_scope="step")
    tokens = engine.generate(cond, 4, emb_masks=mask, condition=condition, top_k=1)
    assert torch.equal(tokens, generate(model, cond, 4, emb_masks=mask, condition=condition, top_k=1))
    assert engine.compile_seconds > 0


def test_block_compiled_step_matches_reference():
    """compile_scope "block": one compiled block serves every layer (a single graph, no recompiles),
    teacher-forced logits stay within 1e-4 of the reference with CFG and a cfg_interval, and the
    compiled head draws what the eager step draws."""
    from torch._dynamo.utils import counters

    model = tiny_model(n_layer=3, n_head=2, dim=32, block_size=4)
    cond, mask, condition = tiny_inputs(model)
    condition = condition[..., :32, :32]
    forced = torch.randint(0, model.args.vocab_size, (2, 4), generator=torch.Generator().manual_seed(1))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=1, forced=forced)
    _, ref_logits = generate(model, cond, 4, return_logits=True, **kw)
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, backend="inductor", compile_scope="block")
    _, fast_logits = engine.generate(cond, 4, **kw)
    # Block and head: one graph each for the guided step (both CFG halves) and the conditional half; the
    # block at the prefill's shape.
    assert counters["stats"]["unique_graphs"] == 5
    for r, f in zip(ref_logits, fast_logits):
        r = r if r.shape == f.shape else r.chunk(2)[0]
        assert (r - f).abs().max().item() <= 1e-4
    # The compiled head keeps the eager random stream: the same seed draws the same tokens.
    draws = []
    for e in (engine, Engine(model, backend="eager")):
        torch.manual_seed(3)
        draws.append(e.generate(cond, 4, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=20))
    assert torch.equal(*draws)


def test_block_scope_prefill_runs_the_compiled_block():
    """Where the steps run the compiled block the prefill does too, from the first image (one graph more, at
    the prefill's shape), within 1e-4 of the reference's logits, the prefill's included; later images
    compile nothing."""
    from torch._dynamo.utils import counters

    model = tiny_model(n_layer=2, n_head=2, dim=32, block_size=4)
    cond, mask, condition = tiny_inputs(model)
    condition = condition[..., :32, :32]
    forced = torch.randint(0, model.args.vocab_size, (2, 3), generator=torch.Generator().manual_seed(2))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, forced=forced)
    _, ref_logits = generate(model, cond, 3, return_logits=True, **kw)
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, backend="inductor", compile_scope="block")
    graphs = []
    for image in range(2):
        _, fast_logits = engine.generate(cond, 3, **kw)
        graphs.append(counters["stats"]["unique_graphs"])
        for i, (r, f) in enumerate(zip(ref_logits, fast_logits)):
            assert (r - f).abs().max().item() <= 1e-4, (image, i)
    assert graphs == [3, 3]  # the block at the prefill's and the step's shape, the head
    assert engine.runner.prefill_ctx.block is engine.block_fn


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_prefill_through_the_compiled_block_on_cuda():
    """Past 8 images on CUDA the steps and the prefill run the compiled block, and the prefill's RoPE and cache write
    inside it are eager_ops_triton's kernel, which inductor launches (8b6a4aa had sent it to the CUDA C++ kernel's
    ctypes launch there, which dynamo cannot trace): float32 logits within 1e-4 of the reference's, the prefill's included."""
    model = tiny_model(n_layer=2, n_head=2, dim=32, block_size=4).cuda()
    cond, mask, condition = (t.cuda() for t in tiny_inputs(model, B=9))
    condition = condition[..., :32, :32]
    forced = torch.randint(0, model.args.vocab_size, (9, 3), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, forced=forced)
    _, ref_logits = generate(model, cond, 3, return_logits=True, **kw)
    torch._dynamo.reset()
    engine = Engine(model, backend="inductor", compile_scope="block")
    _, fast_logits = engine.generate(cond, 3, **kw)
    assert engine.runner.prefill_ctx.block is engine.block_fn is not None
    for i, (r, f) in enumerate(zip(ref_logits, fast_logits)):
        assert (r - f).abs().max().item() <= 1e-4, i


def text_partial_attention(q, k_cache, v_cache, key_valid, input_pos, fresh=None, text=None, **launch):
    """attention_triton's math for the compiled block (q and the step's key before RoPE), in PyTorch, the text's
    keys read only through the text partial: their values' sum and count, of score 0."""
    from fast_inference.model import apply_rotary_emb, rotations

    sums, counts, T = text
    k, v, freqs = fresh
    R, p = q.shape[0], int(input_pos)
    rot = rotations(freqs)
    q, k = (apply_rotary_emb(t.transpose(1, 2), rot).transpose(1, 2) for t in (q, k))  # (R, H, 1, hd)
    k_cache[:R, :, p], v_cache[:R, :, p] = k[:, :, 0], v[:, :, 0]
    scores = q @ k_cache[:R, :, T : p + 1].transpose(-1, -2) * q.shape[-1] ** -0.5  # (R, H, 1, keys)
    count = counts[:R, None, None, None]
    top = torch.maximum(scores.amax(-1, keepdim=True), torch.where(count > 0, 0.0, float("-inf")))
    w, text_w = (scores - top).exp(), (-top).exp()
    num = w @ v_cache[:R, :, T : p + 1] + text_w * sums[:R, :, None]
    return (num / (w.sum(-1, keepdim=True) + text_w * count)).to(q.dtype)


def test_text_partial_is_made_after_each_prefill(monkeypatch):
    """Where a decode attention kernel runs, the engine makes the text partial after every prefill (the values'
    sum and count of the attendable text keys, attention_triton.text_sums): an attention that reads the text only
    through it gives the reference's teacher-forced logits, for two captions of other lengths in a row (the
    first's sums, left over, would show) and with a cfg_interval. The plan is the CPU's with the Triton attention
    and torch's text sums in it; not where the RoPE table's text rows are not zero (its keys would not be)."""
    make = plan.make

    def with_attention(s):
        p = make(s)
        rows = lambda r: dataclasses.replace(r, attention="triton_split", attention_config=(4, 1, 1))
        return dataclasses.replace(p, text_sums="torch", guided=rows(p.guided), unguided=rows(p.unguided))

    monkeypatch.setattr(engine_module.plans, "make", with_attention)
    monkeypatch.setattr(engine_module.attention_triton, "decode_attention", text_partial_attention)
    monkeypatch.setattr(Engine, "compiled_block", lambda self: engine_module.run_block)  # eager on the CPU
    model = tiny_model(cls=8, seed=7, n_layer=2)
    engine = Engine(model, backend="inductor", compile_scope="block")
    for valid, seed in (((3, 8), 1), ((8, 1), 2)):
        cond, mask, condition = tiny_inputs(model, valid=valid)
        forced = torch.randint(0, model.args.vocab_size, (2, 5), generator=torch.Generator().manual_seed(seed))
        kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=2, forced=forced)
        _, want = generate(model, cond, 5, return_logits=True, **kw)
        _, got = engine.generate(cond, 5, **kw)
        assert engine.runner.cache.text[2] == model.args.cls_token_num
        for i, (r, f) in enumerate(zip(want, got)):
            r = r if r.shape == f.shape else r.chunk(2)[0]
            assert (r - f).abs().max().item() <= 1e-4, (valid, i)
    model.freqs_cis[0, 0, 0] = 1.0
    s = dataclasses.replace(engine.situation(2, True, 1.0, True, 13), device="cuda", capability=(9, 0))
    assert not s.text_prefix and make(s).guided.attention == "triton_split" and make(s).text_sums == "none"


def test_inductor_pdl_switch(monkeypatch):
    """On a PDL device, compiling turns on inductor's programmatic dependent launch for the process (its
    config and, for its compile workers, the environment); TORCHINDUCTOR_ENABLE_PDL=0 keeps it off; the
    CPU never gets it."""
    import torch._inductor.config as config

    if not hasattr(config.triton, "enable_pdl"):
        pytest.skip("this torch's inductor has no PDL option")
    monkeypatch.setattr(config.triton, "enable_pdl", False)
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "0")
    Engine.inductor_pdl(SimpleNamespace(device_pdl=True))
    assert config.triton.enable_pdl is False
    monkeypatch.delenv("TORCHINDUCTOR_ENABLE_PDL")
    Engine.inductor_pdl(SimpleNamespace(device_pdl=False))
    assert config.triton.enable_pdl is False and "TORCHINDUCTOR_ENABLE_PDL" not in os.environ
    Engine.inductor_pdl(SimpleNamespace(device_pdl=True))
    assert config.triton.enable_pdl is True and os.environ["TORCHINDUCTOR_ENABLE_PDL"] == "1"


def test_a_dropped_engine_is_freed_at_once():
    """No reference cycle holds an engine (its runner, plan, graphs): dropped, it is freed at once, not by the cycle
    collector, which could run in the middle of the next engine's capture and free its CUDA graphs there (a graph's
    reset during another's capture invalidates that capture: seen on an H200 with two engines in one process)."""
    import gc
    import weakref

    model = tiny_model()
    cond, mask, condition = tiny_inputs(model)
    engine = Engine(model, backend="inductor")
    engine.generate(cond, 4, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1)
    refs = [weakref.ref(o) for o in (engine, engine.runner, engine.plan, engine.graphs)]
    gc.disable()
    try:
        del engine
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        gc.enable()


def test_compile_static_takes_more_shapes_than_dynamos_default():
    """An engine compiles its block once per cache window and row count, and a process may hold several engines: more
    than dynamo's 8 graphs per function, which fullgraph=True turns into an error (seen on CUDA in one pytest run)."""
    import torch._dynamo

    config, before = torch._dynamo.config, torch._dynamo.config.recompile_limit
    # set and put back by hand: monkeypatch's undo deletes the name, which hides a config of torch's for good

    def scale(x):
        return x * 2

    shapes = range(1, 11)
    try:
        config.recompile_limit = 8
        compiled = engine_module.compile_static(scale, backend="eager")
        for n in shapes:
            assert torch.equal(compiled(torch.ones(n)), torch.full((n,), 2.0))
        torch._dynamo.reset()
        config.recompile_limit = 8  # as torch.compile alone: the same shapes fail
        plain = torch.compile(scale, fullgraph=True, dynamic=False, backend="eager")
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            for n in shapes:
                plain(torch.ones(n))
    finally:
        config.recompile_limit = before
        torch._dynamo.reset()
