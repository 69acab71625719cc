"""The one sampling routine: CFG merge, temperature, top-k, top-p and the draw.

The reference sampler draws with torch.multinomial (host-synchronising, as the official code);
the fast engine draws with an exponential race, argmax(p / E) with E ~ Exp(1) i.i.d., which
selects index i with probability p_i exactly (the smallest of E_j / p_j is E_i / p_i with that
probability) and needs no sync, so it can live inside a CUDA graph.
"""
import torch
import torch.nn.functional as F


def cfg_merge(logits, cfg_scale):
    """Rows are [conditional; unconditional]: uncond + (cond - uncond) * scale."""
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + (cond - uncond) * cfg_scale


def filter_logits(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Official top-k (ties with the k-th value survive) and top-p (first token over p kept)."""
    # A tensor temperature (the fast engine's, so a new value needs no recompile) is clamped alike.
    logits = logits / (temperature.clamp_min(1e-5) if torch.is_tensor(temperature) else max(temperature, 1e-5))
    if top_k > 0:
        k = min(max(top_k, 1), logits.shape[-1])
        kth = kth_largest(logits, k)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        over = F.softmax(sorted_logits, dim=-1).cumsum(-1) > top_p
        # Shift right so the token that crosses the threshold stays; never drop the best token.
        over = torch.cat([torch.zeros_like(over[..., :1]), over[..., :-1]], dim=-1)
        logits = logits.masked_fill(over.scatter(-1, order, over), float("-inf"))
    return logits


def kth_largest(logits, k):
    """(B, 1): the k-th largest value of each row (the smallest of the top k: no need to sort them)."""
    if logits.is_cuda and logits.shape[0] <= 20 and logits.shape[-1] < 20000:
        # PyTorch's CUDA top-k uses one block per row for <= 20 rows narrower than 20,000 columns,
        # twice as slow at 1 x 16,384 on an H200 (81 vs 41 us) as its multi-block path, which -inf
        # padding selects; the padding never enters the top k while k <= the real width.
        logits = F.pad(logits, (0, 20480 - logits.shape[-1]), value=float("-inf"))
    return torch.topk(logits, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True, race=False):
    """Draw one token per row of logits (B, V) -> (B, 1) int64.

    race=False: torch.multinomial, the official draw. race=True: the sync-free exponential race
    (same distribution, different random stream).
    """
    logits = filter_logits(logits, temperature, top_k, top_p)
    if not sample_logits:
        return torch.argmax(logits, dim=-1, keepdim=True)
    if race:
        # argmax p_i / E_i = argmax (logit_i - log E_i): softmax's normaliser is the same for all i,
        # so the race needs no softmax at all.
        # A zero draw would turn a filtered -inf logit into NaN, which argmax would pick.
        noise = torch.empty_like(logits).exponential_(1).clamp_min_(torch.finfo(logits.dtype).tiny)
        return torch.argmax(logits - torch.log(noise), dim=-1, keepdim=True)
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
