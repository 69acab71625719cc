"""The window kernels (attention_triton.window_attention, inputs_triton.window_inputs) wired into the two callers whose
rows sit at their own positions: the speculative pass (speculative.py, L = window) and the server's step
(continuous.py, L = 1), where the plan takes them (plan.WINDOW_KERNELS, the window_* overrides). On the CPU the
Triton interpreter runs them: greedy tokens of a pass equal the reference's, and a server's requests get the plain
engine's tokens; on a CUDA device (`-k cuda`) the pass's fp32 greedy tokens equal the plain engine's at GPT-XL's
width, through inductor's compiled block and the captured pass."""
import dataclasses

import pytest
import torch

import early
import interpret
from fast_inference import engine, plan
from fast_inference.kernels import attention_triton

pytest.importorskip("triton")


def test_the_plan_takes_them_by_its_default_and_by_the_overrides():
    hopper = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, draft_window=16)
    p = plan.make(hopper)
    assert (p.jacobi.attention, p.jacobi.inputs) == ("triton" if plan.WINDOW_KERNELS else "sdpa",
                                                      "triton" if plan.WINDOW_KERNELS else "model")
    on = (("window_attention", "triton"), ("window_inputs", "triton"))
    p = plan.make(dataclasses.replace(hopper, overrides=on))
    assert (p.jacobi.attention, p.jacobi.inputs) == ("triton", "triton")
    assert "Triton window attention" in plan.explain(p) and "window_inputs" in plan.explain(p)
    server = plan.make(dataclasses.replace(hopper, overrides=on, draft_window=0, own_positions=True)).own_positions
    assert (server.attention, server.inputs) == ("decode" if plan.SERVER_DECODE else "triton", "triton")
    window = on + (("server_attention", "window"),)
    assert "Triton window attention" in plan.explain_server(dataclasses.replace(hopper, overrides=window))
    assert ("decode attention, a position per row" if plan.SERVER_DECODE else "Triton window attention") in \
        plan.explain_server(dataclasses.replace(hopper, overrides=on))
    off = plan.make(dataclasses.replace(hopper, overrides=(("window_attention", "sdpa"),)))
    assert off.jacobi.attention == "sdpa"
    fused = on + (("window_block", "fused"),)
    p = plan.make(dataclasses.replace(hopper, overrides=fused))  # 2 x 1 image x 16 queries: the fused block
    assert p.jacobi.block == "fused" and p.jacobi.rows.rows == 32 and "fused (Triton dot)" in plan.explain(p)
    assert {proj.pdl for _, proj in p.jacobi.rows.projections} == {plan.NONE}  # its dot projections without PDL
    late = plan.make(dataclasses.replace(hopper, overrides=fused + (("window_block_pdl", "late"),)))
    assert {proj for _, proj in late.jacobi.rows.projections} == {plan.Projection("triton_dot", plan.LATE)}
    assert "fused (Triton dot, PDL late) blocks" in plan.explain(late)
    with pytest.raises(plan.PlanError, match=r"window_block_pdl=gemv\|late\|first needs PDL"):
        plan.make(dataclasses.replace(hopper, capability=(8, 0), overrides=fused + (("window_block_pdl", "first"),)))
    # the GEMV path under PDL in its own mode (weights before the wait), without PDL where none is asked
    assert plan.pass_rows(4, plan.LATE).projection("wo") == plan.Projection("triton_gemv", plan.GEMV_PDL)
    assert plan.pass_rows(4).projection("wo") == plan.Projection("triton_gemv")
    assert plan.pass_rows(4, gemv_pdl=True).projection("wo") == plan.Projection("triton_gemv", plan.GEMV_PDL)
    assert plan.pass_rows(32, gemv_pdl=True).projection("wo") == plan.Projection("triton_dot")  # dots: pdl's alone
    p = plan.make(dataclasses.replace(hopper, overrides=fused, batch=8))  # 256 rows: the compiled block
    assert p.jacobi.block == "compiled" and p.jacobi.rows is None
    with pytest.raises(plan.PlanError, match="window_block=fused needs"):
        plan.make(dataclasses.replace(hopper, overrides=(("window_attention", "sdpa"), ("window_block", "fused"))))
    # a server's steps: the fused block's kernels up to FUSED_ROWS rows where the window kernels run (SERVER_FUSED),
    # inductor's block by the override server_block=compiled or without the window kernels
    steps = dataclasses.replace(hopper, draft_window=0, own_positions=True)
    server = plan.make(dataclasses.replace(steps, overrides=on)).own_positions
    assert server.fused_rows == (plan.FUSED_ROWS if plan.SERVER_FUSED else 0)
    sdpa = (("window_attention", "sdpa"),)
    assert plan.make(dataclasses.replace(steps, overrides=sdpa)).own_positions.fused_rows == 0
    assert plan.make(dataclasses.replace(steps, overrides=on + (("server_block", "compiled"),))).own_positions \
        .fused_rows == 0
    server = plan.make(dataclasses.replace(steps, overrides=on + (("server_block", "fused"),))).own_positions
    assert server.fused_rows == plan.FUSED_ROWS and "fused (Triton, up to 16 rows" in plan.describe_own_positions(server)
    assert server.pdl == plan.NONE and server.gemv_pdl  # by default the GEMVs under PDL, the dots without
    # past the fused rows, inductor's block with w2 + residual in the down kernel, as the plain steps at those rows
    assert list(server.down_rows) == [r for r in range(1, 129) if plan.serves_down(steps, r)]
    assert server.down_pdl == plan.LATE and "down kernel at 17-64 rows" in plan.describe_own_positions(server)
    assert not plan.make(dataclasses.replace(steps, device="cpu", capability=None)).own_positions.down_rows
    assert not plan.make(dataclasses.replace(steps, overrides=on, int8=True)).own_positions.down_rows
    assert not plan.make(dataclasses.replace(steps, overrides=on + (("server_down", "off"),))).own_positions.down_rows
    assert "up to 16 rows, GEMVs under PDL" in plan.describe_own_positions(server)
    # the plain steps' decode attention, a position per row, by default where the window kernels run (SERVER_DECODE);
    # the window kernel by the override server_attention=window, the model's SDPA without the window kernels
    server = plan.make(dataclasses.replace(steps, overrides=on)).own_positions
    assert server.attention == ("decode" if plan.SERVER_DECODE else "triton")
    server = plan.make(dataclasses.replace(steps, overrides=on + (("server_attention", "decode"),))).own_positions
    assert server.attention == "decode" and "decode attention, a position per row" in plan.describe_own_positions(server)
    assert plan.make(dataclasses.replace(steps, overrides=on + (("server_attention", "window"),))).own_positions \
        .attention == "triton"
    assert plan.make(dataclasses.replace(steps, overrides=sdpa)).own_positions.attention == "sdpa"
    # the plain steps' L2 prefetcher beside them: by default beside the fused block's steps (up to its rows), by the
    # override server_prefetch=on beside every step size, where the decode attention counts; off: none
    assert server.prefetch_rows == (plan.FUSED_ROWS if plan.SERVER_PREFETCH else 0)
    assert ("with the L2 prefetcher beside it up to 16 rows" in plan.describe_own_positions(server)) == \
        plan.SERVER_PREFETCH
    assert plan.make(dataclasses.replace(steps, overrides=on + (("server_prefetch", "off"),))).own_positions \
        .prefetch_rows == 0
    assert plan.make(dataclasses.replace(steps, overrides=on + (("server_block", "compiled"),))).own_positions \
        .prefetch_rows == 0  # no fused rows: none by default
    assert plan.make(dataclasses.replace(steps, overrides=on + (("server_attention", "window"),))).own_positions \
        .prefetch_rows == 0  # the window kernel does not count: none by default
    server = plan.make(dataclasses.replace(steps, overrides=on + (("server_prefetch", "on"),))).own_positions
    assert server.prefetch_rows >= 2 * max(server.buckets)
    assert "with the L2 prefetcher beside it up to" in plan.describe_own_positions(server)
    prefetch = (("server_prefetch", "on"),)
    for refused in (dict(overrides=on + (("server_attention", "window"),) + prefetch),  # the window kernel: no count
                    dict(overrides=(("window_attention", "sdpa"),) + prefetch),
                    dict(overrides=on + prefetch, capability=(8, 0))):  # no PDL: no bulk prefetch before sm_90
        with pytest.raises(plan.PlanError, match="server_prefetch=on needs"):
            plan.make(dataclasses.replace(steps, **refused))
    with pytest.raises(plan.PlanError, match="server_attention=decode needs"):
        plan.make(dataclasses.replace(steps, overrides=(("window_attention", "sdpa"), ("server_attention", "decode"))))
    server = plan.make(dataclasses.replace(steps, overrides=on + (("window_block_pdl", "first"),))).own_positions
    assert server.pdl == plan.FIRST and "up to 16 rows, PDL first" in plan.describe_own_positions(server)
    server = plan.make(dataclasses.replace(steps, overrides=on + (("window_block_pdl", "off"),))).own_positions
    assert (server.pdl, server.gemv_pdl) == (plan.NONE, False)
    ampere = dataclasses.replace(steps, capability=(8, 0))
    assert not plan.make(dataclasses.replace(ampere, overrides=on)).own_positions.gemv_pdl  # no PDL before sm_90
    with pytest.raises(plan.PlanError, match="needs PDL"):
        plan.make(dataclasses.replace(ampere, overrides=on + (("window_block_pdl", "gemv"),)))
    with pytest.raises(plan.PlanError, match="server_block=fused needs"):
        plan.make(dataclasses.replace(steps, overrides=(("window_attention", "sdpa"), ("server_block", "fused"))))
    # the window attention's splits: folded into its one launch by default, the merge kernel's form by the override
    assert p.jacobi.splits == ("fold" if plan.WINDOW_FOLD else "merge") and "one launch" in plan.explain(
        plan.make(dataclasses.replace(hopper, overrides=on + (("window_splits", "fold"),))))
    merge = on + (("window_splits", "merge"),)
    p = plan.make(dataclasses.replace(hopper, overrides=merge))
    server = plan.make(dataclasses.replace(hopper, overrides=merge, draft_window=0, own_positions=True)).own_positions
    assert p.jacobi.splits == server.splits == "merge" and "a merge kernel" in plan.explain(p)
    assert engine.window_attention(p.jacobi).keywords == dict(fold=False)
    assert engine.window_attention(dataclasses.replace(p.jacobi, splits="fold")) is attention_triton.window_attention
    assert engine.window_attention(off.jacobi) is None
    for where in (dict(device="cpu", capability=None), dict(backend="cudagraph", draft_window=0, own_positions=True),
                  dict(dim=80 * 20)):  # no Triton on CUDA, the cudagraph backend, a head dim of 80
        with pytest.raises(plan.PlanError, match="window_attention=triton needs"):
            plan.make(dataclasses.replace(hopper, overrides=on, **where))


SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import dataclasses
import torch
from fast_inference import engine as engine_module, plan
from fast_inference.continuous import Batch
from fast_inference.engine import Engine
from fast_inference.generate import generate
import functools
from fast_inference.kernels import attention_triton, inputs_triton
from fast_inference.kernels.block import fused_block
from fast_inference.model import Context
from test_continuous import alone, requests, run
from test_reference import greedy_case, tiny_model

make = plan.make


FUSED = False  # the pass's block: the fused block's kernels at its rows
SPLITS = "fold"  # the window attention's form: its splits folded into one launch, or a split per tile + merge
SERVER_FUSED = False  # the server's steps on the fused block's kernels (server_block=fused)
SERVER_ATTENTION = "triton"  # the server's attention: the window kernel, or the decode kernels (server_attention=decode)


def with_window_kernels(s):
    # the plan of the situation with the window kernels taken, as a CUDA device with Triton would (the interpreter
    # runs them here); the pass and the server's steps on the eager backend
    p = make(s)
    if p.jacobi is not None:
        fused = dict(block="fused", rows=plan.pass_rows(s.rows * s.draft_window)) if FUSED else {}
        p = dataclasses.replace(p, jacobi=dataclasses.replace(p.jacobi, attention="triton", inputs="triton",
                                                              splits=SPLITS, **fused))
    if p.own_positions is not None:
        own = dataclasses.replace(p.own_positions, attention=SERVER_ATTENTION, inputs="triton", splits="fold",
                                  fused_rows=plan.FUSED_ROWS if SERVER_FUSED else 0)
        p = dataclasses.replace(p, own_positions=own)
    return p


