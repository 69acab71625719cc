"""The fixtures' weight recipe: every official state-dict entry is rebuilt from its own name.

See ../shared/controlar/fixtures/README.md. A model whose key names and shapes are the official
ones gets exactly the weights the official code had when the fixtures were made.
"""
import math
import zlib

import torch

NORM_SUFFIXES = ("norm.weight", "norm1.weight", "norm2.weight", "lambda1")


def recipe_value(key, shape):
    g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if key == "output.weight":
        return x
    if key.endswith(NORM_SUFFIXES) or "layernorm.weight" in key:
        return 1 + 0.1 * x
    if key.startswith("adapter.model."):
        return 0.02 * x
    if key.startswith("tok_embeddings"):
        return 0.5 * x
    if key == "cls_embedding.uncond_embedding":
        return x / math.sqrt(shape[-1])
    if key.startswith(("cls_embedding", "adapter_mlp", "condition_mlp", "condition_layers")) and len(shape) == 2:
        return (1.5 / math.sqrt(shape[1])) * x
    return 0.05 * x


def recipe_state_dict(model):
    """The recipe applied to every floating-point entry of model.state_dict() (rule 1 keeps the rest)."""
    out = {}
    for key, t in model.state_dict().items():
        if key in ("condition_mlp.uncond_embedding", "quantize.codebook_used") or not t.is_floating_point():
            out[key] = t.clone()
        else:
            out[key] = recipe_value(key, tuple(t.shape)).to(t.dtype)
    return out
