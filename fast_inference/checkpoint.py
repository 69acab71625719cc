"""Reading official checkpoints (.safetensors or .pt) and loading them strictly, with a report.

The official code loads with strict=False, which hides missing and unexpected keys; we load
strictly and say exactly what is wrong and which flag most likely fixes it.
"""
import argparse
import contextlib
import os
import pickle
import pickletools
import re
import warnings
import zipfile

import torch

# Entries a state dict may carry that we drop on purpose:
# KV-cache buffers exist only after setup_caches and carry no weights.
IGNORED = re.compile(r"^layers\.\d+\.attention\.kv_cache\.(k_cache|v_cache)$")
# Entries a checkpoint may lack: inference never reads them (SPEC section 15 allows dropping them).
OPTIONAL = ("condition_embeddings.weight", "condition_mlp.uncond_embedding", "condition_norm.weight")
# Prefixes training wrappers put on every key (DDP's module., torch.compile's _orig_mod.).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


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
            raise CheckpointError(f"{path} is not a readable safetensors file ({e}); download it again") from None
    try:
        # Official DDP checkpoints also pickle the training run's argparse Namespace.
        with torch.serialization.safe_globals(SAFE_EXTRA), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected pickle protocol")  # a refusal below says it in one line
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the safe loader refused the pickle: the pickle itself says why
        raise CheckpointError(refusal(path, e)) from None
    except Exception as e:
        raise CheckpointError(load_failure(path, e)) from None
    if isinstance(ckpt, dict):
        for key in key_order:
            if key in ckpt and isinstance(ckpt[key], dict):
                return unwrap(ckpt[key])
        if ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
            return unwrap(ckpt)  # a bare state dict
    found = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
    raise CheckpointError(f"{path} holds no state dict under {list(key_order)} (found {found}); "
                          "pass the model checkpoint itself")


def read_metadata(path):
    """A .safetensors file's metadata (str -> str; {} when it has none or is not readable)."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception:  # noqa: BLE001 (read_state_dict reports a broken file in one line)
        return {}


SAFE_EXTRA = [argparse.Namespace]  # what we let the safe loader take beyond torch's own allowlist


def load_failure(path, e):
    """One line for a checkpoint torch.load cannot read."""
    return f"{path} is not a readable torch checkpoint ({cause(e)}); download it again"


def cause(e):
    """What torch says went wrong: the last line of its weights-only failures (which open with advice to load
    unsafely), else the first."""
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    lines = [s for s in lines if not s.startswith("Check the documentation")]
    return (lines[-1] if "Weights only load failed" in str(e) else lines[0]) if lines else type(e).__name__


def refusal(path, e):
    """One line for a pickle the safe loader refused, from the globals the pickle names (read by pickletools, which
    runs nothing), not from torch's wording: one outside the safe loader's allowlist would run code; with none, the
    safe loader could not read a safe pickle (an unusual protocol); no pickle at all is a broken file."""
    names = pickled_globals(path)
    unsafe = sorted((n for n in names or () if n not in allowed_globals()), key=lambda n: n.startswith("torch."))
    if unsafe:
        return (f"{path} is refused: it pickles {unsafe[0]}, so loading it would run code from the file (safe loading "
                "runs none); if you trust the file, re-save its state dict as .safetensors "
                "(safetensors.torch.save_file) on a machine where you do")
    if names:
        return (f"{path} names nothing that runs code, but safe loading cannot read its pickle ({cause(e)}); re-save "
                "it with torch.save's default protocol, or as .safetensors (safetensors.torch.save_file)")
    return load_failure(path, e)


def allowed_globals():
    """"module.name" of every global the safe loader takes: torch's allowlist and ours."""
    from torch import _weights_only_unpickler as unpickler

    allowed = getattr(unpickler, "_get_allowed_globals", dict)()
    ours = [*torch.serialization.get_safe_globals(), *SAFE_EXTRA]
    return {*allowed, *(f"{g.__module__}.{g.__qualname__}" for g in ours if hasattr(g, "__qualname__"))}


def pickled_globals(path, max_pickles=5):
    """The globals ("module.name") the pickles of a torch checkpoint name (a zip's data.pkl, or the legacy format's
    pickles in a row), in order; None if no pickle is there. pickletools only reads opcodes: nothing is imported."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                member = next((n for n in z.namelist() if n.endswith("data.pkl")), None)
                if member is None:
                    return None
                with z.open(member) as f:
                    return opcode_globals(f, 1)
        with open(path, "rb") as f:
            return opcode_globals(f, max_pickles)
    except (OSError, zipfile.BadZipFile):
        return None


def opcode_globals(f, max_pickles):
    """The globals named by up to max_pickles pickles read from f; None if the first is not a pickle. STACK_GLOBAL
    takes its names from the two values pushed before it, which may come back from the memo."""
    names, parsed = [], 0
    for _ in range(max_pickles):
        recent, memo = [], {}
        try:
            for op, arg, _ in pickletools.genops(f):
                if op.name in ("GLOBAL", "INST"):
                    names.append(arg.replace(" ", "."))
                elif op.name == "STACK_GLOBAL":
                    names.append(".".join(str(v) for v in recent[-2:]))
                if op.name == "MEMOIZE":
                    memo[len(memo)] = recent[-1] if recent else None
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[arg] = recent[-1] if recent else None
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    recent.append(memo.get(arg))
                elif op.stack_after:
                    recent.append(arg if isinstance(arg, str) else None)
        except ValueError:  # not a pickle (or the storages after the legacy format's pickles)
            break
        parsed += 1
    return names if parsed else None


def unwrap(state_dict):
    """Strip a training wrapper's prefix when every key carries it."""
    for prefix in WRAPPER_PREFIXES:
        if state_dict and all(k.startswith(prefix) for k in state_dict):
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
    return state_dict


