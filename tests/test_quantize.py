"""Weight-only int8 (fast_inference/quantize.py): the rounding, the model's int8 projections, and the
fast engine on an int8 model against the reference sampler on the same model (CPU, fp32)."""
import copy

import pytest
import torch

from fast_inference.engine import Engine, run_block
from fast_inference.generate import generate, prepare
from fast_inference.model import Int8Linear
from fast_inference.quantize import quantize_int8, quantize_rows
from test_reference import tiny_inputs, tiny_model


def test_rows_round_to_nearest_within_half_a_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 1, 64)[:, None]
    w[5] = 0.0  # an all-zero row keeps a usable scale
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == w.dtype and q.abs().max() <= 127
    assert (q.abs().amax(1)[torch.arange(64) != 5] == 127).all()  # each row uses the whole range
    err = (w - q.float() * s[:, None]).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all() and s[5] > 0 and (q[5] == 0).all()
    qb, sb = quantize_rows(w.bfloat16())
    assert sb.dtype == torch.bfloat16 and qb.abs().max() <= 127


def dequantized(model):
    """A float copy of an int8 model whose projections hold q * scale (float32)."""
    for layer in model.layers:
        attn, ff = layer.attention, layer.feed_forward
        for mod, name in ((attn, "wqkv"), (attn, "wo"), (ff, "w2")):
            lin = getattr(mod, name)
            setattr(mod, name, torch.nn.Linear(lin.weight.shape[1], lin.weight.shape[0], bias=False))
            getattr(mod, name).weight.data = lin.weight.float() * lin.scales[:, None]
        ff.w13, ff.w13_scales = ff.w13.float() * ff.w13_scales[:, None], None
    out = model.output
    model.output = torch.nn.Linear(out.weight.shape[1], out.weight.shape[0], bias=False)
    model.output.weight.data = out.weight.float() * out.scales[:, None]
    return model


def test_int8_model_is_its_dequantized_weights():
    """Every per-step projection is int8 (the condition path is not), and the model computes what a
    float model with weights q * scale computes; the unquantized model differs by more."""
    model = tiny_model(cls=8, seed=2)
    quantized = quantize_int8(copy.deepcopy(model))
    layer = quantized.layers[0]
    assert all(isinstance(m, Int8Linear) for m in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w2,
                                                   quantized.output))
    assert layer.feed_forward.w13.dtype == torch.int8 and layer.feed_forward.w1 is None
    assert quantized.adapter_mlp.fc1.weight.dtype == torch.float32
    assert quantize_int8(quantized) is quantized  # a second call changes nothing
    cond, mask, condition = tiny_inputs(model)
    outs = []
    for m in (quantized, dequantized(copy.deepcopy(quantized)), model):
        p = prepare(m, cond, condition, mask, 4.0, 1.0)
        m.setup_caches(p.prefix.shape[0], p.prefix.shape[1] + 1, torch.float32)
        outs.append(m(p.prefix, torch.arange(p.prefix.shape[1]), p.key_valid(m.max_seq), p.controls))
    assert (outs[0] - outs[1]).abs().max() < 1e-4
    assert (outs[0] - outs[2]).abs().max() > 1e-3  # the quantization is visible


def test_engine_on_int8_model_matches_reference():
    model = quantize_int8(tiny_model(cls=8, seed=3))
    cond, mask, condition = tiny_inputs(model)
    forced = torch.randint(0, model.args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, cfg_interval=6)
    _, want = generate(model, cond, 12, forced=forced, return_logits=True, **kw)
    engine = Engine(model, backend="eager")
    _, got = engine.generate(cond, 12, forced=forced, **kw)
    for w, g in zip(want, got):
        assert ((w if w.shape == g.shape else w.chunk(2)[0]) - g).abs().max() <= 1e-4
    greedy = engine.generate(cond, 12, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1)
    assert torch.equal(greedy, generate(model, cond, 12, emb_masks=mask, condition=condition, cfg_scale=4.0, top_k=1))


def test_engine_never_compiles_int8_projections():
    """inductor compiles int8 projections into slow kernels: where the fused kernels do not run (here
    the CPU), the block scope runs the eager block and compiles nothing; the step scope is refused."""
    model = quantize_int8(tiny_model(cls=8, seed=5))
    cond, mask, condition = tiny_inputs(model)
    forced = torch.randint(0, model.args.vocab_size, (2, 6), generator=torch.Generator().manual_seed(6))
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0)
    _, want = generate(model, cond, 6, forced=forced, return_logits=True, **kw)
    engine = Engine(model, backend="inductor", compile_scope="block")
    _, got = engine.generate(cond, 6, forced=forced, **kw)
    assert engine.runner.contexts[True].block.func is run_block and engine.block_fn is None
    assert max((w - g).abs().max().item() for w, g in zip(want, got)) <= 1e-4
    with pytest.raises(ValueError, match="compile_scope 'block'"):
        Engine(model, backend="inductor", compile_scope="step")
