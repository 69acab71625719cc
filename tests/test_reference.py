"""The reference sampler against the official outputs (tests/data fixtures), and its edge cases."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA
from fast_inference.generate import generate, prepare
from fast_inference.model import Context, EagerOps, ModelArgs, Transformer
from weights import recipe_state_dict

FIXTURES = json.load(open(os.path.join(DATA, "fixtures.json")))


def build_fixture_model(name):
    fx = FIXTURES[name]
    model = Transformer(ModelArgs(**fx["model_args"])).eval()
    if fx["model_args"]["cls_token_num"] != 120:
        # The fixture README: this one's null caption has cls_token_num rows, not 120.
        n = fx["model_args"]["cls_token_num"]
        buf = model.cls_embedding.uncond_embedding
        model.cls_embedding.uncond_embedding = buf[:n].clone()
    model.load_state_dict(recipe_state_dict(model))
    return model, fx, load_file(os.path.join(DATA, f"{name}.safetensors"))


def run_fixture(model, fx, data):
    return generate(
        model, data["caption_emb_left_padded"], data["tokens"].shape[1], emb_masks=data["emb_mask_left_padded"],
        cfg_scale=fx["cfg_scale"], cfg_interval=fx["cfg_interval"], condition=data["condition"],
        control_strength=fx["control_strength"], temperature=fx["temperature"], top_k=fx["top_k"],
        top_p=fx["top_p"], return_logits=True,
    )


@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_official_fixture(name):
    model, fx, data = build_fixture_model(name)
    tokens, logits = run_fixture(model, fx, data)
    assert torch.equal(tokens, data["tokens"]), "greedy tokens differ from the official ones"
    for call, expected in enumerate(data["last_logits"]):
        diff = (logits[call] - expected).abs().max().item()
        assert diff <= 1e-4, f"call {call}: logits differ by {diff}"


def tiny_model(model_type="t2i", cls=8, seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(n_layer=3, n_head=2, dim=64, block_size=16, cls_token_num=cls, caption_dim=32,
                model_type=model_type, condition_type="hed")
    args.update(kw)
    model = Transformer(ModelArgs(**args)).eval()
    model.load_state_dict(recipe_state_dict(model))
    return model


def tiny_inputs(model, B=2, valid=(3, 8)):
    g = torch.Generator().manual_seed(1)
    T = model.args.cls_token_num
    cond = torch.randn(B, T, model.args.caption_dim, generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, v in enumerate(valid[:B]):
        mask[b, T - v:] = 1
    cond = cond * mask[..., None]
    condition = torch.rand(B, 3, 64, 64, generator=g) * 2 - 1
    return cond, mask, condition


def greedy_case():
    """The speculative tests' greedy case: a tiny t2i model of seed 3, tiny_inputs' two captions and controls, CFG 4
    and top-k 1 -> (model, cond, tokens per image, generate's keywords)."""
    model = tiny_model(cls=8, seed=3)
    cond, mask, condition = tiny_inputs(model)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, control_strength=0.8, top_k=1)
    return model, cond, model.args.block_size, kw


def cuda_tiny(B, seed, tokens=12):
    """The GPU tests' model and inputs: 2 blocks at GPT-XL's width (1,280, 20 heads) in bf16 on CUDA, tiny_inputs for
    B images, and `tokens` forced tokens per image -> (model, cond, mask, condition, forced)."""
    model = tiny_model(dim=1280, n_head=20, n_layer=2, seed=seed).to("cuda", torch.bfloat16)
    cond, mask, condition = (t.cuda() for t in tiny_inputs(model, B=B))
    forced = torch.randint(0, model.args.vocab_size, (B, tokens), generator=torch.Generator().manual_seed(seed))
    return model, cond, mask, condition, forced.cuda()


def test_seeded_sampling_is_deterministic():
    model = tiny_model()
    cond, mask, condition = tiny_inputs(model)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(generate(model, cond, 16, emb_masks=mask, condition=condition, top_k=100))
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(124)
    other = generate(model, cond, 16, emb_masks=mask, condition=condition, top_k=100)
    assert not torch.equal(runs[0], other)


def test_all_padding_caption_is_finite():
    # A caption whose mask is all zeros: every text row may still see itself (forced diagonal).
    model = tiny_model(cls=120, caption_dim=32)
    cond, mask, condition = tiny_inputs(model, valid=(0, 5))
    tokens, logits = generate(model, cond, 16, emb_masks=mask, cfg_scale=4.0, condition=condition, top_k=1,
                              return_logits=True)
    assert all(torch.isfinite(l).all() for l in logits)
    assert tokens.shape == (2, 16)


