"""Checkpoint reading (.safetensors, official .pt layouts) and strict loading with a readable report."""
import argparse
import os
import pathlib
import pickle

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from fast_inference.checkpoint import (CheckpointError, fit_null_caption, gpt_fix_hint, load_weights,
                                       no_init, read_state_dict)
from fast_inference.model import ModelArgs, Transformer


def small_module():
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2, bias=False))


def ddp_checkpoint(sd, key="model"):
    """What the official training scripts torch.save: weights plus the run's argparse Namespace."""
    args = argparse.Namespace(gpt_model="GPT-XL", image_size=512, lr=1e-4, mixed_precision="bf16", no_compile=False)
    return {key: sd, "steps": 1000, "args": args, "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]}}


@pytest.mark.parametrize("layout", ["safetensors", "model", "module", "state_dict", "bare", "ddp_prefix"])
def test_read_layouts(tmp_path, layout):
    src = small_module()
    sd = src.state_dict()
    path = tmp_path / ("w.safetensors" if layout == "safetensors" else "w.pt")
    if layout == "safetensors":
        save_file(sd, path)
    elif layout == "bare":
        torch.save(sd, path)
    elif layout == "ddp_prefix":  # un-unwrapped DDP / torch.compile keys
        torch.save({"model": {"module._orig_mod." + k: v for k, v in sd.items()}}, path)
    else:
        torch.save(ddp_checkpoint(sd, layout), path)
    got = read_state_dict(str(path))
    assert set(got) == set(sd) and all(torch.equal(got[k], sd[k]) for k in sd)
    dst = small_module()
    load_weights(dst, got)
    assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(), sd.values()))


def test_key_order_prefers_model(tmp_path):
    a, b = small_module().state_dict(), small_module().state_dict()
    torch.save({"state_dict": b, "model": a}, tmp_path / "w.pt")
    got = read_state_dict(str(tmp_path / "w.pt"))
    assert torch.equal(got["0.weight"], a["0.weight"])


def tiny_gpt(**kw):
    args = dict(n_layer=3, n_head=2, dim=64, block_size=16, cls_token_num=8, caption_dim=32)
    args.update(kw)
    return Transformer(ModelArgs(**args))


@pytest.fixture(scope="module")
def gpt_files(tmp_path_factory):
    torch.manual_seed(0)
    model = tiny_gpt().eval()
    sd = model.state_dict()
    d = tmp_path_factory.mktemp("gpt")
    save_file(sd, d / "gpt.safetensors")
    # An official state dict taken after setup_caches also holds KV-cache buffers: ignored.
    with_cache = dict(sd, **{f"layers.{i}.attention.kv_cache.{n}": torch.zeros(2, 2, 24, 32)
                             for i in range(3) for n in ("k_cache", "v_cache")})
    torch.save(ddp_checkpoint(with_cache), d / "gpt.pt")
    return model, d


@pytest.mark.parametrize("name", ["gpt.safetensors", "gpt.pt"])
def test_gpt_round_trip(gpt_files, name):
    model, d = gpt_files
    with no_init():
        fresh = tiny_gpt()
    load_weights(fresh, read_state_dict(str(d / name)))
    ours = fresh.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(ours[k], v), k
    x = torch.randn(1, 3, 64)
    for m in (model, fresh):
        m.setup_caches(1, 8 + 16, torch.float32)
    pos, valid = torch.arange(3), torch.ones(1, 24, dtype=torch.bool)
    assert torch.equal(model(x, pos, valid), fresh(x, pos, valid))


def test_no_init_restores_initialisers():
    before = torch.nn.init.kaiming_uniform_
    with no_init():
        lin = nn.Linear(4, 4)
        assert torch.nn.init.kaiming_uniform_ is not before
    assert torch.nn.init.kaiming_uniform_ is before
    assert lin.weight.shape == (4, 4)
    # The RoPE table is computed, not initialised: still right under no_init.
    with no_init():
        m = tiny_gpt()
    assert torch.equal(m.freqs_cis, tiny_gpt().freqs_cis)


