"""Does the demo model read the caption's colours? Teacher-forced loss of held-out scenes under altered inputs (issue 77).

    python tools/demo_binding.py --model checkpoints/demo_gpu [--num 32] [--device cpu]

Each test scene of two or more shapes is encoded by the model's VQ and scored (nats per token, the model's own
forward as in training, canny control, nothing dropped) under its true caption and control, and under:
  colours rotated      the shapes' colours moved one shape along in the caption (the same words, bound wrongly)
  shapes recoloured    the shapes named in colours the scene does not show
  background recoloured  the background named in a colour the scene does not show
  other control        another scene's control map
  dropped both         the null caption and no control (the CFG branch)
Reported over all tokens, tokens inside a shape (the centre pixel's), and the first ENTRY_TOKENS tokens of each
region in raster order (scripts/train_demo.py's entry_weights), where its colour is decided: the shapes' and the
background's. A model that binds each colour to its shape loses clearly more under "colours rotated" than under the
true caption on the shapes' first tokens.

--kinds: whether the control adapter's features tell a shape's kind where its colour is decided: a linear probe
(logistic regression) fitted on the features of 640 train scenes' shapes' first tokens (canny), its accuracy on
256 test scenes' beside the majority kind's share, and the same over all of the shapes' tokens.

--colours: whether the GPT's last hidden state holds the colour of the shape about to be drawn (what
scripts/train_demo.py's --colour-weight trains): the same probe, of a shape's colour, fitted on 480 train scenes of
two or more shapes (teacher forced, true caption, canny), its accuracy on 192 test scenes, beside picking one of the
caption's shape colours at random (1 / shapes), at each shape's onset (the first token in raster order whose patch
holds any of its pixels), at the same onset after every token before it is replaced by those of the scene drawn
without that shape (the VQ's tokens next to a shape carry some of its colour: here only the caption and the control
can tell it, as when sampling), and over all tokens inside shapes (the tokens before mostly show it already).

--attention: whether an image query can look up its shape's words: per layer, the attention mass that the queries
predicting a shape's first tokens (teacher forced, true caption) put on the caption token of the shape's kind (which
carries its colour: the demo text encoder's pair of a word and the one before it) beside the other shapes' kind
tokens. The text positions' RoPE rows are zero (LlamaGen's and ControlAR's layout), which zeroes their queries and
keys: every image query reads the caption as the plain mean of its tokens' values. So the binding can reach the image
only inside that mean; reported is how far rotating the colours among the shapes moves it, against naming other
colours.
"""
import argparse
import contextlib
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import train_demo
from fast_inference import demo_text, scenes
from fast_inference.model import ModelArgs, Transformer


def load(folder, device):
    with open(os.path.join(folder, "gpt.json")) as f:
        margs = json.load(f)
    model = Transformer(ModelArgs(**margs))
    model.load_state_dict({k: v.float() for k, v in load_file(os.path.join(folder, "gpt.safetensors")).items()},
                          strict=False)  # the keys unused at inference are not stored
    return model.to(device).eval(), train_demo.load_vq(folder, device), margs


def rotated(s):
    s = copy.deepcopy(s)
    colours = [x.colour for x in s.shapes]
    for x, c in zip(s.shapes, colours[1:] + colours[:1]):
        x.colour = c
    return s


def unused(s):
    return [c for c in scenes.COLOURS if c not in {s.top, s.bottom} | {x.colour for x in s.shapes}]


def shapes_recoloured(s):
    s = copy.deepcopy(s)
    for x, c in zip(s.shapes, unused(s)):
        x.colour = c
    return s


def background_recoloured(s):
    s = copy.deepcopy(s)
    s.top = unused(s)[0]
    return s


