"""scripts/train_demo.py: its training forward is the model's, a few steps of a tiny preset run on the CPU, the same
seed gives the same files, and what it writes loads and samples through fast_engine.py (the demo text encoder)."""
import json
import math
import os
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import ROOT
from fast_inference import demo_text, fast_engine, scenes
from fast_inference.checkpoint import read_metadata
from fast_inference.generate import prepare
from fast_inference.model import ModelArgs, Transformer
from fast_inference.vq import VQConfig, VQModel

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import train_demo  # noqa: E402


pytestmark = pytest.mark.usefixtures("one_thread")


def test_teacher_forced_logits_are_the_models():
    """Training runs the model's own forward without caches (whole sequence, autograd): the logits of its cached
    prefill, which the engines run: same control positions, text mask, RoPE rows."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layer=6, n_head=2, caption_dim=16, cls_token_num=20, vocab_size=64,
                                  block_size=16, adapter_size="tiny")).eval()
    train_demo.init_gpt(model)
    torch.nn.init.normal_(model.output.weight, std=0.02)  # the zero init would make every logit 0
    emb, mask = demo_text.DemoTextEncoder(16, 20).encode_left_padded(
        ["a red circle", "an orange diamond and a blue square on a white and black background"])
    batch = scenes.scenes(range(2))
    control = scenes.to_model_range(scenes.control(batch, "canny", 64))
    tokens = torch.randint(0, 64, (2, 16))
    p = prepare(model, emb, control, mask)
    got = train_demo.teacher_forced_logits(model, p.prefix, p.text_mask, p.controls, tokens)  # no caches yet
    got.logsumexp(-1).mean().backward()
    assert all(layer.attention.wqkv.weight.grad.abs().max() > 0 for layer in model.layers)
    with torch.no_grad():
        T = p.prefix.shape[1]
        model.setup_caches(2, T + 16, torch.float32)
        x = torch.cat([p.prefix, model.tok_embeddings(tokens[:, :-1])], 1)
        want = model(x, torch.arange(T + 15), p.key_valid(model.max_seq), p.controls)[:, T - 1:]
        features = train_demo.control_features(model, scenes.control(batch, "canny", 64), ["canny", "canny"])
    assert (got.detach() - want).abs().max() < 1e-5
    assert torch.allclose(features, model.encode_control(control), atol=1e-6)


def train(out, *extra):
    train_demo.main(["--preset", "test", "--out", str(out), "--log-every", "100", *map(str, extra)])


def listing(folder):
    """{name: (size, mtime)} of a folder's files; None where it does not exist."""
    if not folder.exists():
        return None
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def refused(capsys, out, *extra):
    """train(out, *extra) refused as the user's mistake: exit code 2, one `error:` line on stderr (returned), and
    --out as it was (not made, or the same files of the same sizes and times)."""
    before = listing(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train(out, *extra)
    err = capsys.readouterr().err.splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), (e.value.code, err)
    assert listing(out) == before
    return err[0]