def test_optional_keys_may_be_missing(gpt_files):
    model, _ = gpt_files
    sd = {k: v for k, v in model.state_dict().items()
          if k not in ("condition_embeddings.weight", "condition_mlp.uncond_embedding")}
    fresh = tiny_gpt()
    load_weights(fresh, sd)
    assert torch.count_nonzero(fresh.condition_embeddings.weight) == 0  # never read at inference
    assert torch.equal(fresh.output.weight, model.output.weight)


def test_null_caption_rows_come_from_the_file(gpt_files):
    model, _ = gpt_files  # cls_token_num 8
    sd = dict(model.state_dict())
    sd["cls_embedding.uncond_embedding"] = sd["cls_embedding.uncond_embedding"][:8].clone()
    fresh = tiny_gpt()
    fit_null_caption(fresh, sd)
    load_weights(fresh, sd)
    assert torch.equal(fresh.cls_embedding.uncond_embedding, sd["cls_embedding.uncond_embedding"])
    sd["cls_embedding.uncond_embedding"] = sd["cls_embedding.uncond_embedding"][:4].clone()  # fewer than 8: wrong
    fresh = tiny_gpt()
    fit_null_caption(fresh, sd)
    with pytest.raises(CheckpointError, match=r"cls_embedding.uncond_embedding is \[4, 32\], model wants \[120, 32\]"):
        load_weights(fresh, sd)


def test_strict_report_names_keys(gpt_files):
    model, _ = gpt_files
    sd = dict(model.state_dict())
    del sd["norm.weight"]
    sd["extra.weight"] = torch.zeros(3)
    sd["condition_mlp.uncond_embedding"] = torch.zeros(64, 64)  # trained on an 8x8 grid
    margs = model.args
    with pytest.raises(CheckpointError) as e:
        load_weights(tiny_gpt(), sd, source="x.safetensors", hint=gpt_fix_hint(margs, sd))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("x.safetensors does not fit the model")
    assert "1 of wrong shape (condition_mlp.uncond_embedding is [64, 64], model wants [16, 64])" in msg
    assert "1 missing (norm.weight)" in msg and "1 unexpected (extra.weight)" in msg
    assert msg.endswith("Likely fix: --image-size 128")


def meta_sd(name, **kw):
    with torch.device("meta"):
        return Transformer(ModelArgs.from_name(name, **kw)).state_dict()


XL = dict(block_size=1024, adapter_size="small")


@pytest.mark.parametrize("ckpt,args,fix", [
    (("GPT-XL", XL), ("GPT-B", XL), "--gpt-model GPT-XL"),
    (("GPT-XL", dict(XL, adapter_size="base")), ("GPT-XL", XL), "--adapter-size base"),
    (("GPT-XL", dict(XL, block_size=2304)), ("GPT-XL", XL), "--image-size 768"),
    (("GPT-L", dict(block_size=256, model_type="c2i", cls_token_num=1)), ("GPT-L", dict(block_size=256)),
     "--gpt-type c2i"),
    (("GPT-XL", dict(XL, adapter_size="base", block_size=2304)), ("GPT-B", XL),
     "--gpt-model GPT-XL, --adapter-size base, --image-size 768"),
])
def test_fix_hint(ckpt, args, fix):
    sd = meta_sd(ckpt[0], **ckpt[1])
    margs = ModelArgs.from_name(args[0], **args[1])
    assert gpt_fix_hint(margs, sd) == f"Likely fix: {fix}"
    with torch.device("meta"):
        model = Transformer(margs)
    with pytest.raises(CheckpointError, match="does not fit the model: .*Likely fix: " + fix):
        load_weights(model, sd, hint=gpt_fix_hint(margs, sd))