engine_module.plans.make = with_window_kernels
checked = 0
# the pass: greedy tokens equal the reference's, windows shorter and longer than what is left of the image
model, cond, n, kw = greedy_case()
ref = generate(model, cond, n, **kw)
for window, FUSED, SPLITS in ((4, False, "merge"), (16, False, "fold"), (4, True, "fold"), (16, True, "merge")):
    engine = Engine(model, backend="eager", speculative="jacobi", draft_window=window)
    got = engine.generate(cond, n, **kw)
    r = engine.runner
    attention = r.pass_ctx.attention
    assert (attention is attention_triton.window_attention if SPLITS == "fold" else
            attention.func is attention_triton.window_attention and attention.keywords == dict(fold=False))
    assert r.pass_inputs is inputs_triton.window_inputs
    assert (getattr(r.pass_ctx.block, "func", None) is fused_block) == FUSED
    assert torch.equal(got, ref), (window, got, ref)
    checked += 1
# the fused block at a pass's rows (2 images under CFG x 8 queries, dot path), each row at its own ragged positions,
# a window past the image's end: the blocks' output and the caches as the model's own blocks with SDPA
B, L, N = 2, 8, model.args.block_size  # 32 rows: block_triton.DOT_CONFIG_ROWS[32]
T = model.args.cls_token_num
model.fuse_projections()  # as the Engine does
model.setup_caches(2 * B, T + N, torch.float32)
g = torch.Generator().manual_seed(7)
for layer in model.layers:
    for c in (layer.attention.kv_cache.k_cache, layer.attention.kv_cache.v_cache):
        c.copy_(torch.randn(c.shape, generator=g))
