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
    """Official top-k (ties with the k-th value survive) and top-p (first token over p kept). Each setting is a number
    for every row, or a tensor of one per row (B, 1) (a server's batch, whose requests each bring theirs: a row gets
    the bits it would get alone)."""
    # A tensor temperature (the fast engine's, so a new value needs no recompile) is clamped alike.
    logits = logits / (temperature.clamp_min(1e-5) if torch.is_tensor(temperature) else max(temperature, 1e-5))
    if torch.is_tensor(top_k):
        logits = logits.masked_fill(logits < kth_largest_rows(logits, top_k), float("-inf"))
    elif top_k > 0:
        k = min(max(top_k, 1), logits.shape[-1])
        kth = kth_largest(logits, k)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if torch.is_tensor(top_p) or top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        over = F.softmax(sorted_logits, dim=-1).cumsum(-1) > top_p
        # Shift right so the token that crosses the threshold stays; never drop the best token.
        over = torch.cat([torch.zeros_like(over[..., :1]), over[..., :-1]], dim=-1)
        if torch.is_tensor(top_p):
            over &= top_p < 1.0  # rows at 1 keep every token, as the number 1 skips the filter
        logits = logits.masked_fill(over.scatter(-1, order, over), float("-inf"))
    return logits


def kth_largest_rows(logits, top_k):
    """(B, 1): the k-th largest value of each row for its own k, top_k (B, 1) (0: -inf, no filter), as kth_largest
    finds it for that k alone (the same value: a selection)."""
    k = top_k.clamp(0, logits.shape[-1])
    values = torch.sort(logits, dim=-1, descending=True).values  # the k-th at k - 1; no host sync for the largest k
    kth = values.gather(-1, (k - 1).clamp_min(0))
    return torch.where(k > 0, kth, float("-inf"))


def kth_largest(logits, k):
    """(B, 1): the k-th largest value of each row (the smallest of the top k: no need to sort them)."""
    if logits.is_cuda and logits.shape[0] <= 20 and logits.shape[-1] < 20000:
        # PyTorch's CUDA top-k uses one block per row for <= 20 rows narrower than 20,000 columns,
        # twice as slow at 1 x 16,384 on an H200 (81 vs 41 us) as its multi-block path, which -inf
        # padding selects; the padding never enters the top k while k <= the real width.
        logits = F.pad(logits, (0, 20480 - logits.shape[-1]), value=float("-inf"))
    return torch.topk(logits, k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)


def sample(logits, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True, race=False, noise=None):
    """Draw one token per row of logits (B, V) -> (B, 1) int64.

    race=False: torch.multinomial, the official draw. race=True: the sync-free exponential race
    (same distribution, different random stream); noise: its Exp(1) draws (B, V), made by the caller from each row's
    own generator (a server's requests), else from torch's.
    """
    logits = filter_logits(logits, temperature, top_k, top_p)
    if not sample_logits:
        return torch.argmax(logits, dim=-1, keepdim=True)
    if race:
        # argmax p_i / E_i = argmax (logit_i - log E_i): softmax's normaliser is the same for all i,
        # so the race needs no softmax at all.
        # A zero draw would turn a filtered -inf logit into NaN, which argmax would pick.
        if noise is None:
            noise = torch.empty_like(logits).exponential_(1)
        noise = noise.clamp_min(torch.finfo(logits.dtype).tiny)
        return torch.argmax(logits - torch.log(noise), dim=-1, keepdim=True)
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