def test_fix_hint_json_config_and_non_gpt():
    sd = tiny_gpt(caption_dim=48).state_dict()
    hint = gpt_fix_hint(ModelArgs.from_name("GPT-B", block_size=16, cls_token_num=8), sd)
    assert '--gpt-model CONFIG.json with "dim": 64, "n_layer": 3' in hint and '"caption_dim": 48' in hint
    assert gpt_fix_hint(tiny_gpt(caption_dim=48).args, sd) == ""
    vq_like = {"decoder.conv_in.weight": torch.zeros(1)}
    assert "Is this a ControlAR GPT checkpoint" in gpt_fix_hint(ModelArgs.from_name("GPT-B"), vq_like)


def test_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_state_dict(str(tmp_path / "nope.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="junk.pt is not a readable torch checkpoint"):
        read_state_dict(str(tmp_path / "junk.pt"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        read_state_dict(str(tmp_path / "junk.safetensors"))
    good = small_module().state_dict()
    torch.save({"weights": good, "steps": 3}, tmp_path / "odd.pt")
    with pytest.raises(CheckpointError, match=r"no state dict under \['model', 'module', 'state_dict'\]"):
        read_state_dict(str(tmp_path / "odd.pt"))
    # Safe loading refuses arbitrary pickled classes; the message names the class and the way out.
    torch.save({"model": good, "args": argparse.Namespace(out=pathlib.PurePosixPath("/x"))}, tmp_path / "path.pt")
    with pytest.raises(CheckpointError, match=r"pickles pathlib.PurePosixPath.*safetensors") as e:
        read_state_dict(str(tmp_path / "path.pt"))
    assert "\n" not in str(e.value)


class RunsCode:
    """Unpickling this calls os.system: what a malicious checkpoint does."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_that_would_run_code_is_refused_plainly(tmp_path):
    """torch 2.6+ blocks os.* with another wording than the allowlist's; both say the file would run code."""
    marker = tmp_path / "ran"
    torch.save({"model": small_module().state_dict(), "payload": RunsCode(marker)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError) as e:
        read_state_dict(str(tmp_path / "evil.pt"))
    msg = str(e.value)
    assert f"pickles {os.system.__module__}.system" in msg and "would run code" in msg and "refused" in msg
    assert "weights_only` set to `False`" not in msg and "download it again" not in msg and "\n" not in msg
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, 4, 5])
@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_the_refusal_is_read_from_the_pickle_not_from_torchs_wording(tmp_path, writer, protocol):
    """torch 2.13 refuses a protocol 4+ pickle at its first opcode ("Unsupported operand 149"), before it reaches the
    global: the pickle's own opcodes say it would run code, whatever torch's words, for torch's files and plain ones."""
    marker, path = tmp_path / "ran", tmp_path / "evil.pt"
    payload = {"model": small_module().state_dict(), "payload": RunsCode(marker)}
    if writer == "torch.save":
        torch.save(payload, path, pickle_protocol=protocol)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=protocol)
    with pytest.raises(CheckpointError) as e:
        read_state_dict(str(path))
    msg = str(e.value)
    assert msg == (f"{path} is refused: it pickles {os.system.__module__}.system, so loading it would run code from "
                   "the file (safe loading runs none); if you trust the file, re-save its state dict as .safetensors "
                   "(safetensors.torch.save_file) on a machine where you do")
    assert not marker.exists()


def test_a_safe_pickle_the_safe_loader_cannot_read_is_not_called_code_or_broken(tmp_path):
    torch.save({"model": small_module().state_dict()}, tmp_path / "p4.pt", pickle_protocol=4)
    try:
        read_state_dict(str(tmp_path / "p4.pt"))  # a torch that reads protocol 4 safely
    except CheckpointError as e:
        assert "names nothing that runs code" in str(e) and "default protocol" in str(e), e
        assert "would run code" not in str(e) and "download it again" not in str(e)


def test_a_broken_pickle_names_its_cause_not_torchs_unsafe_advice(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError) as e:
        read_state_dict(str(tmp_path / "junk.pt"))
    assert "download it again" in str(e.value) and "weights_only" not in str(e.value)