saved = [(l.attention.kv_cache.k_cache.clone(), l.attention.kv_cache.v_cache.clone()) for l in model.layers]
n_img = torch.tensor([5, N - 2])  # the second image's window runs past its end
pos = (T + n_img[:, None] - 1 + torch.arange(L)).clamp(max=T + N - 1)
pos = torch.cat([pos, pos])
x = torch.randn(2 * B, L, model.args.dim, generator=g)
key_valid = torch.ones(2 * B, model.max_seq, dtype=torch.bool)
key_valid[:, :T] = torch.rand(2 * B, T, generator=g) > 0.5
controls = torch.randn(3, 2 * B, N, model.args.dim, generator=g)
want = model.blocks(x, pos, key_valid, controls)
want_caches = [(l.attention.kv_cache.k_cache.clone(), l.attention.kv_cache.v_cache.clone()) for l in model.layers]
for layer, (k, v) in zip(model.layers, saved):
    layer.attention.kv_cache.k_cache.copy_(k)
    layer.attention.kv_cache.v_cache.copy_(v)
masks = attention_triton.chain_masks(L).expand(2 * B, L)
ctx = Context(block=functools.partial(fused_block, rows=plan.pass_rows(2 * B * L)), block_adds_control=True,
              attention=attention_triton.window_attention, window=(pos[:, 0].contiguous(), masks))