def same_tensors(p, q):
    x, y = load_file(p), load_file(q)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_training_is_seeded_and_its_files_load(tmp_path, capsys):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(a)
    train(b)
    train(c, "--seed", 1, "--phase", "vq")
    for name in ("gpt.json", "vq.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    for name in ("gpt.safetensors", "vq.safetensors"):  # (the header's metadata order is not fixed: compare tensors)
        assert same_tensors(a / name, b / name) and read_metadata(a / name) == read_metadata(b / name), name
    assert not same_tensors(a / "vq.safetensors", c / "vq.safetensors")
    assert "val_psnr" in (a / "train_log.jsonl").read_text()

    # The files are a model of the project: the CLI loads them strictly and samples with the word encoder.
    control = scenes.control(scenes.scenes([0]), "canny", 64)[0].permute(1, 2, 0).numpy()
    Image.fromarray(control).save(tmp_path / "c.png")
    argv = ["--gpt-model", a / "gpt.json", "--gpt-ckpt", a / "gpt.safetensors", "--vq-model", a / "vq.json",
            "--vq-ckpt", a / "vq.safetensors", "--condition-type", "canny", "--condition-path", tmp_path / "c.png",
            "--prompt", "a red circle on a blue background", "--device", "cpu", "--top-k", "1"]
    fast_engine.main([str(x) for x in argv + ["--save-tokens", tmp_path / "t.npy", "--out", tmp_path / "grid.png"]])
    assert np.load(tmp_path / "t.npy").shape == (1, 16)
    assert Image.open(tmp_path / "grid.png").size == (2 * 66 + 2, 68)
    with pytest.raises(SystemExit) as e:
        fast_engine.main([str(x) for x in argv] + ["--prompt", "a red dog"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.startswith("error: the demo model knows no 'dog'") and "triangle" in err


def test_gpt_goes_on_from_a_trained_one(tmp_path, capsys):
    """--gpt-from starts the GPT from stored weights (steps counted on), and refuses another preset's model."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    train(a)
    train(b, "--phase", "gpt", "--vq-from", a, "--gpt-from", a, "--gpt-steps", 0)
    assert same_tensors(a / "gpt.safetensors", b / "gpt.safetensors")  # no step: the weights it started from
    assert read_metadata(b / "gpt.safetensors")["trained_steps"] == "3"
    train(c, "--phase", "gpt", "--vq-from", a, "--gpt-from", a, "--time-limit", 1e-9)
    train(c, "--phase", "gpt", "--vq-from", a, "--resume")  # the steps of the model it started from still count
    assert read_metadata(c / "gpt.safetensors")["trained_steps"] == "6"
    assert not same_tensors(a / "gpt.safetensors", c / "gpt.safetensors")
    err = refused(capsys, tmp_path / "d", "--preset", "cpu", "--phase", "gpt", "--vq-from", a, "--gpt-from", a)
    assert "not this preset's model" in err and "give the --preset it was trained with" in err


def caption_log(folder):
    """--phase caption's logged steps."""
    rows = [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("phase") == "caption" and "step" in r]


def test_the_caption_phase_trains_the_caption_mlp_alone(tmp_path, capsys):
    """--phase caption: from a trained GPT's folder, a model's folder whose weights differ from it in the caption MLP
    only (the null caption kept), its VQ copied along; the binding head reads more colours as it trains, and
    --caption-keep holds the MLP's outputs nearer the old ones; a missing --gpt-from is one error line."""
    a, b, c, d = tmp_path / "a", tmp_path / "b", tmp_path / "c", tmp_path / "d"
    train(a)
    train(b, "--phase", "caption", "--gpt-from", a, "--caption-steps", 60, "--log-every", 20, "--caption-keep", 0)
    assert (a / "gpt.json").read_bytes() == (b / "gpt.json").read_bytes()
    assert all((a / n).read_bytes() == (b / n).read_bytes() for n in ("vq.json", "vq.safetensors"))
    x, y = load_file(a / "gpt.safetensors"), load_file(b / "gpt.safetensors")
    changed = {k for k in x if not torch.equal(x[k], y[k])}
    assert x.keys() == y.keys() and changed and all(k.startswith("cls_embedding.cap_proj.") for k in changed), changed
    assert read_metadata(b / "gpt.safetensors")["caption_steps"] == "60"
    free = caption_log(b)
    assert len(free) == 3 and free[-1]["test_binding_accuracy"] > free[0]["test_binding_accuracy"], free
    train(c, "--phase", "caption", "--gpt-from", a, "--caption-steps", 60, "--log-every", 20, "--caption-keep", 1e4)
    assert caption_log(c)[-1]["caption_change"] < free[-1]["caption_change"] / 2, (caption_log(c), free)
    assert "give --gpt-from its folder" in refused(capsys, d, "--phase", "caption")
    assert "has no gpt.json" in refused(capsys, d, "--phase", "caption", "--gpt-from", tmp_path)
    assert "give the folder of a trained VQ" in refused(capsys, d, "--phase", "caption", "--gpt-from", a, "--vq-from",
                                                        tmp_path)


def test_a_run_stopped_and_resumed_is_the_run_never_stopped(tmp_path, capsys):
    """--time-limit stops after a step and saves the run's state; --resume goes on (schedule, data order, random
    states, average, the colour, binding and kind heads, the run's batch, LR and loss weights without their flags): the same
    weights as one uninterrupted run, and the log says where it resumed; a recipe flag that differs from the run's is
    refused."""
    a, b = tmp_path / "a", tmp_path / "b"
    recipe = ("--gpt-batch", 3, "--gpt-lr", 1e-3, "--entry-weight", 2, "--colour-weight", 0.5, "--binding-weight", 0.5,
              "--kind-weight", 0.5)
    train(a, "--gpt-steps", 12, *recipe)  # an average of decay 1/6 from step 2 on
    train(b, "--phase", "gpt", "--vq-from", a, "--gpt-steps", 12, "--time-limit", 1e-9, *recipe)
    assert read_metadata(b / "gpt.safetensors")["trained_steps"] == "1"
    for _ in range(11):
        train(b, "--phase", "gpt", "--vq-from", a, "--resume", "--time-limit", 1e-9)
    assert read_metadata(b / "gpt.safetensors")["trained_steps"] == "12"
    assert same_tensors(a / "gpt.safetensors", b / "gpt.safetensors")
    log = (b / "train_log.jsonl").read_text()
    assert '"resumed_at": 11' in log and '"colour_weight": 0.5' in log and "colour_accuracy_at_onsets" in log
    assert '"kind_weight": 0.5' in log and "kind_accuracy" in log
    assert '"binding_weight": 0.5' in log and "binding_accuracy" in log
    c, d, e = tmp_path / "c", tmp_path / "d", tmp_path / "e"
    train(c, "--gpt-steps", 12, *recipe[:-2])  # no kind head
    assert not same_tensors(a / "gpt.safetensors", c / "gpt.safetensors")
    train(e, "--gpt-steps", 12, *recipe[:-4])  # no binding head either
    assert not same_tensors(c / "gpt.safetensors", e / "gpt.safetensors")
    train(d, "--gpt-steps", 12, "--gpt-batch", 3, "--gpt-lr", 1e-3, "--entry-weight", 2)  # no colour head
    assert not same_tensors(e / "gpt.safetensors", d / "gpt.safetensors")
    assert "run's --colour-weight 0.5" in refused(capsys, b, "--phase", "gpt", "--vq-from", a, "--resume",
                                                  "--colour-weight", 1)  # the run's files untouched
    assert "run's --kind-weight 0.5" in refused(capsys, b, "--phase", "gpt", "--vq-from", a, "--resume",
                                                "--kind-weight", 1)


@pytest.mark.parametrize("flags, fix", [
    (["--hide-until", "e1"], "give --colour-weight too"),
    (["--hide-dropped"], "give --colour-weight too"),
    (["--colour-weight", "1", "--recolour-share", "0.1"], "give --hide-until e1 too"),
    (["--colour-weight", "1", "--hide-until", "e1", "--recolour-share", "1.5"], "give a number from 0 to 1"),
    (["--kind-weight", "-1"], "give a number >= 0"),
    (["--binding-weight", "-0.5"], "give a number >= 0"),
    (["--phase", "gpt"], "give --vq-from a trained VQ's folder"),
    (["--phase", "gpt", "--vq-from", "{tmp}"], "give the folder of a trained VQ"),
    (["--gpt-from", "{tmp}"], "give the folder of a trained GPT"),
    (["--phase", "gpt", "--resume", "--gpt-from", "{tmp}"], "leave out --gpt-from"),
    (["--phase", "gpt", "--resume"], "start the run without --resume"),
    (["--resume"], "add --phase gpt"),
    (["--device", "tpu7"], "use cpu, cuda or cuda:N"),
    (["--phase", "train"], "invalid choice"),
])
def test_a_users_mistake_is_one_error_line_and_writes_nothing(tmp_path, capsys, flags, fix):
    """Flags that cannot run (or name a folder without its files: {tmp}, an empty one) are refused before --out
    is made: exit code 2, one `error:` line naming the fix, no folder."""
    err = refused(capsys, tmp_path / "run", *[f.format(tmp=tmp_path) for f in flags])
    assert fix in err, err


def test_a_short_runs_average_forgets_its_first_steps():
    """The average's horizon is at most a tenth of the run (the GPU preset's 1,300-step run kept 56% of step 130)."""
    gpu = train_demo.PRESETS["gpu"]
    for steps in (100, 1300, 3000):
        assert 1 / (1 - train_demo.ema_decay(gpu, steps)) <= steps / 10 + 1e-6
    assert train_demo.ema_decay(gpu, 10**6) == gpu["ema"]


def test_the_gpu_trained_demo_model_loads_and_predicts_held_out_scenes():
    """checkpoints/demo_gpu: the files load strictly (only the keys unused at inference absent), name their text
    encoder and size, and the GPT predicts the tokens of held-out scenes under their caption and canny control far
    better than chance (ln 4,096 = 8.3 nats; it scored 1.19 on the val batch in training): weights that are not the
    trained ones fail."""
    folder = os.path.join(ROOT, "checkpoints", "demo_gpu")
    meta = read_metadata(os.path.join(folder, "gpt.safetensors"))
    assert (meta["text_encoder"], meta["image_size"]) == (demo_text.NAME, "256")
    model = Transformer(ModelArgs(**ModelArgs.read_json(os.path.join(folder, "gpt.json"))))
    stored = {k: v.float() for k, v in load_file(os.path.join(folder, "gpt.safetensors")).items()}
    missing, unexpected = model.load_state_dict(stored, strict=False)
    assert not unexpected and set(missing) == set(train_demo.UNUSED_AT_INFERENCE)
    vq = train_demo.load_vq(folder, torch.device("cpu"))
    preset, types = train_demo.PRESETS["gpu"], ["canny"] * 4
    with torch.no_grad():
        tokens = vq.encode(train_demo.images(range(4), 256, "cpu", "val")[2])
        encoder = demo_text.DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num)
        loss = train_demo.gpt_loss(model.eval(), encoder, vq, range(4), types, np.zeros(4, bool), tokens, preset,
                                   torch.device("cpu"), split="val")[0].item()
    assert loss < 2.0, loss


def test_entry_weights_mark_each_regions_first_tokens_in_raster_order():
    """--entry-weight: the first ENTRY_TOKENS tokens of each shape and of the background, by each token's centre pixel
    in raster order, weigh `weight`; every other token 1. Checked against the regions counted token by token."""
    batch = scenes.scenes(range(6), "test")
    size, grid = 128, 8
    w = train_demo.entry_weights(batch, size, grid, 5.0, "cpu")
    label, inside = scenes.labels(batch, size)
    step = size // grid
    for b in range(len(batch)):
        seen, expected = {}, []
        for i in range(grid):
            for j in range(grid):
                y, x = i * step + step // 2, j * step + step // 2
                shapes = [k for k in range(inside.shape[1]) if inside[b, k, y, x]]
                region = ("shape", shapes[0]) if shapes else ("ground", int(label[b, y, x] == 1))
                seen[region] = seen.get(region, 0) + 1
                expected.append(5.0 if seen[region] <= train_demo.ENTRY_TOKENS else 1.0)
        assert w[b].tolist() == expected, b
    assert (w == 5.0).any() and (w == 1.0).any()


def test_the_entry_weight_changes_the_loss_only_where_asked():
    """gpt_loss with entry_weight 1 is the plain mean; another weight is the weighted mean of the same per-token
    losses (so the weights reach the loss: a weight applied nowhere, or everywhere, fails)."""
    torch.manual_seed(0)
    preset = train_demo.PRESETS["test"]
    model = Transformer(ModelArgs(**train_demo.gpt_args(preset, dict(codebook_size=64, z_channels=32))))
    train_demo.init_gpt(model)
    torch.nn.init.normal_(model.output.weight, std=0.5)  # the official init zeroes it: every token would score ln V
    encoder = demo_text.DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num)
    n = preset["size"] // 16
    tokens = torch.randint(0, 64, (2, n * n))
    args = (model.eval(), encoder, None, range(2), ["canny", "seg"], np.zeros(2, bool), tokens, preset,
            torch.device("cpu"))
    with torch.no_grad():
        plain = train_demo.gpt_loss(*args)[0].item()
        weighted = train_demo.gpt_loss(*args, entry_weight=4.0)[0].item()
        batch = scenes.scenes(range(2), "train")
        rgb = scenes.render(batch, preset["size"])
        maps = train_demo.control_maps(batch, ["canny", "seg"], rgb, preset["size"], torch.device("cpu"))
        prefix, mask, controls = train_demo.gpt_inputs(model, encoder, batch, maps, ["canny", "seg"],
                                                       torch.zeros(2, dtype=torch.bool))
        per = torch.nn.functional.cross_entropy(
            train_demo.teacher_forced_logits(model, prefix, mask, controls, tokens).flatten(0, 1), tokens.flatten(),
            reduction="none").view(tokens.shape)
        w = train_demo.entry_weights(batch, preset["size"], n, 4.0, "cpu")
    assert abs(plain - per.mean().item()) < 1e-5
    assert abs(weighted - ((per * w).sum() / w.sum()).item()) < 1e-5 and abs(weighted - plain) > 1e-4


def token_centres(batch, size, grid):
    """(b, t, scene, the shapes holding token t's centre pixel, whether that pixel is the bottom background), token by
    token from the scenes' labels."""
    label, inside = scenes.labels(batch, size)
    step = size // grid
    for b, s in enumerate(batch):
        for t in range(grid * grid):
            y, x = (t // grid) * step + step // 2, (t % grid) * step + step // 2
            yield b, t, s, [k for k in range(len(s.shapes)) if inside[b, k, y, x]], label[b, y, x] == 1


def test_token_colours_name_each_tokens_region_colour():
    """The palette colour of each token's region (its centre pixel's shape, else the background part), checked token by
    token against the scenes."""
    batch = scenes.scenes(range(8), "test")
    size, grid = 128, 8
    got = train_demo.token_colours(batch, size, grid, "cpu")
    for b, t, s, shapes, bottom in token_centres(batch, size, grid):
        name = s.shapes[shapes[0]].colour if shapes else (s.bottom if bottom else s.top)
        assert scenes.COLOURS[got[b, t]] == name, (b, t)


def test_a_shape_hidden_before_its_onset():
    """--colour-weight's rows: tokens before the chosen shape's onset are the scene's drawn without it, from the onset
    on the scene's own; the onset's patch is the first (raster order) to hold a pixel of the shape; only captioned
    rows with shapes are chosen; the colour head is scored there, on the shape's colour."""
    torch.manual_seed(0)
    size, grid = 128, 8
    batch = scenes.scenes(range(16), "test")
    vq = VQModel(VQConfig(codebook_size=64, ch=32, ch_mult=[1, 1, 1, 1, 1], z_channels=32, num_res_blocks=1,
                          norm_groups=8)).eval()
    with torch.no_grad():
        tokens = vq.encode(scenes.to_model_range(scenes.render(batch, size)))
    drop = torch.tensor([i % 4 == 0 for i in range(16)])
    got, rows, at, colours = train_demo.hide_before_onset(batch, tokens, vq, size, drop)
    assert 0 < len(rows) < 16 and not drop[rows].any()
    _, inside = scenes.labels(batch, size)
    patches = inside.view(16, 3, grid, 16, grid, 16).any(5).any(3).flatten(2)  # (B, 3, N)
    for r, a, c in zip(rows.tolist(), at.tolist(), colours.tolist()):
        s = batch[r]
        k = [j for j, x in enumerate(s.shapes) if scenes.COLOURS.index(x.colour) == c][0]
        assert patches[r, k, a] and not patches[r, k, :a].any()
        with torch.no_grad():
            alone = vq.encode(scenes.to_model_range(scenes.render([train_demo.without_shape(s, k)], size)))[0]
        assert torch.equal(got[r, :a], alone[:a]) and torch.equal(got[r, a:], tokens[r, a:])
        assert len(train_demo.without_shape(s, k).shapes) == len(s.shapes) - 1
    others = [i for i in range(16) if i not in rows.tolist()]
    assert torch.equal(got[others], tokens[others])
    head = torch.nn.Linear(8, len(scenes.COLOURS))
    hidden = torch.randn(16, grid * grid, 8)
    loss, accuracy = train_demo.colour_loss(head, hidden, rows, at, colours, drop)
    logits = head(torch.nn.functional.rms_norm(hidden[rows, at], (8,)))
    assert abs(loss.item() - torch.nn.functional.cross_entropy(logits, colours).item()) < 1e-6
    assert accuracy.item() == (logits.argmax(-1) == colours).float().mean().item()


def onset_reference(batch, tokens, vq, size, drop):
    """hide_before_onset as it was before --hide-until (commit e566959): the onset mode must stay it, draw for draw."""
    count = torch.tensor([len(s.shapes) for s in batch])
    picked = (torch.rand(len(batch)) < train_demo.HIDE_SHARE) & (count > 0) & ~drop.cpu()
    slot = (torch.rand(len(batch)) * count).long()
    rows = picked.nonzero().flatten().tolist()
    sub, ks = [batch[r] for r in rows], slot[rows].tolist()
    colours = torch.tensor([scenes.COLOURS.index(s.shapes[k].colour) for s, k in zip(sub, ks)])
    rows = torch.tensor(rows, dtype=torch.long)
    at = train_demo.onsets(sub, ks, size, 8, "cpu")
    with torch.no_grad():
        clean = vq.encode(scenes.to_model_range(scenes.render([train_demo.without_shape(s, k) for s, k in zip(sub, ks)],
                                                              size)))
    tokens = tokens.clone()
    before = torch.arange(tokens.shape[1])[None] < at[:, None]
    tokens[rows] = torch.where(before, clean.to(tokens.dtype), tokens[rows])
    return tokens, rows, at, colours


def first_centre_inside(inside, b, k, grid, step):
    """The first token (raster order) whose patch centre pixel lies inside shape k of scene b, counted pixel by pixel."""
    for t in range(grid * grid):
        if inside[b, k, (t // grid) * step + step // 2, (t % grid) * step + step // 2]:
            return t
    return None


def encode(vq, batch, size):
    with torch.no_grad():
        return vq.encode(scenes.to_model_range(scenes.render(batch, size)))


def test_hide_until_onset_is_todays_hiding_draw_for_draw():
    """--hide-until onset (the default): the same tokens, rows, onsets, colours and random draws as before the flag."""
    size, batch = 128, scenes.scenes(range(12), "test")
    vq = VQModel(VQConfig(codebook_size=64, ch=32, ch_mult=[1, 1, 1, 1, 1], z_channels=32, num_res_blocks=1,
                          norm_groups=8)).eval()
    tokens, drop = encode(vq, batch, size), torch.tensor([i % 5 == 0 for i in range(12)])
    torch.manual_seed(3)
    want, after = onset_reference(batch, tokens, vq, size, drop), torch.rand(4)
    for until in ((), ("onset",), ("onset", False)):  # --hide-dropped off too
        torch.manual_seed(3)
        got = train_demo.hide_before_onset(batch, tokens, vq, size, drop, *until)
        assert all(torch.equal(x, y) for x, y in zip(got, want)) and torch.equal(torch.rand(4), after)


def test_hide_until_e1_hides_up_to_the_first_interior_token(monkeypatch):
    """--hide-until e1: the tokens before the picked shape's e1 (its first token whose patch centre is inside it,
    counted here pixel by pixel) come from the scene without it or, in some rows, with it in a wrong colour (never the
    background's or a shape's), from e1 on the scene's own; the wrong colour's tokens differ from the true scene's and
    the shape-removed one's where the shape shows; the colour head reads at the e1s. The trained VQ, so that colours
    show in the tokens (hiding through e1 inclusive fails here)."""
    size, grid, step = 128, 8, 16
    batch = scenes.scenes(range(20), "test")
    vq = train_demo.load_vq(os.path.join(ROOT, "checkpoints", "demo_gpu"), torch.device("cpu"))
    tokens, drop = encode(vq, batch, size), torch.zeros(20, dtype=torch.bool)
    made, recoloured = {}, train_demo.recoloured
    monkeypatch.setattr(train_demo, "recoloured", lambda s, k, p=0: made.setdefault(id(s), recoloured(s, k, p)))
    torch.manual_seed(0)
    got, rows, at, colours = train_demo.hide_before_onset(batch, tokens, vq, size, drop, "e1")
    _, inside = scenes.labels(batch, size)
    touched = inside.view(20, 3, grid, step, grid, step).any(5).any(3).flatten(2)  # (B, 3, N)
    ks = [[j for j, x in enumerate(batch[r].shapes) if scenes.COLOURS.index(x.colour) == c][0]
          for r, c in zip(rows.tolist(), colours.tolist())]
    e1 = [first_centre_inside(inside, r, k, grid, step) for r, k in zip(rows.tolist(), ks)]
    assert None not in e1 and at.tolist() == e1  # the head's positions
    sub = [batch[r] for r in rows.tolist()]
    wrong = [s for s in sub if id(s) in made]
    assert 0 < len(wrong) < len(sub)  # both kinds of row
    without = encode(vq, [train_demo.without_shape(s, k) for s, k in zip(sub, ks)], size)
    other = encode(vq, [made.get(id(s), s) for s in sub], size)
    differs_at_e1, sliver = 0, 0
    for i, (r, k, a) in enumerate(zip(rows.tolist(), ks, e1)):
        s, shown = batch[r], touched[r, k, :a]
        assert torch.equal(got[r, a:], tokens[r, a:])
        differs_at_e1 += int(without[i, a] != tokens[r, a])
        if id(s) not in made:
            assert torch.equal(got[r, :a], without[i, :a])
            continue
        colour = made[id(s)].shapes[k].colour
        assert colour not in {s.top, s.bottom} | {x.colour for x in s.shapes}
        assert [x.colour for j, x in enumerate(made[id(s)].shapes) if j != k] == [x.colour for j, x in
                                                                                   enumerate(s.shapes) if j != k]
        assert torch.equal(got[r, :a], other[i, :a])
        if shown.any():  # a sliver above e1 (else e1 is the onset)
            sliver += 1
            assert (got[r, :a][shown] != tokens[r, :a][shown]).any()
            assert (got[r, :a][shown] != without[i, :a][shown]).any()
    assert differs_at_e1 > 0 and sliver > 0  # so that hiding e1 too, or a recolour not shown, would show
    others = [i for i in range(20) if i not in rows.tolist()]
    assert torch.equal(got[others], tokens[others])


def test_recoloured_never_takes_a_background_or_shape_colour():
    for s in scenes.scenes(range(40), "test"):
        for k in range(len(s.shapes)):
            for p in range(len(scenes.COLOURS)):
                t = train_demo.recoloured(s, k, p)
                assert t.shapes[k].colour not in {s.top, s.bottom} | {x.colour for x in s.shapes}
                assert s.shapes[k].colour != t.shapes[k].colour and t.caption != "" and s.shapes[k] is not t.shapes[k]


def test_hide_until_is_part_of_the_runs_recipe(tmp_path, capsys):
    """--hide-until: logged with the recipe, kept by --resume (another value refused), refused without
    --colour-weight; a state stored before the flag resumes as onset."""
    a = tmp_path / "a"
    train(a, "--gpt-steps", 2, "--colour-weight", 1, "--hide-until", "e1", "--time-limit", 1e-9)
    train(a, "--phase", "gpt", "--resume")
    log = (a / "train_log.jsonl").read_text()
    assert log.count('"hide_until": "e1"') == 2 and '"resumed_at": 1' in log
    assert "run's --hide-until e1" in refused(capsys, a, "--phase", "gpt", "--resume", "--hide-until", "onset")
    assert "give --colour-weight" in refused(capsys, tmp_path / "b", "--phase", "gpt", "--vq-from", a,
                                             "--hide-until", "e1")
    args = train_demo.parse_args(["--out", "x"])
    old = dict(gpt_batch=3, gpt_lr=1e-3, entry_weight=2.0, colour_weight=0.5)
    assert train_demo.run_recipe(args, train_demo.PRESETS["test"], dict(recipe=old)) == dict(
        old, hide_until="onset", hide_dropped=False, recolour_share=train_demo.RECOLOUR_SHARE, kind_weight=0.0,
        binding_weight=0.0)


def picks_reference(batch, drop, dropped):
    """hide_before_onset's draws restated: a row is hidden if its first draw is under HIDE_SHARE, it has shapes and it
    is captioned (dropped, --hide-dropped: or not); its second draw picks the shape -> (rows, slots)."""
    u, v = torch.rand(len(batch)), torch.rand(len(batch))
    rows = [i for i, s in enumerate(batch) if u[i] < train_demo.HIDE_SHARE and s.shapes and (dropped or not drop[i])]
    return rows, [int(v[i] * len(batch[i].shapes)) for i in rows]


def test_hide_dropped_hides_dropped_rows_as_captioned_ones(monkeypatch):
    """--hide-dropped (--hide-until e1): the rows are drawn among all rows with shapes, the CFG-dropped ones too, by
    the same draws as without it (off: the captioned picks and draws of before the flag, the rng left where it was;
    on: those plus the dropped rows the same draws pick, same shapes); every picked row, dropped or not, holds the scene
    without the shape (or recoloured, by the same draws) before e1, counted pixel by pixel, its own tokens from e1."""
    size, grid, step = 128, 8, 16
    batch = scenes.scenes(range(16), "test")
    vq = VQModel(VQConfig(codebook_size=64, ch=32, ch_mult=[1, 1, 1, 1, 1], z_channels=32, num_res_blocks=1,
                          norm_groups=8)).eval()
    tokens, drop = encode(vq, batch, size), torch.tensor([i % 3 == 0 for i in range(16)])
    made, recoloured = {}, train_demo.recoloured
    monkeypatch.setattr(train_demo, "recoloured", lambda s, k, p=0: made.setdefault(id(s), recoloured(s, k, p)))
    _, inside = scenes.labels(batch, size)
    touched = inside.view(16, 3, grid, step, grid, step).any(5).any(3).flatten(2)  # (B, 3, N)
    picks = {}
    for dropped in (False, True):
        made.clear()
        torch.manual_seed(1)  # a seed whose dropped picks hold both kinds of hidden context
        want, slots = picks_reference(batch, drop, dropped)
        wrong = (torch.rand(len(want)) < train_demo.RECOLOUR_SHARE).tolist()
        torch.randint(0, len(scenes.COLOURS), (len(want),))
        after = torch.rand(4)
        torch.manual_seed(1)
        got, rows, at, colours = train_demo.hide_before_onset(batch, tokens, vq, size, drop, "e1", dropped)
        assert rows.tolist() == want and torch.equal(torch.rand(4), after)  # the same draws, no other
        assert colours.tolist() == [scenes.COLOURS.index(batch[r].shapes[k].colour) for r, k in zip(want, slots)]
        assert [id(batch[r]) in made for r in want] == wrong
        e1 = [first_centre_inside(inside, r, k, grid, step) for r, k in zip(want, slots)]
        e1 = [touched[r, k].int().argmax().item() if a is None else a for r, k, a in zip(want, slots, e1)]
        assert at.tolist() == e1
        hidden = encode(vq, [made.get(id(batch[r])) or train_demo.without_shape(batch[r], k)
                             for r, k in zip(want, slots)], size)
        for i, (r, a) in enumerate(zip(want, e1)):
            assert torch.equal(got[r, :a], hidden[i, :a]) and torch.equal(got[r, a:], tokens[r, a:]), r
        others = [i for i in range(16) if i not in want]
        assert torch.equal(got[others], tokens[others])
        picks[dropped] = dict(zip(want, zip(slots, wrong)))
    off, on = picks[False], picks[True]
    assert not any(drop[r] for r in off)
    extra = [r for r in on if r not in off]
    assert all(drop[r] for r in extra) and {r: on[r][0] for r in off} == {r: k for r, (k, _) in off.items()}
    assert {on[r][1] for r in extra} == {True, False}  # dropped rows without the shape and recoloured


def test_recolour_share_sets_how_many_hidden_rows_show_a_decoy(monkeypatch):
    """--recolour-share P: of the rows --hide-until e1 hides, those whose draw is under P show the shape recoloured,
    the rest the scene without it; the same draws at any P (0: none recoloured, 1: all), so the rows picked and the
    random state after them do not move."""
    size = 128
    batch = scenes.scenes(range(16), "test")
    vq = VQModel(VQConfig(codebook_size=64, ch=32, ch_mult=[1, 1, 1, 1, 1], z_channels=32, num_res_blocks=1,
                          norm_groups=8)).eval()
    tokens, drop = encode(vq, batch, size), torch.zeros(16, dtype=torch.bool)
    made, recoloured = set(), train_demo.recoloured
    monkeypatch.setattr(train_demo, "recoloured", lambda s, k, p=0: made.add(id(s)) or recoloured(s, k, p))
    seen = {}
    for share in (0.0, 0.3, 1.0):
        made.clear()
        torch.manual_seed(2)
        _, rows, _, _ = train_demo.hide_before_onset(batch, tokens, vq, size, drop, "e1", False, share)
        seen[share] = (rows.tolist(), torch.rand(1).item(), sum(id(batch[r]) in made for r in rows.tolist()))
    (rows, after, none), (rows3, after3, some), (rows1, after1, every) = seen[0.0], seen[0.3], seen[1.0]
    assert rows == rows3 == rows1 and after == after3 == after1 and len(rows) > 3
    assert (none, every) == (0, len(rows)) and 0 < some < len(rows)


def test_recolour_share_is_part_of_the_runs_recipe(tmp_path, monkeypatch, capsys):
    """--recolour-share: logged with the recipe, reaches the training steps' hiding, kept by --resume (another value
    refused); RECOLOUR_SHARE without the flag."""
    a, b = tmp_path / "a", tmp_path / "b"
    calls, hide = [], train_demo.hide_before_onset
    monkeypatch.setattr(train_demo, "hide_before_onset", lambda *a: calls.append(a[7]) or hide(*a))
    train(a, "--gpt-steps", 2, "--colour-weight", 1, "--hide-until", "e1", "--recolour-share", 0.1,
          "--time-limit", 1e-9)
    train(a, "--phase", "gpt", "--resume")
    log = (a / "train_log.jsonl").read_text()
    assert log.count('"recolour_share": 0.1') == 2 and calls == [0.1, 0.1]
    assert "run's --recolour-share 0.1" in refused(capsys, a, "--phase", "gpt", "--resume", "--recolour-share", 0.5)
    train(b, "--phase", "gpt", "--vq-from", a, "--gpt-steps", 2, "--colour-weight", 1, "--hide-until", "e1",
          "--time-limit", 1e-9)
    assert calls[-1] == train_demo.RECOLOUR_SHARE


def test_token_kinds_name_the_kind_of_each_tokens_shape():
    """The kind of the shape each token's centre pixel is inside (-1 outside every shape), token by token."""
    batch = scenes.scenes(range(8), "test")
    size, grid = 128, 8
    got = train_demo.token_kinds(batch, size, grid, "cpu")
    for b, t, s, shapes, _ in token_centres(batch, size, grid):
        assert got[b, t] == (scenes.KINDS.index(s.shapes[shapes[0]].kind) if shapes else -1), (b, t)
    assert (got >= 0).any() and (got < 0).any()


def test_the_kind_head_reads_the_shapes_tokens_of_the_captioned_rows():
    """kind_loss: the cross-entropy and accuracy of the kind head over the tokens inside a shape, the dropped rows'
    skipped (their features are zeroed); no such token: no loss."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, len(scenes.KINDS))
    features = torch.randn(3, 10, 8)
    kinds = torch.full((3, 10), -1)
    kinds[0, 2:5], kinds[1, 0:3], kinds[2, 6:9] = 1, 3, 0
    drop = torch.tensor([False, True, False])
    loss, accuracy = train_demo.kind_loss(head, features, kinds, drop)
    x = torch.cat([features[0, 2:5], features[2, 6:9]])
    y = torch.tensor([1, 1, 1, 0, 0, 0])
    logits = head(torch.nn.functional.rms_norm(x, (8,)))
    assert abs(loss.item() - torch.nn.functional.cross_entropy(logits, y).item()) < 1e-6
    assert accuracy.item() == (logits.argmax(-1) == y).float().mean().item()
    every = train_demo.kind_loss(head, features, kinds, torch.zeros(3, dtype=torch.bool))[0]
    assert abs(every.item() - loss.item()) > 1e-4  # the dropped row's tokens would change it
    loss, accuracy = train_demo.kind_loss(head, features, torch.full((3, 10), -1), drop)
    assert loss.item() == 0 and accuracy.isnan()


def preset_model():
    """(preset, GPT, VQ, text encoder) of the test preset, in eval mode, the GPT's official init from seed 0."""
    torch.manual_seed(0)
    preset = train_demo.PRESETS["test"]
    model = Transformer(ModelArgs(**train_demo.gpt_args(preset, dict(codebook_size=64, z_channels=32)))).eval()
    train_demo.init_gpt(model)
    vq = VQModel(VQConfig(**preset["vq"])).eval()
    return preset, model, vq, demo_text.DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num)


def test_gpt_loss_adds_the_kind_heads_loss_on_the_control_features(monkeypatch):
    """gpt_loss with kind = (head, w): the tokens' loss plus w x kind_loss on the adapter's features of this batch
    (control_features made once, for both the kind head and the GPT's control tokens)."""
    preset, model, vq, encoder = preset_model()
    B, types = 6, ["canny", "seg"] * 3
    tokens = encode(vq, train_demo.images(range(B), preset["size"], "cpu")[0], preset["size"])
    drop = np.array([i == 1 for i in range(B)])
    made, features = [], train_demo.control_features
    monkeypatch.setattr(train_demo, "control_features", lambda *a: made.append(features(*a)) or made[-1])
    head = torch.nn.Linear(model.args.dim, len(scenes.KINDS))
    args = (model, encoder, vq, range(B), types, drop, tokens, preset, torch.device("cpu"))
    with torch.no_grad():
        plain, none = train_demo.gpt_loss(*args)
        total, scores = train_demo.gpt_loss(*args, kind=(head, 0.5))
    assert none == {} and len(made) == 2 and set(scores) == {"kind_accuracy"}
    batch = scenes.scenes(range(B), "train")
    grid = math.isqrt(tokens.shape[1])
    want = train_demo.kind_loss(head, made[1], train_demo.token_kinds(batch, preset["size"], grid, "cpu"),
                                torch.as_tensor(drop))[0]
    assert want.item() > 0 and abs(total.item() - (plain.item() + 0.5 * want.item())) < 1e-5


def test_the_binding_head_reads_each_shapes_kind_from_the_captions_mean():
    """binding_loss: each shape of the captioned rows scored at its (kind, colour) entry of the head over the mean of
    its caption's embedded tokens (the text mask's); the dropped rows skipped; no shape captioned: no loss."""
    torch.manual_seed(0)
    batch = [s for s in scenes.scenes(range(20), "train") if len(s.shapes) >= 2][:3]
    head = torch.nn.Linear(8, len(scenes.KINDS) * len(scenes.COLOURS))
    prefix = torch.randn(3, 6, 8)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    drop = torch.tensor([False, True, False])
    loss, accuracy = train_demo.binding_loss(head, prefix, mask, batch, drop)
    logits, want = [], []
    for b in (0, 2):
        mean = prefix[b][mask[b]].mean(0)
        out = head(torch.nn.functional.rms_norm(mean, (8,))).view(len(scenes.KINDS), len(scenes.COLOURS))
        for x in batch[b].shapes:
            logits.append(out[scenes.KINDS.index(x.kind)])
            want.append(scenes.COLOURS.index(x.colour))
    logits, want = torch.stack(logits), torch.tensor(want)
    assert abs(loss.item() - torch.nn.functional.cross_entropy(logits, want).item()) < 1e-5
    assert accuracy.item() == (logits.argmax(-1) == want).float().mean().item()
    padded = prefix.clone()
    padded[0, :2] += 100  # the padding is not read
    assert abs(train_demo.binding_loss(head, padded, mask, batch, drop)[0].item() - loss.item()) < 1e-6
    every = train_demo.binding_loss(head, prefix, mask, batch, torch.zeros(3, dtype=torch.bool))[0]
    assert abs(every.item() - loss.item()) > 1e-4  # the dropped row's shapes would change it
    loss, accuracy = train_demo.binding_loss(head, prefix, mask, batch, torch.ones(3, dtype=torch.bool))
    assert loss.item() == 0 and accuracy.isnan()


def test_the_colour_head_skips_dropped_rows():
    """colour_loss scores only the captioned rows among the hidden ones (no caption names a dropped row's colour):
    the cross-entropy and accuracy of those alone; none captioned: no loss."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, len(scenes.COLOURS))
    hidden = torch.randn(6, 16, 8)
    rows, at = torch.tensor([0, 1, 3, 4, 5]), torch.tensor([2, 5, 7, 1, 9])
    colours = torch.randint(0, len(scenes.COLOURS), (5,))
    drop = torch.tensor([False, True, False, False, True, False])
    loss, accuracy = train_demo.colour_loss(head, hidden, rows, at, colours, drop)
    keep = ~drop[rows]
    logits = head(torch.nn.functional.rms_norm(hidden[rows[keep], at[keep]], (8,)))
    ce = torch.nn.functional.cross_entropy(logits, colours[keep]).item()
    every = torch.nn.functional.cross_entropy(head(torch.nn.functional.rms_norm(hidden[rows, at], (8,))), colours)
    assert abs(loss.item() - ce) < 1e-6 and abs(ce - every.item()) > 1e-3
    assert accuracy.item() == (logits.argmax(-1) == colours[keep]).float().mean().item()
    loss, accuracy = train_demo.colour_loss(head, hidden, rows, at, colours, torch.ones(6, dtype=torch.bool))
    assert loss.item() == 0 and accuracy.isnan()


def test_gpt_loss_hides_dropped_rows_but_names_captioned_colours_only(monkeypatch):
    """gpt_loss with --hide-dropped: hide_before_onset's rows include dropped ones, and the colour head reads one
    hidden state per captioned row among them, none for the dropped."""
    preset, model, vq, encoder = preset_model()
    B, types = 8, ["canny", "seg"] * 4
    tokens = encode(vq, train_demo.images(range(B), preset["size"], "cpu")[0], preset["size"])
    drop = np.array([i % 2 == 0 for i in range(B)])
    seen, hid, hide = [], {}, train_demo.hide_before_onset
    monkeypatch.setattr(train_demo, "hide_before_onset", lambda *a: hid.setdefault("out", hide(*a)))
    head = torch.nn.Linear(model.args.dim, len(scenes.COLOURS))
    head.register_forward_hook(lambda m, x, y: seen.append(x[0]))
    torch.manual_seed(2)
    with torch.no_grad():
        train_demo.gpt_loss(model, encoder, vq, range(B), types, drop, tokens, preset, torch.device("cpu"),
                            colour=(head, 1.0), hide_until="e1", hide_dropped=True)
    rows = hid["out"][1].tolist()
    assert any(drop[r] for r in rows) and not all(drop[r] for r in rows)
    assert len(seen) == 1 and len(seen[0]) == sum(not drop[r] for r in rows)


def test_hide_dropped_is_part_of_the_runs_recipe(tmp_path, monkeypatch, capsys):
    """--hide-dropped: logged with the recipe, reaches the training steps' hiding, kept by --resume without the flag,
    refused on --resume of a run without it and without --colour-weight; off by default."""
    a, b = tmp_path / "a", tmp_path / "b"
    calls, hide = [], train_demo.hide_before_onset
    monkeypatch.setattr(train_demo, "hide_before_onset", lambda *a: calls.append(a[6]) or hide(*a))
    train(a, "--gpt-steps", 2, "--colour-weight", 1, "--hide-until", "e1", "--hide-dropped", "--time-limit", 1e-9)
    train(a, "--phase", "gpt", "--resume")
    log = (a / "train_log.jsonl").read_text()
    assert log.count('"hide_dropped": true') == 2 and '"resumed_at": 1' in log and calls == [True, True]
    train(b, "--phase", "gpt", "--vq-from", a, "--gpt-steps", 2, "--colour-weight", 1, "--time-limit", 1e-9)
    assert '"hide_dropped": false' in (b / "train_log.jsonl").read_text() and calls == [True, True, False]
    assert "run's --hide-dropped False" in refused(capsys, b, "--phase", "gpt", "--resume", "--hide-dropped")
    err = refused(capsys, tmp_path / "c", "--phase", "gpt", "--vq-from", a, "--hide-dropped")
    assert "--hide-dropped widens" in err and "give --colour-weight" in err
