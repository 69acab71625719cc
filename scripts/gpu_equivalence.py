"""Fast engine vs reference at real shapes on a GPU (GPT-XL t2i, random weights), fp32 and bf16.

    python scripts/gpu_equivalence.py [--tokens 256] [--batch 2]
                                      [--backends inductor:step,inductor:block,inductor:block:nofuse,cudagraph]

A backend is backend[:compile-scope[:nofuse]] (nofuse: the compiled block even at <= 16 rows, where
the default runs the fused block's kernels). For each precision and backend: greedy tokens
(first divergence, if any), teacher-forced max |delta log p| over every position (the reference's
greedy tokens fed to both; a shape's first image, then its second, which on the cudagraph backend
replays the prefill's graph), and the same seed twice with top-k 2000 sampling on the fast engine.
fp32 runs with TF32 off. --quantize int8: the same on an int8 copy of the model (reference and
fast engine both on it), and the quantization's own drift: the reference on the int8 copy against
the reference on the model, teacher-forced on the model's greedy tokens (max |delta log p|, mean
KL divergence per position, greedy tokens).
"""
import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

import fast_inference.generate as ref
from fast_inference import plan
from fast_inference.engine import Engine
from fast_inference.model import ModelArgs, Transformer
from fast_inference.quantize import MODES as QUANTIZE_MODES, quantize_int8


def max_dlogp(a, b):
    return max((x.log_softmax(-1) - y.log_softmax(-1)).abs().max().item() for x, y in zip(a, b))


def kernel_check():
    """The Triton decode attention (split-KV, or one program per (row, head) where the plan takes it) against SDPA with
    the boolean mask, random data, fp32 and bf16."""
    from fast_inference.kernels.attention_triton import decode_attention
    from fast_inference.model import attention_mask

    for dtype in (torch.float32, torch.bfloat16):
        worst = 0.0
        for R, H, L, pos in [(2, 20, 1144, 120), (2, 20, 1144, 700), (64, 20, 1144, 1143), (3, 4, 160, 130)]:
            q = torch.randn(R, H, 1, 64, device="cuda", dtype=dtype)
            k = torch.randn(R, H, L, 64, device="cuda", dtype=dtype)
            v = torch.randn(R, H, L, 64, device="cuda", dtype=dtype)
            key_valid = torch.ones(R, L, dtype=torch.bool, device="cuda")
            key_valid[:, :120] = torch.rand(R, 120, device="cuda") > 0.5
            input_pos = torch.tensor([pos], device="cuda")
            want = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=attention_mask(key_valid, input_pos))
            got = decode_attention(q, k, v, key_valid, input_pos, whole=R in plan.WHOLE_ROWS).float()
            worst = max(worst, ((got - want).norm() / want.norm()).item())
        print(f"decode kernel vs SDPA ({dtype}): worst relative error {worst:.2e}", flush=True)


def inputs(model, B):
    g = torch.Generator().manual_seed(0)
    T = model.args.cls_token_num
    cond = (torch.randn(B, T, model.args.caption_dim, generator=g) * 0.2).cuda()
    mask = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        mask[b, T - (15, 60)[b % 2]:] = 1
    condition = (torch.rand(B, 3, 512, 512, generator=g) * 2 - 1).cuda()
    return cond, mask.cuda(), condition


def drift(model, quantized, dtype, N, B):
    """The reference on `quantized` against the reference on `model`, on the model's greedy tokens."""
    cond, mask, condition = inputs(model, B)
    kw = dict(emb_masks=mask, condition=condition, cfg_scale=4.0, control_strength=1.0)
    greedy = ref.generate(model, cond, N, top_k=1, **kw)
    _, want = ref.generate(model, cond, N, forced=greedy, return_logits=True, **kw)
    _, got = ref.generate(quantized, cond, N, forced=greedy, return_logits=True, **kw)
    kl = torch.stack([torch.nn.functional.kl_div(y.log_softmax(-1), x.log_softmax(-1), log_target=True,
                                                 reduction="none").sum(-1).mean() for x, y in zip(want, got)])
    same = (ref.generate(quantized, cond, N, top_k=1, **kw) == greedy).float().mean().item()
    print(f"{str(dtype):15s} int8 drift (reference on int8 vs on the model) n={B}: teacher-forced max|dlogp| "
          f"{max_dlogp(want, got):.2e}, mean KL {kl.mean().item():.2e} (max over positions {kl.max().item():.2e}) | "
          f"greedy tokens equal: {100 * same:.1f}%", flush=True)


def check(model, dtype, backends, N, B):
    cond, mask, condition = inputs(model, B)
    kw = dict(cfg_scale=4.0, control_strength=1.0)
    greedy_ref = ref.generate(model, cond, N, emb_masks=mask, condition=condition, top_k=1, **kw)
    _, ref_logits = ref.generate(model, cond, N, emb_masks=mask, condition=condition, forced=greedy_ref,
                                 return_logits=True, **kw)
    for spec in backends:
        backend, scope, flag = (spec.split(":") + ["step", ""])[:3]
        make = lambda: Engine(model, backend=backend, compile_scope=scope, fused_block=flag != "nofuse")
        engine = make()
        greedy = engine.generate(cond, N, emb_masks=mask, condition=condition, top_k=1, **kw)
        same = (greedy == greedy_ref).all(0)
        first = "none" if same.all() else int((~same).nonzero()[0])
        model.clear_caches()
        engine = make()
        # Twice: a shape's second image replays graphs the first did not have (the prefill's, on the cudagraph backend)
        d = [max_dlogp(ref_logits, engine.generate(cond, N, emb_masks=mask, condition=condition, top_k=1,
                                                   forced=greedy_ref, **kw)[1]) for _ in range(2)]
        runs = []
        for _ in range(2):
            torch.manual_seed(5)
            runs.append(engine.generate(cond, N, emb_masks=mask, condition=condition, top_k=2000, **kw))
        print(f"{str(dtype):15s} {spec:22s} n={B} greedy identical: {bool(same.all())} (first divergence: {first}) | "
              f"teacher-forced max|dlogp| {d[0]:.2e} / {d[1]:.2e} | same seed twice identical: {torch.equal(*runs)}", flush=True)
        model.clear_caches()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--backends", default="inductor:step,inductor:block,inductor:block:nofuse,cudagraph",
                   help="backend[:compile-scope[:nofuse]], comma-separated")
    p.add_argument("--batch", type=int, default=2, help="images (rows: twice that, under CFG)")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--quantize", choices=list(QUANTIZE_MODES), default="none")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    kernel_check()
    with torch.device("cuda"):
        base = Transformer(ModelArgs.from_name("GPT-XL", block_size=1024, condition_type="hed")).eval()
    with torch.no_grad():
        for name in a.precisions.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            model = base.to(dtype).requires_grad_(False)
            if a.quantize == "int8":
                quantized = quantize_int8(copy.deepcopy(model))
                drift(model, quantized, dtype, a.tokens, a.batch)
                model = quantized
            check(model, dtype, a.backends.split(","), a.tokens, a.batch)


if __name__ == "__main__":
    main()