def kind_features(model, split, n, size, device):
    """(features, kinds) of the shapes' first tokens and (features, kinds) of all their tokens, over n scenes."""
    first, every = ([], []), ([], [])
    for start in range(0, n, 32):
        batch = scenes.scenes(range(start, min(n, start + 32)), split)
        rgb = scenes.render(batch, size, device)
        types = ["canny"] * len(batch)
        with torch.no_grad():
            feats = train_demo.control_features(model, train_demo.control_maps(batch, types, rgb, size, device), types)
        _, inside = scenes.labels(batch, size, device)
        entry = train_demo.entry_weights(batch, size, size // 16, 2.0, device) > 1
        for b, s in enumerate(batch):
            for k, shape in enumerate(s.shapes):
                tokens = inside[b, k][8::16, 8::16].flatten()
                for (xs, ys), sel in ((first, tokens & entry[b]), (every, tokens)):
                    xs.append(feats[b, sel])
                    ys.append(torch.full((int(sel.sum()),), scenes.KINDS.index(shape.kind), device=device))
    return [(torch.cat(xs), torch.cat(ys)) for xs, ys in (first, every)]


@torch.no_grad()
def colour_features(model, vq, encoder, split, n, size, device):
    """(hidden, colour, 1 / shapes) at the shapes' onsets, at their onsets with every token before drawn without the
    shape, and at all their tokens, over the first n scenes of two or more shapes of the split: the GPT's last hidden
    states predicting those tokens, teacher forced."""
    onset, clean, every = ([], [], []), ([], [], []), ([], [], [])
    picked = [s for s in scenes.scenes(range(4 * n), split) if len(s.shapes) >= 2][:n]
    for start in range(0, len(picked), 32):
        batch = picked[start:start + 32]
        rgb = scenes.render(batch, size, device)
        tokens = vq.encode(scenes.to_model_range(rgb))
        types = ["canny"] * len(batch)
        maps = train_demo.control_maps(batch, types, rgb, size, device)
        keep = torch.zeros(len(batch), dtype=torch.bool, device=device)
        prefix, mask, controls = train_demo.gpt_inputs(model, encoder, batch, maps, types, keep)
        hidden = train_demo.teacher_forced_hidden(model, prefix, mask, controls, tokens).float()
        grid = size // 16
        colour = train_demo.token_colours(batch, size, grid, device)
        shapes = train_demo.token_regions(batch, size, grid, device) >= 2
        chance = torch.tensor([1 / len(s.shapes) for s in batch], device=device)[:, None].expand_as(colour)
        every[0].append(hidden[shapes])
        every[1].append(colour[shapes])
        every[2].append(chance[shapes])
        pairs = [(b, k) for b, s in enumerate(batch) for k in range(len(s.shapes))]
        rows = torch.tensor([b for b, _ in pairs], device=device)
        scenes_of, slots = [batch[b] for b, _ in pairs], [k for _, k in pairs]
        # each shape's onset, and its tokens after those of the scene drawn without it: none before shows its colour
        spliced, at = train_demo.shape_hidden(scenes_of, slots, tokens[rows], vq, size)
        target = torch.tensor([scenes.COLOURS.index(s.shapes[k].colour) for s, k in zip(scenes_of, slots)],
                              device=device)
        chance_pairs = torch.tensor([1 / len(s.shapes) for s in scenes_of], device=device)
        onset[0].append(hidden[rows, at])
        prefix, mask, controls = train_demo.gpt_inputs(model, encoder, scenes_of, maps[rows],
                                                       [types[b] for b, _ in pairs], keep[rows])
        clean[0].append(train_demo.teacher_forced_hidden(model, prefix, mask, controls, spliced).float()[
            torch.arange(len(pairs), device=device), at])
        for part in (onset, clean):
            part[1].append(target)
            part[2].append(chance_pairs)
    return [tuple(torch.cat(x) for x in part) for part in (onset, clean, every)]


def colours(model, vq, encoder, size, device):
    train = colour_features(model, vq, encoder, "train", 480, size, device)
    test = colour_features(model, vq, encoder, "test", 192, size, device)
    for name, tr, te in (("at each shape's onset", train[0], test[0]),
                         ("at each shape's onset, the tokens before it drawn without the shape", train[1], test[1]),
                         ("inside shapes", train[2], test[2])):
        accuracy = probe_accuracy(tr[:2], te[:2], classes=len(scenes.COLOURS))
        print(f"a shape's colour from the GPT's last hidden state, {name}: {accuracy:.3f} on {len(te[1])} test tokens "
              f"(one of the caption's shape colours at random: {te[2].mean():.3f})")


@contextlib.contextmanager
def attention_recorded(into):
    """SDPA as the model calls it, with each call's (attention probabilities (B, H, S, S), values (B, H, S, hd))
    appended to `into`."""
    sdpa = F.scaled_dot_product_attention

    def recorded(q, k, v, attn_mask=None, **kw):
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        into.append((torch.softmax(scores if attn_mask is None else scores + attn_mask, -1), v))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    F.scaled_dot_product_attention = recorded
    try:
        yield into
    finally:
        F.scaled_dot_product_attention = sdpa


def kind_word(s, k, T):
    """The prefix position of shape k's kind word in scene s's caption (left padded to T tokens)."""
    words = demo_text.words(s.caption)
    shape = s.shapes[k]
    i = next(i for i in range(1, len(words)) if words[i] == shape.kind and words[i - 1] == shape.colour)
    return T - len(words) + i


def gpt_attention(model, encoder, batch, maps, tokens, types):
    """The GPT's layers' (probabilities, values) of a teacher-forced forward (the control adapter's own attention
    calls left out), and the prefix length and text mask."""
    keep = torch.zeros(len(batch), dtype=torch.bool, device=maps.device)
    prefix, mask, controls = train_demo.gpt_inputs(model, encoder, batch, maps, types, keep)
    S = prefix.shape[1] + tokens.shape[1] - 1
    with attention_recorded([]) as calls:
        train_demo.teacher_forced_hidden(model, prefix, mask, controls, tokens)
    return [c for c in calls if c[0].shape[-1] == S], prefix.shape[1], mask


def attention(model, batch, maps, tokens, encoder, types, entry, inside, device):
    """Where the queries predicting the shapes' first tokens look in the caption (each layer's largest difference, over
    heads, between the mass on the shape's own kind token and the others' mean), and how much of the caption's
    binding reaches the image: each layer's mean of the caption's values (what every image query reads from it, its
    keys being alike) moved by rotating the colours among the shapes, against naming other colours."""
    layers, T, mask = gpt_attention(model, encoder, batch, maps, tokens, types)
    rows, queries, own, others = [], [], [], []
    for b, s in enumerate(batch):
        words = [kind_word(s, k, T) for k in range(len(s.shapes))]
        for k in range(len(s.shapes)):
            for t in (inside[b, k][8::16, 8::16].flatten() & entry[b]).nonzero().flatten().tolist():
                rows.append(b)
                queries.append(T - 1 + t)  # the position whose output predicts token t
                own.append(words[k])
                others.append([w for j, w in enumerate(words) if j != k])
    rows, queries, own = (torch.tensor(x, device=device) for x in (rows, queries, own))
    text = mask[:, None, :, None].float()
    text_means = lambda calls: [((v[:, :, :T] * text).sum(2) / text.sum(2)).flatten(1) for _, v in calls]
    means = dict(true=text_means(layers))  # the true caption's forward is the one above
    for name, captioned in (("rotated", [rotated(s) for s in batch]),
                            ("recoloured", [shapes_recoloured(s) for s in batch])):
        means[name] = text_means(gpt_attention(model, encoder, captioned, maps, tokens, types)[0])
    print(f"the caption as the image reads it, {len(batch)} scenes, {len(own)} shapes' first tokens:")
    print("| layer | mass on own kind token - others' mean, largest over heads | the text values' mean moved by "
          "colours rotated / by shapes recoloured (of its norm) |")
    print("|---|---|---|")
    for layer, (p, _) in enumerate(layers):
        at = p[rows, :, queries]  # (Q, H, S)
        mine = at.gather(2, own[:, None, None].expand(-1, at.shape[1], 1))[..., 0]
        theirs = torch.stack([at[i, :, o].mean(-1) for i, o in enumerate(others)])
        moved = [((means[n][layer] - means["true"][layer]).norm(dim=1) / means["true"][layer].norm(dim=1)).mean()
                 for n in ("rotated", "recoloured")]
        print(f"| {layer} | {(mine - theirs).mean(0).abs().max():.2e} | {moved[0]:.3f} / {moved[1]:.3f} |")


def probe_accuracy(train, test, steps=500, classes=len(scenes.KINDS)):
    """A logistic regression of labels on standardised features, fitted on train; its accuracy on test."""
    (x, y), (xt, yt) = train, test
    mu, sd = x.mean(0), x.std(0) + 1e-5
    w = torch.zeros(x.shape[1], classes, device=x.device, requires_grad=True)
    b = torch.zeros(classes, device=x.device, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=1e-2)
    for _ in range(steps):
        loss = F.cross_entropy((x - mu) / sd @ w + b, y) + 1e-3 * (w**2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (((xt - mu) / sd @ w + b).argmax(1) == yt).float().mean().item()


def kinds(model, size, device):
    train, test = kind_features(model, "train", 640, size, device), kind_features(model, "test", 256, size, device)
    for name, tr, te in (("shapes' first tokens", train[0], test[0]), ("all the shapes' tokens", train[1], test[1])):
        majority = torch.bincount(te[1]).max().item() / len(te[1])
        print(f"kind from the adapter's features, {name}: {probe_accuracy(tr, te):.3f} on {len(te[1])} test tokens "
              f"(majority {majority:.3f})")


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="folder of gpt.json, gpt.safetensors, vq.json, vq.safetensors")
    p.add_argument("--num", type=int, default=32, help="test scenes of two or more shapes")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kinds", action="store_true", help="also the linear probe of kinds on the adapter's features")
    p.add_argument("--attention", action="store_true", help="also where the heads of the queries of the shapes' first "
                   "tokens look in the caption")
    p.add_argument("--colours", action="store_true", help="also the linear probe of shapes' colours on the GPT's "
                   "last hidden states")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    model, vq, margs = load(args.model, device)
    size = 16 * int(margs["block_size"] ** 0.5)
    if args.kinds:
        with torch.enable_grad():
            kinds(model, size, device)
    encoder = demo_text.DemoTextEncoder(margs["caption_dim"], margs["cls_token_num"])
    if args.colours:
        with torch.enable_grad():  # the probe's fit; the features are taken without
            colours(model, vq, encoder, size, device)
    batch = [s for s in scenes.scenes(range(10 * args.num), "test") if len(s.shapes) >= 2][: args.num]
    rgb = scenes.render(batch, size, device)
    tokens = vq.encode(scenes.to_model_range(rgb))
    types = ["canny"] * len(batch)
    maps = train_demo.control_maps(batch, types, rgb, size, device)
    grid = size // 16
    _, inside = scenes.labels(batch, size, device)
    in_shape = inside.any(1)[:, 8::16, 8::16].flatten(1)
    entry = train_demo.entry_weights(batch, size, grid, 2.0, device) > 1
    if args.attention:
        attention(model, batch, maps, tokens, encoder, types, entry, inside, device)

    def nats(captioned, control, drop=False):
        dropped = torch.full((len(batch),), drop, device=device)
        prefix, mask, controls = train_demo.gpt_inputs(model, encoder, captioned, control, types, dropped)
        logits = train_demo.teacher_forced_logits(model, prefix, mask, controls, tokens)
        return F.cross_entropy(logits.flatten(0, 1), tokens.flatten(), reduction="none").view(tokens.shape)

    cases = [("true", nats(batch, maps)),
             ("colours rotated", nats([rotated(s) for s in batch], maps)),
             ("shapes recoloured", nats([shapes_recoloured(s) for s in batch], maps)),
             ("background recoloured", nats([background_recoloured(s) for s in batch], maps)),
             ("other control", nats(batch, maps.roll(1, 0))),
             ("dropped both", nats(batch, maps, drop=True))]
    print(f"{args.model}: {len(batch)} test scenes, {size} px, nats per token (teacher forced)")
    first_in_shape, first_outside = entry & in_shape, entry & ~in_shape
    print(f"| inputs | all | inside shapes ({int(in_shape.sum())}) | shapes' first tokens ({int(first_in_shape.sum())}) "
          f"| background's first tokens ({int(first_outside.sum())}) |")
    print("|---|---|---|---|---|")
    for name, v in cases:
        print(f"| {name} | {v.mean():.3f} | {v[in_shape].mean():.3f} | {v[first_in_shape].mean():.3f} "
              f"| {v[first_outside].mean():.3f} |")


if __name__ == "__main__":
    main()
