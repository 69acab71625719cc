"""Weight-only int8, as gpt-fast's int8 mode: the weights every decode step reads (the blocks'
projections and the output head) become int8 with one scale per output row, half of bf16's bytes.

    python fast_inference/fast_engine.py --quantize int8 ...

Symmetric rounding per row: scale = max|w| / 127 in the model's dtype, q = round(w / scale) in
[-127, 127]. A projection is then (x @ q.T, rounded) * scale (model.int8_linear); decode_block's
kernels read q and the scales and compute the same. It changes the model, and so the images:
`scripts/gpu_equivalence.py --quantize int8` reports the teacher-forced log-prob drift against the
unquantized model. The condition path (adapter, control MLPs, caption projection) runs once per image
and keeps its weights.
"""
import torch

from fast_inference.model import Int8Linear

MODES = ("none", "int8")


def quantize_rows(w):
    """(q int8 (N, K), scales (N,) in w's dtype) with w ~ q * scales[:, None]."""
    wf = w.float()
    scales = (wf.abs().amax(1) / 127).to(w.dtype)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: q = 0, any scale
    q = (wf / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return q, scales


def is_int8(model):
    return isinstance(model.output, Int8Linear)


def int8(weight):
    return Int8Linear(*quantize_rows(weight))


@torch.no_grad()
def quantize_int8(model):
    """The blocks' wqkv, wo, w13 (gate and up fused) and w2 and the output head as int8, in place.
    Call it after loading and casting; the model is returned."""
    if is_int8(model):
        return model
    if model.layers[0].feed_forward.w13 is None:
        model.fuse_projections()
    for layer in model.layers:
        attn, ff = layer.attention, layer.feed_forward
        attn.wqkv, attn.wo, ff.w2 = int8(attn.wqkv.weight), int8(attn.wo.weight), int8(ff.w2.weight)
        ff.w13, ff.w13_scales = quantize_rows(ff.w13)
        ff.w1 = ff.w3 = None  # views of the float w13: dropped, so its memory is freed
    model.output = int8(model.output.weight)
    return model