got = model.blocks(x, pos, key_valid, controls, ctx=ctx)
inside = (pos < T + N - 1)[..., None]  # queries whose key no later one of the window overwrites
worst = (got - want).abs().masked_fill(~inside, 0).max().item()
for (k, v), (wk, wv) in zip([(l.attention.kv_cache.k_cache, l.attention.kv_cache.v_cache) for l in model.layers],
                            want_caches):
    worst = max(worst, (k - wk)[:, :, : T + N - 1].abs().max().item(), (v - wv)[:, :, : T + N - 1].abs().max().item())
assert worst < 1e-4, worst
checked += 1
# the server: requests joining a running batch at other positions get the plain engine's tokens, its steps (2 to 8
# rows: GEMV and dot paths) on the compiled or eager blocks, then on the fused block's kernels
model = tiny_model()
rs = requests(model)[:3]
want = [alone(model, r) for r in rs]
blocks_run = []  # the fused block's calls in the server's steps
engine_module.fused_block = lambda *a, **k: (blocks_run.append(a[0]), fused_block(*a, **k))[1]
decode_calls = []  # the decode attention's calls in the server's steps, and whether each took a position per row
decode_attention = attention_triton.decode_attention
attention_triton.decode_attention = lambda *a, **k: (decode_calls.append(a[4].numel() > 1), decode_attention(*a, **k))[1]
for SERVER_FUSED, SERVER_ATTENTION in ((False, "triton"), (True, "triton"), (False, "decode"), (True, "decode")):
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    decode = SERVER_ATTENTION == "decode"
    assert batch.runner.ctx.attention is (None if decode else attention_triton.window_attention)
    assert (batch.runner.step_attention is not None) == decode
    decode_calls.clear(), blocks_run.clear()
    assert batch.runner.inputs_fn is inputs_triton.window_inputs
    assert batch.runner.fused_rows == (plan.FUSED_ROWS if SERVER_FUSED else 0)
    got = run(batch, {0: rs[:2], 3: [rs[2]]})
    assert bool(blocks_run) == SERVER_FUSED
    assert decode_calls and all(decode_calls) if decode else not decode_calls
    for i in range(3):
        assert torch.equal(got[i], want[i]), (SERVER_FUSED, SERVER_ATTENTION, i)
        checked += 1