def check_state_dict(model, state_dict):
    """(missing, unexpected, wrong_shape) against the model's own state dict."""
    own = model.state_dict()
    given = {k: v for k, v in state_dict.items() if not IGNORED.match(k)}
    missing = [k for k in own if k not in given and k not in OPTIONAL]
    unexpected = [k for k in given if k not in own]
    shared = [k for k in own if k in given]
    wrong = [(k, tuple(given[k].shape), tuple(own[k].shape)) for k in shared if given[k].shape != own[k].shape]
    return missing, unexpected, wrong


def mismatch_report(missing, unexpected, wrong, first=3):
    parts = []
    if wrong:
        shown = ", ".join(f"{k} is {list(got)}, model wants {list(want)}" for k, got, want in wrong[:first])
        parts.append(f"{len(wrong)} of wrong shape ({shown}{', ...' if len(wrong) > first else ''})")
    for what, keys in (("missing", missing), ("unexpected", unexpected)):
        if keys:
            parts.append(f"{len(keys)} {what} ({', '.join(keys[:first])}{', ...' if len(keys) > first else ''})")
    return "; ".join(parts)


def load_weights(model, state_dict, source="checkpoint", hint=""):
    """Copy state_dict into model strictly; raise CheckpointError with a readable report."""
    missing, unexpected, wrong = check_state_dict(model, state_dict)
    if missing or unexpected or wrong:
        report = mismatch_report(missing, unexpected, wrong)
        raise CheckpointError(f"{source} does not fit the model: {report}" + (f". {hint}" if hint else ""))
    with torch.no_grad():
        for k, t in model.state_dict().items():
            if k in state_dict:
                t.copy_(state_dict[k])
            else:
                t.zero_()  # an OPTIONAL entry the file lacks (official values: zeros or unused)


def fit_null_caption(model, state_dict):
    """Take the null caption's row count from the file: the official class always builds 120 rows,
    but files made with cls_token_num rows exist (the official fixtures' cls 8 model). It is data
    (used for its first cls_token_num rows), not architecture."""
    t = state_dict.get("cls_embedding.uncond_embedding")
    own = getattr(getattr(model, "cls_embedding", None), "uncond_embedding", None)
    if t is not None and own is not None and t.dim() == 2 and t.shape[1] == own.shape[1] \
            and model.args.cls_token_num <= t.shape[0] != own.shape[0]:
        model.cls_embedding.uncond_embedding = torch.empty(t.shape, dtype=own.dtype, device=own.device)


@contextlib.contextmanager
def no_init():
    """Build modules without their random initialisers: a checkpoint overwrites every weight anyway,
    and initialising GPT-XL's 0.8 B parameters takes ~10 s on a CPU. Only torch.nn.init is skipped,
    so buffers computed in constructors (the RoPE table) stay correct."""
    names = [n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(torch.nn.init, n) for n in names}
    for n in names:
        setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


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
        info["adapter_width"] = width
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
    if "dim" not in info:
        return "Is this a ControlAR GPT checkpoint? It has no tok_embeddings.weight"
    fixes = []
    if "n_layer" in info and (info["dim"], info["n_layer"]) != (args.dim, args.n_layer):
        names = [n for n, c in GPT_CONFIGS.items() if (c["dim"], c["n_layer"]) == (info["dim"], info["n_layer"])]
        fixes.append(f"--gpt-model {names[0]}" if names else
                     f"--gpt-model CONFIG.json with \"dim\": {info['dim']}, \"n_layer\": {info['n_layer']}")
    if info.get("model_type") not in (None, args.model_type):
        fixes.append(f"--gpt-type {info['model_type']}")
    elif args.model_type == "t2i" and "adapter_width" in info:
        size = {384: "small", 768: "base", 128: "tiny"}.get(info["adapter_width"])
        if size and size != args.adapter_size:
            fixes.append(f"--adapter-size {size}")
    if "caption_dim" in info and info["caption_dim"] != args.caption_dim:
        fixes.append(f"\"caption_dim\": {info['caption_dim']} in the --gpt-model JSON")
    if "block_size" in info and info["block_size"] != args.block_size:
        fixes.append(f"--image-size {int(round(info['block_size'] ** 0.5)) * 16}")
    return ("Likely fix: " + ", ".join(fixes)) if fixes else ""
