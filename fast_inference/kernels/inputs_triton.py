"""A decode step's inputs in one Triton kernel: the token embeddings of every row (both CFG halves),
the RoPE row and the control rows of the step's position, the first control list added into x.

Done by the model's ops, eager around the blocks, these are 13 small kernels (the rows' concatenation,
the embedding, the position arithmetic, the controls' gather and scaling, the first add): ~24 us of a
one-image step on an H200 (~36 us at n = 8), where this kernel takes a few. It launches with
programmatic dependent launch, so the first block's weights stream in while it runs.
Computes what the engine's step feeds the model (tests/test_inputs_triton.py checks it bit for bit).
"""
import torch

from fast_inference.kernels.pdl import launch

try:
    import triton
    import triton.language as tl

    from fast_inference.kernels.pdl import pdl_wait
except ImportError:
    triton = None


if triton is not None:

    @triton.jit
    def _inputs_kernel(TOKEN, POS, EMB, CONTROLS, FREQS_TABLE, X, FREQS, PICKED, batch, n_controls, stride_cl,
                       stride_cr, stride_cn, cls_token_num, window, D: tl.constexpr, DP: tl.constexpr,
                       F: tl.constexpr, FP: tl.constexpr, LISTS: tl.constexpr, PDL: tl.constexpr, OWN: tl.constexpr):
        """Row r: X[r] = EMB[TOKEN[r % batch]] + control row 0, PICKED[k - 1, r] = control row k (k >= 1),
        where control row k is CONTROLS[k, r, idx] times whether idx = POS - cls_token_num + 1 is a
        control token (the model's multiply by 0 or 1, kept for its rounding and signed zeros); program
        0 copies the RoPE row FREQS_TABLE[POS] to FREQS. OWN: program q is query q % window of row r = q // window,
        at its own position POS[r % batch, q % window] with its token TOKEN[r % batch, q % window], and copies its
        own RoPE row to FREQS[q]."""
        pdl_wait(PDL)  # the previous step's draw wrote the token and advanced the position
        q = tl.program_id(0)
        if OWN:
            r = q // window
            at = r % batch * window + q % window
            pos = tl.load(POS + at)
        else:
            r = q
            at = r % batch
            pos = tl.load(POS)
        idx = pos - cls_token_num + 1
        present = ((idx >= 0) & (idx < n_controls)).to(tl.float32)
        idx = tl.minimum(tl.maximum(idx, 0), n_controls - 1)
        offs = tl.arange(0, DP)
        ok = offs < D
        dt = X.dtype.element_ty
        row = CONTROLS + r * stride_cr + idx * stride_cn + offs
        control = (tl.load(row, mask=ok).to(tl.float32) * present).to(dt)
        token = tl.load(TOKEN + at)
        x = tl.load(EMB + token * D + offs, mask=ok)
        tl.store(X + q * D + offs, (x.to(tl.float32) + control.to(tl.float32)).to(dt), mask=ok)
        for k in tl.static_range(1, LISTS):
            control = (tl.load(row + k * stride_cl, mask=ok).to(tl.float32) * present).to(dt)
            tl.store(PICKED + ((k - 1) * tl.num_programs(0) + q) * D + offs, control, mask=ok)
        if OWN or q == 0:
            f = tl.arange(0, FP)
            tl.store(FREQS + q * F + f, tl.load(FREQS_TABLE + pos * F + f, mask=f < F), mask=f < F)


def step_inputs(model, token, input_pos, controls, guided, pdl=False):
    """x = model.tok_embeddings(cat([token, token]) if guided else token) + control row 0, and the inputs
    model.forward takes for input_pos (1,): (freqs, (None, control rows 1, 2, ...)), each row (R, 1, D).
    controls (lists, >= R, Nc, D), its rows 0..R-1 used; x and the rows in the embedding's dtype. pdl: launched with
    PDL (EARLY)."""
    emb, table = model.tok_embeddings.weight, model.freqs_cis
    batch, D = token.shape[0], emb.shape[1]
    R = 2 * batch if guided else batch
    lists, _, n_controls, _ = controls.shape
    assert controls.shape[1] >= R and controls.stride(3) == 1 and controls.dtype == emb.dtype
    x = torch.empty(R, 1, D, device=emb.device, dtype=emb.dtype)
    freqs = torch.empty(1, *table.shape[1:], device=emb.device, dtype=table.dtype)
    picked = torch.empty(lists - 1, R, 1, D, device=emb.device, dtype=emb.dtype)
    F = table[0].numel()
    _inputs_kernel[(R,)](token, input_pos, emb, controls, table, x, freqs, picked, batch, n_controls,
                         controls.stride(0), controls.stride(1), controls.stride(2), model.args.cls_token_num, 1, D=D,
                         DP=triton.next_power_of_2(D), F=F, FP=triton.next_power_of_2(F), LISTS=lists, OWN=False,
                         **launch(pdl))
    return x, (freqs, (None, *picked))



def window_inputs(model, tokens, positions, controls, guided, pdl=False):
    """step_inputs for rows at their own positions, L >= 1 queries each: tokens and positions (B, L) (a row's tokens
    and positions, each image's for both CFG halves if guided) -> x (R, L, D) = model.tok_embeddings of the rows'
    tokens + control row 0, and model.step_inputs(positions of the R rows, controls) as the model takes them:
    (freqs (R, L, hd/2, 2), (None, control rows 1, 2, ... (R, L, D)))."""
    emb, table = model.tok_embeddings.weight, model.freqs_cis
    (batch, L), D = tokens.shape, emb.shape[1]
    R = 2 * batch if guided else batch
    lists, _, n_controls, _ = controls.shape
    assert controls.shape[1] >= R and controls.stride(3) == 1 and controls.dtype == emb.dtype
    assert positions.shape == tokens.shape and positions.is_contiguous() and tokens.is_contiguous()
    x = torch.empty(R, L, D, device=emb.device, dtype=emb.dtype)
    freqs = torch.empty(R, L, *table.shape[1:], device=emb.device, dtype=table.dtype)
    picked = torch.empty(lists - 1, R, L, D, device=emb.device, dtype=emb.dtype)
    F = table[0].numel()
    _inputs_kernel[(R * L,)](tokens, positions, emb, controls, table, x, freqs, picked, batch, n_controls,
                             controls.stride(0), controls.stride(1), controls.stride(2), model.args.cls_token_num, L,
                             D=D, DP=triton.next_power_of_2(D), F=F, FP=triton.next_power_of_2(F), LISTS=lists,
                             OWN=True, **launch(pdl))
    return x, (freqs, (None, *picked))
