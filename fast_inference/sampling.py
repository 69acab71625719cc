"""The one sampling routine: CFG merge, temperature, top-k, top-p and the draw.

The reference sampler draws with torch.multinomial (host-synchronising, as the official code);
the fast engine draws with an exponential race, argmax(p / E) with E ~ Exp(1), which selects
index i with probability p_i exactly and needs no sync, so it can live inside a CUDA graph.
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
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        over = F.softmax(sorted_logits, dim=-1).cumsum(-1) > top_p
        # Shift right so the token that crosses the threshold stays; never drop the best token.
        over = torch.cat([torch.zeros_like(over[..., :1]), over[..., :-1]], dim=-1)
        logits = logits.masked_fill(over.scatter(-1, order, over), float("-inf"))
    return logits


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True, race=False):
    """Draw one token per row of logits (B, V) -> (B, 1) int64.

    race=False: torch.multinomial, the official draw. race=True: the sync-free exponential race
    (same distribution, different random stream).
    """
    probs = F.softmax(filter_logits(logits, temperature, top_k, top_p), dim=-1)
    if not sample_logits:
        return torch.argmax(probs, dim=-1, keepdim=True)
    if race:
        noise = torch.empty_like(probs).exponential_(1)
        return torch.argmax(probs / noise, dim=-1, keepdim=True)
    return torch.multinomial(probs, num_samples=1)