print("ok", checked)
"""


def test_pass_and_server_step_on_window_kernels_in_interpreter():
    """Jacobi passes of 4 and 16 positions (the 16-token image: a window past its end) give the reference's greedy
    tokens through the window kernels, and passes of 4 and 16 through the fused block's kernels at the pass's rows too
    (16 and 64 rows: the second past the plan's PASS_FUSED_ROWS, which the script overrides); the fused block at 2
    images x 8 ragged queries under CFG (32 rows, their own tilings) gives the model's blocks' output and caches
    (within 1e-4); three requests joining a server's batch at steps 0, 0 and 3 get the plain engine's tokens (their
    own seeds and settings), its steps on the eager blocks and on the fused block's kernels (server_block=fused)."""
    out = early.result(SCRIPT, interpret.ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", "17"], out.stdout


def test_the_plan_keys_a_servers_draws_where_it_draws_with_triton():
    """A server's draws are keyed (draw_triton.draw_images) where the plan draws with Triton (inductor on CUDA), and
    come from each request's generator elsewhere (the cudagraph backend's CUDA C++ draw, the CPU); explain says so."""
    hopper = plan.Situation(device="cuda", capability=(9, 0), dtype=torch.bfloat16, own_positions=True,
                            builds=lambda *key: True)
    p = plan.make(hopper)
    assert (p.draw, p.own_positions.draw) == ("triton", "keyed") and "keyed by its seed" in plan.explain(p)
    for where in (dict(backend="cudagraph"), dict(device="cpu", capability=None)):
        o = plan.make(dataclasses.replace(hopper, **where)).own_positions
        assert o.draw == "generator" and "from its own generator" in plan.describe_own_positions(o)


KEYED_SCRIPT = r"""
import interpret  # first: the interpreter without its re-patching per call (tests/interpret.py)
import dataclasses
from types import SimpleNamespace
import torch
from fast_inference import engine as engine_module, plan
from fast_inference.continuous import Batch
from fast_inference.engine import Engine
from fast_inference.kernels import draw_triton
from test_continuous import alone, requests, run
from test_reference import tiny_model

make = plan.make
GRAPHS = False  # the server's steps through stand-in graphs that replay the captured function


def with_triton_draw(s):
    # the plan with draw_triton's kernels where a CUDA device with Triton takes them (top-p 1); run by the interpreter
    p = make(s)
    if p.draw == "torch" and s.top_p >= 1.0:
        p = dataclasses.replace(p, draw="triton")
    if p.own_positions is not None:
        p = dataclasses.replace(p, own_positions=dataclasses.replace(p.own_positions, draw="keyed", graph=GRAPHS))
    return p


def capture(self, key, fn, state=None):
    captured.append(key)
    fn()
    self.graphs[key] = SimpleNamespace(replay=fn)


model = tiny_model(vocab_size=300)
rs = requests(model)[:4]  # seeds 1 to 4; rs[1] two images (temperature 0.7, top-k 5), rs[2] top-p 0.8 (its generator)
rs[3] = dataclasses.replace(rs[3], cfg_scale=2.5, temperature=1.3)
# two more of rs[0]'s join key (one image, its inputs' shapes, condition type and strength): a captured join, a replay
rs += [dataclasses.replace(rs[0], seed=5, cfg_scale=3.0, top_k=7), dataclasses.replace(rs[1], seed=6, num_images=1)]
plain = alone(model, rs[0])  # sampling.py's draw with torch's generator
engine_module.plans.make = with_triton_draw
engine_module.Graphs.capture = capture
want = [alone(model, r) for r in rs]
assert not torch.equal(plain, want[0])  # the engine alone drew with the Triton draw
checked = 0
for GRAPHS in (False, True):
    captured = []
    batch = Batch(Engine(model, backend="eager"), rs[0].shape, capacity=4)
    assert batch.runner.keyed
    got = run(batch, {0: rs[:2], 3: [rs[2]], 5: rs[3:]})  # rs[3:] join once slots are free
    assert bool(captured) == GRAPHS and (batch.join_key(rs[0]) in captured) == GRAPHS
    for i in range(len(rs)):
        assert torch.equal(got[i], want[i]), (GRAPHS, i, got[i], want[i])
        checked += 1
print("ok", checked)
"""


def test_server_draws_with_each_requests_key_in_interpreter():
    """Where the plan takes the Triton draw, a server's requests joining a running batch at other steps (seeds of their
    own, one of two images, their own cfg scale, temperature and top-k; one with top-p < 1 on its generator beside
    them) get the tokens the engine gives each alone with its seed and the same draw, the steps and joins run as they
    come and through stand-in graphs (the draw inside the step; three joins of one key: as it comes, captured,
    replayed)."""
    out = early.result(KEYED_SCRIPT, interpret.ENV)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["ok", "12"], out.stdout


# The CUDA pass cases: (window, the pass's block, images). The fused block runs up to plan.PASS_FUSED_ROWS rows, so
# its L = 16 case is one image (2 x 16 = 32 rows); at 2 images (64 rows) the plan takes the compiled block.
CUDA_PASSES = [(4, "compiled", 2), (16, "compiled", 2), (4, "fused", 2), (16, "fused", 1)]


def cuda_pass_situation(window, images):
    """The plan's situation of a CUDA pass case (the Engine's on an H100: fp32, GPT-XL's width, the window kernels)."""
    return plan.Situation(device="cuda", capability=(9, 0), dtype=torch.float32, batch=images, dim=1280, n_head=20,
                          max_seq=8 + 256, draft_window=window)


@pytest.mark.parametrize("window,block,images", CUDA_PASSES)
def test_the_cuda_pass_cases_plan_the_block_they_name(window, block, images):
    """Each CUDA pass case runs the block it names: the plan takes window_block=fused only up to PASS_FUSED_ROWS rows
    (the [16-fused] case at 2 images, 64 rows, planned the compiled block and failed its own check on an H100)."""
    on = plan.parse_overrides(f"window_attention=triton,window_inputs=triton,window_block={block}")
    p = plan.make(dataclasses.replace(cuda_pass_situation(window, images), overrides=on))
    assert (p.jacobi.attention, p.jacobi.inputs, p.jacobi.block) == ("triton", "triton", block)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window,block,images", CUDA_PASSES)
def test_pass_on_window_kernels_gives_the_plain_engines_greedy_tokens_on_cuda(window, block, images):
    """fp32 at GPT-XL's width (1,280, 20 heads, 2 blocks), 256 tokens: the speculative engine with the window kernels
    (inductor's compiled block or the fused block's kernels, the pass captured) against the plain engine, greedy."""
    from fast_inference.engine import Engine
    from test_reference import tiny_inputs, tiny_model

    model = tiny_model(dim=1280, n_head=20, n_layer=2, block_size=256, seed=5).to("cuda")
    cond, mask, condition = (t.to("cuda") for t in tiny_inputs(model, B=images))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1)
    want = Engine(model, backend="inductor").generate(cond, 256, **kw)
    engine = Engine(model, backend="inductor", speculative="jacobi", draft_window=window,
                    overrides=("window_attention=triton", "window_inputs=triton", f"window_block={block}", "jacobi=on"))
    got = engine.generate(cond, 256, **kw)
    assert (engine.plan.jacobi.attention, engine.plan.jacobi.inputs, engine.plan.jacobi.block) == (
        "triton", "triton", block)
    assert torch.equal(got, want)
    assert torch.equal(engine.generate(cond, 256, **kw), want)  # replayed


EARLY = {"test_pass_and_server_step_on_window_kernels_in_interpreter": (SCRIPT, interpret.ENV),
         "test_server_draws_with_each_requests_key_in_interpreter": (KEYED_SCRIPT, interpret.ENV)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("block", ["fused", "compiled", "fused,window_block_pdl=first", "fused,window_block_pdl=off",
                                   "fused,server_attention=window", "compiled,server_attention=window",
                                   "fused,server_prefetch=on", "compiled,server_prefetch=on"])
def test_server_steps_on_window_kernels_give_the_plain_engines_tokens_on_cuda(block):
    """fp32 at GPT-XL's width: requests joining a server's batch on the window kernels (captured steps per bucket), on
    the fused block's kernels (under PDL too) or inductor's block, get the plain engine's greedy tokens: with the
    plain steps' decode attention at a position per row (the default), with the window kernel's, and with the L2
    prefetcher beside the steps (which writes nothing they read, and must not wait for a count that never comes)."""
    from fast_inference.continuous import Batch, Request
    from fast_inference.engine import Engine
    from test_continuous import run
    from test_reference import tiny_inputs, tiny_model

    model = tiny_model(dim=1280, n_head=20, n_layer=2, block_size=64, seed=6).to("cuda")
    cond, mask, condition = (t.to("cuda") for t in tiny_inputs(model, B=2))
    rs = [Request(cond=cond[b : b + 1], mask=mask[b : b + 1], control=condition[b], seed=b, top_k=1) for b in (0, 1)]
    want = [Engine(model).generate(r.cond, r.num_tokens, emb_masks=r.mask, cfg_scale=r.cfg_scale,
                                   condition=r.control[None], top_k=1) for r in rs]
    on = ("window_attention=triton", "window_inputs=triton")
    engine = Engine(model, overrides=on + tuple(f"server_block={block}".split(",")))
    batch = Batch(engine, rs[0].shape, capacity=2)
    own = engine.plan.own_positions
    attention = "triton" if "server_attention=window" in block else "decode"
    assert (own.attention, own.inputs, own.fused_rows > 0) == (attention, "triton", block.startswith("fused"))
    assert own.prefetch_rows == (4 if "server_prefetch=on" in block else own.fused_rows if
                                 "server_attention=window" not in block and plan.SERVER_PREFETCH else 0)
    done = run(batch, {0: rs[:1], 5: rs[1:]})  # the second request joins 5 steps later, at other positions
    for i in range(2):
        assert torch.equal(done[i].cpu(), want[i].cpu()), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("attention", ["window", "decode", "decode,server_prefetch=on"])
def test_server_steps_past_the_fused_rows_give_the_plain_engines_tokens_on_cuda(attention):
    """fp32 at GPT-XL's width: nine requests joining at consecutive steps fill a bucket of 16 images (32 rows under CFG:
    inductor's block with w2 in the down kernel, as the plain steps at those rows), on the window attention or the
    decode attention at a position per row (with the L2 prefetcher too, paced by its counts and the down kernel's);
    each gets the plain engine's greedy tokens."""
    from fast_inference.continuous import Batch, Request
    from fast_inference.engine import Engine
    from test_continuous import run
    from test_reference import tiny_inputs, tiny_model

    model = tiny_model(dim=1280, n_head=20, n_layer=2, block_size=64, seed=6).to("cuda")
    cond, mask, condition = (t.to("cuda") for t in tiny_inputs(model, B=9))
    rs = [Request(cond=cond[b : b + 1], mask=mask[b : b + 1], control=condition[b], seed=b, top_k=1) for b in range(9)]
    want = [Engine(model).generate(r.cond, r.num_tokens, emb_masks=r.mask, cfg_scale=r.cfg_scale,
                                   condition=r.control[None], top_k=1) for r in rs]
    engine = Engine(model, overrides=tuple(f"server_attention={attention}".split(",")))
    batch = Batch(engine, rs[0].shape, capacity=16)
    assert list(engine.plan.own_positions.down_rows) == list(range(17, 65))
    done = run(batch, {i: [r] for i, r in enumerate(rs)})  # one joins at each step: all nine decode together
    assert rs[0].num_tokens > 9 and 16 in batch.runner.graphs  # steps at the bucket of 16 images
    for i in range(9):
        assert torch.equal(done[i].cpu(), want[i].cpu()), i


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_server_draws_with_each_requests_key_on_cuda():
    """fp32 on CUDA with Triton (inductor: the Triton draw in the plain engine and in the server's captured steps):
    sampled requests joining a server's batch at other steps, one of two images, get the tokens the engine gives each
    alone with its seed."""
    from fast_inference.continuous import Batch
    from test_continuous import requests, run
    from test_reference import tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(seed=6).cuda()
    rs = [dataclasses.replace(r, cond=r.cond.cuda(), mask=r.mask.cuda(), control=r.control.cuda(), top_k=50 if i else 0)
          for i, r in enumerate(requests(model)[:2])]  # seeds 1 and 2, the second of two images
    rs.append(dataclasses.replace(rs[0], seed=7, cfg_scale=2.5, temperature=1.3))
    want = []
    for r in rs:
        n = r.num_images
        torch.manual_seed(r.seed)
        want.append(engine.Engine(model).generate(
            r.cond.repeat_interleave(n, 0), r.num_tokens, emb_masks=r.mask.repeat_interleave(n, 0),
            cfg_scale=r.cfg_scale, condition=r.control[None].expand(n, -1, -1, -1), temperature=r.temperature,
            top_k=r.top_k))
    batch = Batch(engine.Engine(model), rs[0].shape, capacity=4)
    assert batch.runner.keyed
    got = run(batch, {0: rs[:1], 2: rs[1:2], 5: rs[2:]})
    for i in range(3):
        assert torch.equal(got[i].cpu(), want[i].cpu()), i
