"""Reading official checkpoints (.safetensors or .pt) and loading them strictly, with a report.

The official code loads with strict=False, which hides missing and unexpected keys; we load
strictly and say exactly what is wrong and which flag most likely fixes it.
"""
import argparse
import os
import re

import torch

# Entries a state dict may carry that we drop on purpose:
# KV-cache buffers exist only after setup_caches and carry no weights.
IGNORED = re.compile(r"^layers\.\d+\.attention\.kv_cache\.(k_cache|v_cache)$")


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message says what to change."""


def read_state_dict(path, key_order=("model", "module", "state_dict")):
    """A flat name -> tensor dict from a .safetensors file or a torch.save'd training checkpoint."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint {path} not found")
    if path.lower().endswith(".safetensors"):
        from safetensors.torch import load_file

        try:
            return load_file(path)
        except Exception as e:
            raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None
    # Official DDP checkpoints also pickle the argparse Namespace of the training run.
    torch.serialization.add_safe_globals([argparse.Namespace])
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable torch checkpoint ({str(e).splitlines()[0]})") from None
    if isinstance(ckpt, dict):
        for key in key_order:
            if key in ckpt and isinstance(ckpt[key], dict):
                return ckpt[key]
        if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
            return ckpt  # a bare state dict
    raise CheckpointError(f"{path} holds no state dict under {list(key_order)}")


def check_state_dict(model, state_dict):
    """(missing, unexpected, wrong_shape) against the model's own state dict."""
    own = model.state_dict()
    given = {k: v for k, v in state_dict.items() if not IGNORED.match(k)}
    missing = [k for k in own if k not in given]
    unexpected = [k for k in given if k not in own]
    wrong = [(k, tuple(given[k].shape), tuple(own[k].shape)) for k in own if k in given and given[k].shape != own[k].shape]
    return missing, unexpected, wrong


def load_weights(model, state_dict, source="checkpoint", hint=""):
    """Copy state_dict into model strictly; raise CheckpointError with a readable report."""
    missing, unexpected, wrong = check_state_dict(model, state_dict)
    if missing or unexpected or wrong:
        parts = []
        if wrong:
            k, got, want = wrong[0]
            parts.append(f"{len(wrong)} of wrong shape (first: {k} is {list(got)}, model wants {list(want)})")
        if missing:
            parts.append(f"{len(missing)} missing (first: {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected (first: {', '.join(unexpected[:3])})")
        raise CheckpointError(f"{source} does not fit the model: " + "; ".join(parts) + (f". {hint}" if hint else ""))
    own = model.state_dict()
    with torch.no_grad():
        for k, t in own.items():
            t.copy_(state_dict[k])


def describe_gpt(state_dict):
    """What a ControlAR GPT checkpoint reveals about its configuration (SPEC section 15)."""
    info = {}
    if "tok_embeddings.weight" in state_dict:
        info["vocab_size"], info["dim"] = state_dict["tok_embeddings.weight"].shape
    layers = [int(m.group(1)) for k in state_dict if (m := re.match(r"layers\.(\d+)\.", k))]
    if layers:
        info["n_layer"] = max(layers) + 1
    if "adapter_mlp.fc1.weight" in state_dict:
        width = state_dict["adapter_mlp.fc1.weight"].shape[1]
        info["adapter_size"] = {384: "small", 768: "base"}.get(width, f"width {width}")
    if "cls_embedding.embedding_table.weight" in state_dict:
        info["model_type"] = "c2i"
    elif "cls_embedding.cap_proj.fc1.weight" in state_dict:
        info["model_type"] = "t2i"
        info["caption_dim"] = state_dict["cls_embedding.cap_proj.fc1.weight"].shape[1]
    if "condition_mlp.uncond_embedding" in state_dict:
        info["block_size"] = state_dict["condition_mlp.uncond_embedding"].shape[0]
    return info


def gpt_fix_hint(args, state_dict):
    """The flags that would make this checkpoint fit, from what its tensors reveal."""
    from fast_inference.model import GPT_CONFIGS

    info = describe_gpt(state_dict)
    fixes = []
    if "dim" in info and "n_layer" in info and (info["dim"], info["n_layer"]) != (args.dim, args.n_layer):
        names = [n for n, c in GPT_CONFIGS.items() if (c["dim"], c["n_layer"]) == (info["dim"], info["n_layer"])]
        fixes.append(f"--gpt-model {names[0]}" if names else f"a config with dim {info['dim']}, n_layer {info['n_layer']}")
    if info.get("model_type") not in (None, args.model_type):
        fixes.append(f"--gpt-type {info['model_type']}")
    if info.get("adapter_size") not in (None, args.adapter_size) and args.model_type == "t2i":
        fixes.append(f"--adapter-size {info['adapter_size']}")
    if "block_size" in info and info["block_size"] != args.block_size:
        side = int(info["block_size"] ** 0.5) * 16
        fixes.append(f"--image-size {side}")
    return ("Likely fix: " + " ".join(fixes)) if fixes else ""
