"""The benchmarks' workload: the model the GPU scripts time (GPT-XL, random weights), its fixed inputs, the bytes a
step reads, an output layer scaled to a chosen entropy, and the timed runs of an engine. bench.py and the tools in
tools/ share these.
"""
import itertools
import time

import torch

from fast_inference.draft_tree import format_tree
from fast_inference.generate import generate
from fast_inference.model import ModelArgs, Transformer


def step_bytes(model, rows, prefix, n_tokens):
    """Bytes one decode step must read: block + output weights as stored (int8 and scales with
    --quantize int8), plus the average filled KV."""
    a = model.args
    kv = rows * a.n_layer * 2 * a.dim * (prefix + n_tokens / 2) * model.tok_embeddings.weight.element_size()
    return weight_bytes(model.layers, model.norm, model.output) + kv


def weight_bytes(*modules):
    """Bytes of the modules' weights as stored, the KV caches left out; a tensor shared by views
    (w1 and w3 are views of the fused w13) counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for m in modules
                for name, t in itertools.chain(m.named_parameters(), m.named_buffers()) if not name.endswith("_cache")}
    return sum(storages.values())


def random_gpt_xl():
    """The model the GPU scripts time: GPT-XL t2i for 512 px images, bf16, random weights, on CUDA."""
    with torch.device("cuda"):
        model = Transformer(ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed"))
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def inputs(model, B, image_size, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    T = model.args.cls_token_num
    cond = torch.randn(B, T, model.args.caption_dim, generator=g) * 0.2
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, T - 20:] = 1
    condition = torch.rand(B, 3, image_size, image_size, generator=g) * 2 - 1
    return (cond * mask[..., None]).to(device), mask.to(device), condition.to(device)


def scale_to_entropy(model, target, args, kw, device, steps=64, rounds=3):
    """Scale the output layer so that the mean entropy (nats) of the sampled distributions (CFG merge, top-k) over
    the first `steps` tokens of one image (torch seed 0) is `target`. The merged logits are linear in the scale, so
    one run gives every scale's entropy along its tokens (bisection on the scale's log); the tokens drawn then change
    with the scale, so a few rounds refit it. -> (scale, the entropy measured at it)."""
    from fast_inference.sampling import cfg_merge, filter_logits

    cond, mask, condition = inputs(model, 1, args.image_size, device)
    steps = min(steps, model.args.block_size - 1)

    def merged_logits():
        torch.manual_seed(0)
        _, logits = generate(model, cond, steps + 1, emb_masks=mask, condition=condition, return_logits=True, **kw)
        merged = torch.cat([cfg_merge(l, kw["cfg_scale"]) if kw["cfg_scale"] > 1 else l for l in logits]).float()
        return filter_logits(merged, 1.0, kw["top_k"])

    def entropy(merged, scale=1.0):
        logp = torch.log_softmax(merged * scale, -1)
        return -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1).mean().item()

    total = 1.0
    for _ in range(rounds):
        merged, lo, hi = merged_logits(), -8.0, 8.0  # log2 of the scale: entropy falls as it grows
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if entropy(merged, 2 ** mid) > target else (lo, mid)
        model.output.weight.mul_(2 ** ((lo + hi) / 2))
        total *= 2 ** ((lo + hi) / 2)
    model.clear_caches()
    return total, entropy(merged_logits())


def timed(fn, device):
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0, out


def bench_fast(engine, model, B, N, args, kw, device):
    cond, mask, condition = inputs(model, B, args.image_size, device)
    before = engine.compile_seconds
    t_first, _ = timed(lambda: engine.generate(cond, N, emb_masks=mask, condition=condition, **kw), device)
    compile_s = engine.compile_seconds - before
    decode = []
    for _ in range(args.fast_runs):
        engine.generate(cond, N, emb_masks=mask, condition=condition, **kw)
        decode.append(engine.last_timings["decode"])
    d = sorted(decode)[len(decode) // 2]
    return dict(step_ms=d / (N - 1) * 1e3, tok_s=B * N / d, decode_s=d, first_image_s=t_first, compile_s=compile_s,
                timings=dict(engine.last_timings))


def bench_speculative(engine, B, N, args, kw, device):
    """The speculative engine's images (after a warm-up image): tok/s, passes and accepted tokens, a pass's time."""
    cond, mask, condition = inputs(engine.model, B, args.image_size, device)
    before = engine.compile_seconds
    engine.generate(cond, N, emb_masks=mask, condition=condition, **kw)
    compile_s = engine.compile_seconds - before
    runs = []
    for _ in range(args.fast_runs):
        engine.generate(cond, N, emb_masks=mask, condition=condition, **kw)
        runs.append((engine.last_timings["decode"], engine.last_speculation))
    d, spec = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    ran = engine.plan.situation  # the drafts the passes ran (the plan's choice where the flags were left out)
    return dict(tok_s=B * N / d, decode_s=d, pass_ms=d / spec["batch_passes"] * 1e3, compile_s=compile_s,
                passes_per_image=sum(spec["passes"]) / B, tokens_per_pass=spec["tokens_per_pass"],
                batch_passes=spec["batch_passes"], window=ran.draft_window, init=args.draft_init,
                coupling=ran.draft_coupling, tree=format_tree(ran.draft_tree))
