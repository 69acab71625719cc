"""The reference sampler: the official ControlAR generate(), step for step, on our model.

It is the oracle of the equivalence tests and the baseline of bench.py. The fast engine shares
`prepare` (CFG batching, null caption, zero control for the unconditional half, text mask) and
the model forward with it, and differs only in how the steps are run.
"""
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fast_inference.sampling import cfg_merge, sample


@dataclass
class Prepared:
    prefix: torch.Tensor  # (R, T, D) prefix embeddings, R = 2B under CFG else B
    text_mask: torch.Tensor  # (R, T) bool, which prefix positions may be attended to
    controls: torch.Tensor  # (3, R, Nc, D) control tokens, already scaled by control_strength

    def key_valid(self, max_seq):
        """(R, max_seq) bool: the text mask, then True for every image position."""
        rows, T = self.text_mask.shape
        rest = torch.ones(rows, max_seq - T, dtype=torch.bool, device=self.text_mask.device)
        return torch.cat([self.text_mask, rest], dim=1)


def prepare(model, cond, condition, emb_masks=None, cfg_scale=1.0, control_strength=1.0, condition_type=None):
    """Everything the prefill needs, for B prompts (caption embeddings or labels) and B controls. condition_type: the
    control's, if not the model's (a server's request)."""
    features = model.encode_control(condition, condition_type)
    use_cfg = cfg_scale > 1.0
    # Official quirk: control_strength only reaches the model when CFG is on.
    strength = control_strength if use_cfg else 1.0
    if use_cfg:
        cond = torch.cat([cond, model.null_condition(cond)])
        features = torch.cat([features, torch.zeros_like(features)])
    prefix = model.prefix_embeddings(cond)
    rows, T = prefix.shape[:2]
    if emb_masks is None:
        text_mask = torch.ones(rows, T, dtype=torch.bool, device=prefix.device)
    else:
        # The null caption is cut by the prompt's own mask, as in the official code.
        text_mask = emb_masks[:, :T].bool().to(prefix.device)
        text_mask = torch.cat([text_mask, text_mask]) if use_cfg else text_mask
    return Prepared(prefix, text_mask, model.control_tokens(features, strength))


@torch.no_grad()
def generate(model, cond, max_new_tokens, emb_masks=None, cfg_scale=1.0, cfg_interval=-1, condition=None,
             control_strength=1.0, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True, return_logits=False,
             max_steps=None, forced=None):
    """Official generate(): returns tokens (B, N) int64 (and the per-call logits if asked).

    max_steps: stop after that many decode steps (caches still sized for N) -- for benchmarks,
    which time a few hundred steps and extrapolate. forced (B, N): feed these tokens back instead
    of drawing (teacher forcing, as Engine.generate's `forced`), to compare logits."""
    if condition is None:
        raise ValueError("ControlAR needs a control image (condition) for every sample")
    p = prepare(model, cond, condition, emb_masks, cfg_scale, control_strength)
    rows, T = p.prefix.shape[:2]
    model.setup_caches(rows, T + max_new_tokens, p.prefix.dtype)
    key_valid = p.key_valid(model.max_seq)
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, sample_logits=sample_logits)
    all_logits = []

    def draw(logits, j):
        return sample(logits, **sampling) if forced is None else forced[:, j : j + 1].to(logits.device)

    logits = model(p.prefix, torch.arange(T, device=p.prefix.device), key_valid, p.controls, last_only=True)[:, -1]
    all_logits.append(logits)
    token = draw(cfg_merge(logits, cfg_scale) if cfg_scale > 1.0 else logits, 0)
    tokens = [token]
    use_cfg = True
    for i in range(max_new_tokens - 1 if max_steps is None else min(max_steps, max_new_tokens - 1)):
        if -1 < cfg_interval < i:
            use_cfg = False  # for good: the rest of the image is guided by the prompt half only
        x = torch.cat([token, token]) if cfg_scale > 1.0 else token
        input_pos = torch.tensor([T + i], device=x.device)
        with sdpa_kernel(SDPBackend.MATH):  # the official decode forces the math kernel
            logits = model(model.tok_embeddings(x), input_pos, key_valid, p.controls, last_only=True)[:, -1]
        all_logits.append(logits)
        if cfg_scale > 1.0:
            logits = cfg_merge(logits, cfg_scale) if use_cfg else logits.chunk(2)[0]
        token = draw(logits, i + 1)
        tokens.append(token)
    tokens = torch.cat(tokens, dim=1)
    return (tokens, all_logits) if return_logits else tokens