def test_cfg_one_ignores_control_strength_and_uses_b_rows():
    model = tiny_model()
    cond, mask, condition = tiny_inputs(model)
    a, la = generate(model, cond, 16, emb_masks=mask, condition=condition, top_k=1, control_strength=0.3,
                     return_logits=True)
    b, lb = generate(model, cond, 16, emb_masks=mask, condition=condition, top_k=1, control_strength=1.0,
                     return_logits=True)
    assert la[0].shape[0] == 2  # no unconditional rows
    assert torch.equal(a, b) and torch.equal(la[3], lb[3])


def test_cfg_interval_switches_to_conditional_logits():
    model = tiny_model(cls=120)
    cond, mask, condition = tiny_inputs(model)
    common = dict(emb_masks=mask, cfg_scale=4.0, condition=condition, top_k=1, return_logits=True)
    always, l_always = generate(model, cond, 16, cfg_interval=-1, **common)
    early, l_early = generate(model, cond, 16, cfg_interval=2, **common)
    # Steps 0..2 use CFG in both runs, so tokens 0..3 agree; from there the guidance differs.
    assert torch.equal(always[:, :4], early[:, :4])
    cond_only = l_early[5].chunk(2)[0].argmax(-1)
    assert torch.equal(early[:, 5], cond_only)


def test_unconditional_half_gets_zero_control():
    model = tiny_model(cls=120)
    cond, mask, condition = tiny_inputs(model)
    p = prepare(model, cond, condition, mask, cfg_scale=4.0, control_strength=0.7)
    assert p.prefix.shape[0] == 4 and torch.count_nonzero(p.controls[:, 2:]) == 0
    assert torch.equal(p.text_mask[:2], p.text_mask[2:])


def test_a_block_that_adds_control_is_passed_the_next_blocks_rows():
    """model.blocks with a Context.block that adds control rows (as the fused block): block i gets the control rows added
    before block i + 1 (None where there are none, and for the last block) and adds them itself; the hidden states
    are those of the blocks run plainly."""
    model = tiny_model(n_layer=6)  # control rows before blocks 0, 2 and 4
    cond, mask, condition = tiny_inputs(model)
    p = prepare(model, cond, condition, mask, cfg_scale=4.0, control_strength=1.0)
    rows, T = p.prefix.shape[:2]
    model.setup_caches(rows, T, torch.float32)
    key_valid = p.key_valid(model.max_seq)
    passed = []

    def block(layer, x, freqs, attend, input_pos, control=None):
        passed.append(control)
        x = layer(x, freqs, attend)
        return x if control is None else x + control

    with torch.no_grad():
        want = model.blocks(p.prefix, torch.arange(T), key_valid, p.controls)
        got = model.blocks(p.prefix, torch.arange(T), key_valid, p.controls,
                           ctx=Context(block=block, block_adds_control=True))
    assert [c is not None for c in passed] == [False, True, False, True, False, False]
    assert passed[1].abs().sum() > 0 and torch.equal(got, want)


def test_the_eager_blocks_leave_their_last_residual_add_to_the_next_norm(monkeypatch):
    """Where RMSNorm runs as one kernel with the residual add before it (EagerOps.rms_norm: eager_ops_cuda's, stood in for
    by torch's ops here), each eager block's last residual add is done by the next block's first norm, except before a
    control add (blocks 0, 2 and 4 of 6); the last block's after the loop. The hidden states are those of the plain
    ops."""
    import torch.nn.functional as F

    model = tiny_model(n_layer=6)
    cond, mask, condition = tiny_inputs(model)
    p = prepare(model, cond, condition, mask, cfg_scale=4.0, control_strength=1.0)
    rows, T = p.prefix.shape[:2]
    model.setup_caches(rows, T, torch.float32)
    key_valid = p.key_valid(model.max_seq)
    with torch.no_grad():
        want = model.blocks(p.prefix, torch.arange(T), key_valid, p.controls)
    adds = []

    def rms_norm(x, weight, eps, delta=None):
        adds.append(delta is not None)
        h = x if delta is None else x + delta
        y = F.rms_norm(h, h.shape[-1:], eps=eps) * weight
        return y if delta is None else (h, y)

    with torch.no_grad():
        got = model.blocks(p.prefix, torch.arange(T), key_valid, p.controls, ctx=Context(ops=EagerOps(rms_norm=rms_norm)))
    # (attention_norm, ffn_norm) per block: the ffn norm always adds the attention's output
    assert adds == [False, True, True, True] * 3 and torch.equal(got, want)
