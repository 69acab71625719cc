"""The fused block: a transformer block of a one-token step as four projection kernels around the decode attention,
each projection block_triton's (GEMV or dot) or block_cuda's, as the plan's Rows for the step's row count says.

Computes TransformerBlock.forward for S = 1 (tests/test_block.py checks it against it), with the element-wise work
inside the projections: RMSNorm, RoPE and the cache write in QKV, the residual adds in wo and w2, SiLU x up in gate/up.
"""
from fast_inference.kernels import block_cuda, block_triton
from fast_inference.kernels.block_triton import row_scales


def _qkv(p, x, layer, freqs, input_pos, cache, progress, window=0):
    attn = layer.attention
    if p.impl == "cuda":
        assert not window, "block_cuda's QKV takes one position for every row"
        return block_cuda.qkv_rope(x, layer.attention_norm, attn.wqkv.weight, freqs, input_pos, cache.k_cache,
                                   cache.v_cache, attn.n_head, p.pdl, progress)
    return block_triton.qkv_rope(x, layer.attention_norm, attn.wqkv.weight, row_scales(attn.wqkv), freqs, input_pos,
                                 cache.k_cache, cache.v_cache, attn.n_head, p.pdl, p.impl == "triton_dot", progress,
                                 window)


def _linear(p, name, x, linear, residual, progress, then=None):
    if p.impl == "cuda":
        return block_cuda.linear(x, linear.weight, residual, name, p.pdl, then, progress)
    return block_triton.linear(x, linear.weight, row_scales(linear), residual, name, p.pdl, p.impl == "triton_dot",
                               progress, then)


def _gate_up(p, x, layer, progress):
    ff = layer.feed_forward
    if p.impl == "cuda":
        return block_cuda.gate_up(x, layer.ffn_norm, ff.w13, p.pdl, progress)
    return block_triton.gate_up(x, layer.ffn_norm, ff.w13, ff.w13_scales, p.pdl, p.impl == "triton_dot", progress)


def fused_block(layer, x, freqs, attend, input_pos, rows, prefetcher=None, control=None):
    """TransformerBlock.forward(x, freqs, attend) for x (R, 1, D), usable as the model's Context.block; + control
    (R, 1, D), the next block's control rows, if given (the model passes them: Context.block_adds_control). Rows at
    their own positions (input_pos (B, L), a pass's or a server's; freqs (B, L, hd/2, 2)): x (B, L, D), its B x L
    queries the projections' rows, attend a window kernel (model.Context.window).

    rows: the plan's Rows of these steps (its projections' implementations and launches; attend launches as it says
    too). prefetcher (prefetch_triton.Prefetcher): its count is bumped by each of the 4 projections as it starts."""
    p = rows
    B, L, D = x.shape
    R = B * L
    assert R == rows.rows
    window = L if input_pos.dim() == 2 else 0
    x = x.reshape(R, D)
    if window:  # each query's own position and RoPE row
        input_pos, freqs = input_pos.reshape(R), freqs.reshape(R, *freqs.shape[2:])
    progress = None if prefetcher is None else prefetcher.progress
    attn = layer.attention
    q = _qkv(p.projection("qkv"), x, layer, freqs, input_pos, attn.kv_cache, progress, window)
    # q rotated, the step's keys and values in the cache: attend's other arguments go unused
    if window:  # (B, H, L, hd) laid out (B, L, H, hd): a query's heads side by side
        y = attend(q.view(B, L, *q.shape[1:2], -1), None, None, freqs, attn.kv_cache).transpose(1, 2)
    else:
        y = attend(q.transpose(1, 2), None, None, freqs, attn.kv_cache)  # (R, H, 1, hd): a row's heads side by side
    h = _linear(p.projection("wo"), "wo", y.reshape(R, D), attn.wo, x, progress)
    a = _gate_up(p.projection("gate_up"), h, layer, progress)
    then = None if control is None else control.reshape(R, D)
    return _linear(p.projection("w2"), "w2", a, layer.feed_forward.w2, h, progress, then).view(B, L, D)
