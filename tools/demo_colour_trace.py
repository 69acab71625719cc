"""Where do sampled colours go wrong? The demo model's distribution at each shape's first tokens, along the SAMPLED
sequence (issue 77).

    python tools/demo_colour_trace.py --model sample/colour2 [--num 16] [--seed 0] [--cfg-scale 4] [--top-k 2000]

Samples test scenes 0..num-1 as scripts/eval_demo.py does (its generate(): the fast engine, canny control, the scene's
caption, torch.manual_seed(seed * 1000) before the batch; one batch of --num, so with --num <= 32 the images are
eval_demo's own), then feeds the sampled tokens back through the reference loop (fast_inference.generate, forced) for
the logits each token was drawn from, CFG-merged and top-k filtered as the sampler does (temperature 1).

A token's colours: the mean, over the true 16x16 patches the VQ encodes as that code in 192 train scenes, of the share
of the patch's pixels nearest each palette colour (eval_demo's rule, per pixel): shares[code, colour] (a code decoded
alone is no guide: border and edge codes decode to other colours out of context; unused codes show no colour).
A token SHOWS colour c where c covers at least SHOW of its patch. Tokens are classed, per region:
  shape k (named colour c, background colours B):  named = shows c;  swap = shows another of the caption's shape
      colours and not c;  other = shows a colour outside B and not c;  bg = only B's colours
  background (named top colour t):  named = the patch's dominant colour is t;  other = anything else
At these positions of each shape (from the scene's geometry, which the control draws):
  onset   the first token, raster order, whose patch holds any of the shape's pixels (train_demo.onsets, where
          --colour-weight's head looks)
  e1..e4  its first ENTRY_TOKENS tokens whose centre pixel is inside it (train_demo.entry_weights' tokens)
and at the background's first ENTRY_TOKENS tokens (the top-left ones): the distribution's mass on each class, and
the class of the token drawn. Then the shape's final colour in the decoded image (eval_demo.colour_checks), and
whether the first interior token drawn showing a non-background colour names it (the rest copy it) or it drifts.
Last, the same guided mass at the onset and e1 teacher forced on the scenes' own tokens: with the true tokens before,
with those before the onset from the scene without the shape (--colour-weight's rows), with those before e1 from
it, and with those before e1 from the scene with the shape in another colour (--teacher-only: only these).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import torch
import torch.nn.functional as F

import eval_demo
import train_demo
from fast_inference import scenes
from fast_inference.demo_text import DemoTextEncoder
from fast_inference.generate import generate as reference_generate
from fast_inference.sampling import cfg_merge, filter_logits

SHOW = 0.2  # a token shows a colour covering at least this share of its decoded patch
POSITIONS = ("onset",) + tuple(f"e{i + 1}" for i in range(train_demo.ENTRY_TOKENS))
CLASSES = ("named", "swap", "other", "bg")


@torch.no_grad()
def code_shares(vq, size, device, n=192, cache=None):
    """(V, colours) each code's share of pixels of each palette colour in the true 16x16 patches it encodes, over n
    train scenes (rendered, VQ-encoded); a code never used there: all zero (it shows no colour). A code's decoded tile
    alone is no guide: the codes at the image's border and edges decode to other colours out of their context."""
    if cache and os.path.exists(cache):
        return torch.load(cache)
    V, C = vq.cfg.codebook_size, len(scenes.COLOURS)
    sums, counts = torch.zeros(V, C), torch.zeros(V)
    palette = eval_demo.PALETTE
    for start in range(0, n, 32):
        batch = scenes.scenes(range(start, min(n, start + 32)), "train")
        rgb = scenes.render(batch, size)
        tokens = vq.encode(scenes.to_model_range(rgb).to(device)).cpu().flatten()
        g = size // 16
        patches = rgb.float().view(len(batch), 3, g, 16, g, 16).permute(0, 2, 4, 3, 5, 1).reshape(-1, 256, 3)
        near = torch.cdist(patches, palette[None].expand(len(patches), -1, -1)).argmin(-1)
        sums.index_add_(0, tokens, F.one_hot(near, C).float().mean(1))
        counts.index_add_(0, tokens, torch.ones(len(tokens)))
    shares = sums / counts.clamp_min(1)[:, None]
    if cache:
        torch.save(shares, cache)
    return shares


def classes_of_shape(shares, named, caption_shapes, background):
    """(4, V) bool masks of the codes in each class (CLASSES) for a shape named `named` (palette indices)."""
    shows = shares >= SHOW
    cols = torch.arange(shares.shape[1], device=shares.device)
    non_bg = ~torch.isin(cols, torch.tensor(sorted(background), device=shares.device))
    named_m = shows[:, named]
    swap_cols = torch.tensor([c for c in caption_shapes if c != named] or [-1], device=shares.device)
    swap_m = ~named_m & (shows & torch.isin(cols, swap_cols)).any(1)
    other_m = ~named_m & ~swap_m & (shows & non_bg).any(1)
    return torch.stack([named_m, swap_m, other_m, ~(named_m | swap_m | other_m)])


def first_tokens(batch, size, grid, device):
    """Per scene, per region (0 top background, 2 + k shape k): the token indices of POSITIONS (shapes) or of the
    first ENTRY_TOKENS tokens (background); and each shape's interior tokens in raster order."""
    region = train_demo.token_regions(batch, size, grid, device)
    out = []
    for b, s in enumerate(batch):
        touched = train_demo.touched_tokens([s], size, grid, device)[0]  # (3, N)
        onset = touched.int().argmax(1).tolist()  # train_demo.onsets of each slot
        shapes = []
        for k in range(len(s.shapes)):
            inner = (region[b] == 2 + k).nonzero().flatten().tolist()
            shapes.append(dict(positions=[onset[k]] + inner[:train_demo.ENTRY_TOKENS], inner=inner,
                               touched=touched[k].nonzero().flatten().tolist()))
        bg = (region[b] == 0).nonzero().flatten().tolist()
        out.append(dict(shapes=shapes, background=bg[:train_demo.ENTRY_TOKENS], top=bg))
    return out


@torch.no_grad()
def trace(model, engine, vq, margs, batch, size, device, shares_cache=None):
    """Sample `batch` as eval_demo does; -> (records per shape, records per background, images)."""
    controls = scenes.control(batch, "canny", size)
    images, tokens = eval_demo.generate(margs, model, engine, vq, batch, controls, margs.seed * 1000, device)
    encoder = DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num)
    emb, mask = encoder.encode_left_padded([s.caption for s in batch])
    _, logits = reference_generate(model, emb.to(device), tokens.shape[1], emb_masks=mask.to(device),
                                   cfg_scale=margs.cfg_scale, cfg_interval=margs.cfg_interval,
                                   condition=scenes.to_model_range(controls).to(device),
                                   control_strength=margs.control_strength, return_logits=True,
                                   forced=tokens.to(device))
    logits = torch.stack(logits, 1).float()  # (R, N, V)

    def drawing(x):  # the distribution a token is drawn from, given (B, N, V) logits
        return F.softmax(filter_logits(x.flatten(0, 1), margs.temperature, margs.top_k, margs.top_p), -1).view(
            *tokens.shape, -1).cpu()

    if margs.cfg_scale > 1.0:  # the guided draw, and the caption's branch and the null branch alone (same filter)
        branches = dict(zip(("mass_cond", "mass_uncond"), map(drawing, logits.chunk(2))))
        logits = cfg_merge(logits, margs.cfg_scale)
    else:
        branches = {}
    probs = drawing(logits)
    shares = code_shares(vq, size, device, cache=shares_cache)
    dominant = torch.where(shares.sum(1) > 0, shares.argmax(1), -1)
    shows = (shares >= SHOW).float()
    checks = eval_demo.colour_checks(images, batch, size)
    where = first_tokens(batch, size, size // 16, "cpu")
    shapes, backgrounds = [], []
    for b, s in enumerate(batch):
        background = {scenes.COLOURS.index(s.top), scenes.COLOURS.index(s.bottom or s.top)}
        caption_shapes = [scenes.COLOURS.index(x.colour) for x in s.shapes]
        label, inside = scenes.labels([s], size)
        eroded = -F.max_pool2d(-inside.float(), 5, 1, 2) > 0
        for k, x in enumerate(s.shapes):
            named = scenes.COLOURS.index(x.colour)
            masks = classes_of_shape(shares, named, caption_shapes, background)
            pos = where[b]["shapes"][k]
            rec = dict(scene=b, shape=k, named=x.colour, mass={}, drawn={}, p_drawn={}, **{k2: {} for k2 in branches})
            for name, t in zip(POSITIONS, pos["positions"]):
                p, tok = probs[b, t], int(tokens[b, t])
                rec["mass"][name] = [float(p[m].sum()) for m in masks]
                for key, q in branches.items():
                    rec[key][name] = [float(q[b, t][m].sum()) for m in masks]
                rec["drawn"][name] = CLASSES[int(masks[:, tok].float().argmax())]
                rec["p_drawn"][name] = float(p[tok])
            final = eval_demo.nearest(images[b].float()[:, eroded[0, k]])
            rec["final"] = final
            rec["right"] = checks[b][1][k]
            # the interior tokens drawn: the colour each shows besides the background's, raster order
            drawn = []
            for t in pos["inner"]:
                sh = shares[int(tokens[b, t])].clone()
                sh[sorted(background)] = 0
                drawn.append(scenes.COLOURS[int(sh.argmax())] if sh.max() >= SHOW else None)
            shown = [c for c in drawn if c is not None]
            rec["first_shown"] = shown[0] if shown else None
            rec["entry_shown"] = [c for c in drawn[:train_demo.ENTRY_TOKENS] if c is not None]
            rec["later_agree"] = (sum(c == final for c in shown[1:]) / (len(shown) - 1)) if len(shown) > 1 else None
            # the decider: the first token touching the shape (raster order) drawn showing a colour besides the
            # background's; its place (0 the onset) among those tokens, the guided mass there, its colour
            rec["decider"] = None
            for i, t in enumerate(pos["touched"]):
                sh = shares[int(tokens[b, t])].clone()
                sh[sorted(background)] = 0
                if sh.max() >= SHOW:
                    rec["decider"] = dict(index=i, interior=t in pos["inner"], colour=scenes.COLOURS[int(sh.argmax())],
                                          mass=[float(probs[b, t][m].sum()) for m in masks])
                    break
            mode = max(set(shown), key=shown.count) if shown else None
            rec["mode"], rec["purity"] = mode, (shown.count(mode) / len(shown) if shown else None)
            # after the shape has begun: the mass on tokens showing the colour drawn most so far, and on the named one
            mass = probs[b, pos["inner"]] @ shows  # (n, colours), not exclusive
            rec["copy"], so_far = [], []
            for i, c in enumerate(drawn):
                if so_far:
                    m = max(set(so_far), key=so_far.count)
                    rec["copy"].append((m == x.colour, float(mass[i, scenes.COLOURS.index(m)]), float(mass[i, named])))
                if c is not None:
                    so_far.append(c)
            shapes.append(rec)
        top = scenes.COLOURS.index(s.top)
        named_m = dominant == top
        rec = dict(scene=b, named=s.top, mass=[], drawn=[], right=checks[b][2])
        for t in where[b]["background"]:
            rec["mass"].append(float(probs[b, t][named_m].sum()))
            rec["drawn"].append(bool(named_m[int(tokens[b, t])]))
        first = int(dominant[int(tokens[b, where[b]["background"][0]])])
        rec["first_drawn"] = scenes.COLOURS[first] if first >= 0 else None
        # the whole top region (token centres): drawn in the named colour? where first not, and in what colour
        top_tokens = where[b]["top"]
        named_all = [bool(named_m[int(tokens[b, t])]) for t in top_tokens]
        rec["top_named"] = sum(named_all) / len(named_all)
        rec["top_mass"] = mean([float(probs[b, t][named_m].sum()) for t in top_tokens])
        off = [t for t, ok in zip(top_tokens, named_all) if not ok]
        rec["first_off_row"] = off[0] if off else None  # its raster index
        rec["off_colours"] = [scenes.COLOURS[int(dominant[int(tokens[b, t])])] for t in off]
        rec["off_in_caption"] = mean([c in {y.colour for y in s.shapes} | {s.bottom} for c in rec["off_colours"]])
        backgrounds.append(rec)
    return shapes, backgrounds, images


@torch.no_grad()
def teacher_forced(model, vq, margs, batch, size, device, shares_cache=None):
    """The same guided, filtered distribution at each shape's onset and e1 with the scene's TRUE tokens before them
    (as training feeds them), and with those before the onset taken from the scene drawn without the shape
    (--colour-weight's hidden rows): -> {context: {position: [mass per class], ...}} averaged over shapes."""
    from fast_inference.generate import prepare

    model.clear_caches()  # the sampler's: the teacher-forced forward runs without
    shares = code_shares(vq, size, device, cache=shares_cache)
    pairs = [(b, k) for b, s in enumerate(batch) for k in range(len(s.shapes))]
    rows = [batch[b] for b, _ in pairs]
    slots = [k for _, k in pairs]
    tokens = vq.encode(scenes.to_model_range(scenes.render(rows, size, device)))
    spliced, at = train_demo.shape_hidden(rows, slots, tokens, vq, size)
    where = first_tokens(rows, size, size // 16, "cpu")
    # also every token before the shape's first interior one (e1) from the scene drawn without it: the sliver of
    # tokens from the onset to e1, which --colour-weight's rows leave true, shows the colour too
    clean = vq.encode(scenes.to_model_range(scenes.render([train_demo.without_shape(s, k) for s, k in zip(rows, slots)],
                                                          size, device)))
    e1 = train_demo.entries(rows, slots, size, size // 16, device)  # (a shape without one is skipped below)
    before_e1 = torch.arange(tokens.shape[1], device=device)[None] < e1[:, None]
    spliced_e1 = torch.where(before_e1, clean.to(tokens.dtype), tokens)
    # and every token before e1 from the scene with the shape in another colour (one neither the background's nor a
    # caption shape's): a sliver drawn in a wrong colour, as the samples often draw it
    wrong = vq.encode(scenes.to_model_range(scenes.render([train_demo.recoloured(s, k) for s, k in zip(rows, slots)],
                                                          size, device)))
    recoloured_e1 = torch.where(before_e1, wrong.to(tokens.dtype), tokens)
    encoder = DemoTextEncoder(model.args.caption_dim, model.args.cls_token_num)
    emb, mask = encoder.encode_left_padded([s.caption for s in rows])
    control = scenes.to_model_range(scenes.control(rows, "canny", size)).to(device)
    p = prepare(model, emb.to(device), control, mask.to(device), margs.cfg_scale, margs.control_strength)
    out = {"the true token's class": {}}
    for pos_name, index in (("onset", 0), ("e1", 1)):
        cls = []
        for r, (s, k) in enumerate(zip(rows, slots)):
            positions = where[r]["shapes"][k]["positions"]
            if len(positions) > index:
                background = {scenes.COLOURS.index(s.top), scenes.COLOURS.index(s.bottom or s.top)}
                masks = classes_of_shape(shares, scenes.COLOURS.index(s.shapes[k].colour),
                                         [scenes.COLOURS.index(y.colour) for y in s.shapes], background)
                cls.append(masks[:, int(tokens[r, positions[index]])].float().tolist())
        out["the true token's class"][pos_name] = [mean([c[i] for c in cls]) for i in range(4)]
    for name, seq in (("true tokens before", tokens), ("tokens before the onset without the shape", spliced),
                      ("tokens before e1 without the shape", spliced_e1),
                      ("tokens before e1 with the shape in another colour", recoloured_e1)):
        x = torch.cat([seq, seq]) if margs.cfg_scale > 1.0 else seq
        logits = train_demo.teacher_forced_logits(model, p.prefix, p.text_mask, p.controls, x).float()
        if margs.cfg_scale > 1.0:
            logits = cfg_merge(logits, margs.cfg_scale)
        out[name] = {}
        for pos_name, index in (("onset", 0), ("e1", 1)):
            masses = []
            for r, (s, k) in enumerate(zip(rows, slots)):
                positions = where[r]["shapes"][k]["positions"]
                if len(positions) <= index:
                    continue
                t = positions[index]
                q = F.softmax(filter_logits(logits[r, t][None], margs.temperature, margs.top_k, margs.top_p), -1)[0]
                background = {scenes.COLOURS.index(s.top), scenes.COLOURS.index(s.bottom or s.top)}
                masks = classes_of_shape(shares, scenes.COLOURS.index(s.shapes[k].colour),
                                         [scenes.COLOURS.index(y.colour) for y in s.shapes], background)
                masses.append([float(q.cpu()[m].sum()) for m in masks])
            out[name][pos_name] = [mean([m[i] for m in masses]) for i in range(4)]
    return out


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def report(shapes, backgrounds):
    """Markdown tables of the records -> (text, summary dict)."""
    lines = ["| position | named | another caption shape's | other non-background | background only "
             "| drawn named | drawn swap | drawn other | drawn bg |", "|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for name in POSITIONS:
        rows = [r for r in shapes if name in r["mass"]]
        m = [mean([r["mass"][name][i] for r in rows]) for i in range(4)]
        d = [mean([r["drawn"][name] == c for r in rows]) for c in CLASSES]
        summary[name] = dict(mass=m, drawn=d, n=len(rows))
        lines.append(f"| {name} ({len(rows)}) | " + " | ".join(f"{v:.3f}" for v in m) + " | "
                     + " | ".join(f"{v:.2f}" for v in d) + " |")
    for key, title in (("mass_cond", "the caption's branch alone"), ("mass_uncond", "the null branch alone")):
        if shapes and key in shapes[0]:
            lines += ["", f"{title} (top-k filtered, along the same guided samples):",
                      lines[0].split(" drawn named")[0],
                      "|---|---|---|---|---|"]
            for name in POSITIONS:
                m = [mean([r[key][name][i] for r in shapes if name in r[key]]) for i in range(4)]
                summary[name][key] = m
                lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in m) + " |")
    right = mean([r["right"] for r in shapes])
    first = [r for r in shapes if r["first_shown"] is not None]
    predicts = mean([r["first_shown"] == r["final"] for r in first])
    first_named = mean([r["first_shown"] == r["named"] for r in first])
    e_named = [r for r in shapes if r["drawn"].get("e1") == "named"]
    right_if_e1 = mean([r["right"] for r in e_named])
    right_if_not = mean([r["right"] for r in shapes if r["drawn"].get("e1") not in (None, "named")])
    later = mean([r["later_agree"] for r in shapes])
    bg_right = mean([r["right"] for r in backgrounds])
    bg_mass = [mean([r["mass"][i] for r in backgrounds if len(r["mass"]) > i]) for i in range(train_demo.ENTRY_TOKENS)]
    bg_drawn = [mean([r["drawn"][i] for r in backgrounds if len(r["drawn"]) > i])
                for i in range(train_demo.ENTRY_TOKENS)]
    bg_first = mean([(r["first_drawn"] == r["named"]) == r["right"] for r in backgrounds])
    after = [c for r in shapes for c in r["copy"]]
    on, off = [c for c in after if c[0]], [c for c in after if not c[0]]
    copy = dict(on=len(on), on_named=mean([c[2] for c in on]), off=len(off), off_mode=mean([c[1] for c in off]),
                off_named=mean([c[2] for c in off]))
    purity = mean([r["purity"] for r in shapes])
    dec = [r for r in shapes if r["decider"]]
    decider = dict(n=len(dec), at_onset=mean([r["decider"]["index"] == 0 for r in dec]),
                   interior=mean([r["decider"]["interior"] for r in dec]),
                   mass=[mean([r["decider"]["mass"][i] for r in dec]) for i in range(4)],
                   named=mean([r["decider"]["colour"] == r["named"] for r in dec]),
                   is_final=mean([r["decider"]["colour"] == r["final"] for r in dec]),
                   right_if_named=mean([r["right"] for r in dec if r["decider"]["colour"] == r["named"]]),
                   right_if_not=mean([r["right"] for r in dec if r["decider"]["colour"] != r["named"]]))
    mode_named = mean([r["mode"] == r["named"] for r in shapes if r["mode"]])
    final_mode = mean([r["final"] == r["mode"] for r in shapes if r["mode"]])
    wrong_bg = [r for r in backgrounds if not r["right"]]
    bg_all = dict(right_top_named=mean([r["top_named"] for r in backgrounds if r["right"]]),
                  wrong_top_named=mean([r["top_named"] for r in wrong_bg]),
                  right_top_mass=mean([r["top_mass"] for r in backgrounds if r["right"]]),
                  wrong_top_mass=mean([r["top_mass"] for r in wrong_bg]),
                  wrong_first_off_row=[r["first_off_row"] for r in wrong_bg],
                  wrong_off_in_caption=mean([r["off_in_caption"] for r in wrong_bg]))
    summary.update(shapes=len(shapes), shapes_right=right, first_shown_is_final=predicts,
                   first_shown_is_named=first_named, right_if_e1_named=right_if_e1,
                   right_if_e1_not_named=right_if_not, later_agree_with_final=later, backgrounds=len(backgrounds),
                   background_right=bg_right, background_mass=bg_mass, background_drawn=bg_drawn,
                   background_first_token_predicts=bg_first, copy=copy, purity=purity,
                   mode_is_named=mode_named, final_is_mode=final_mode, background_all=bg_all,
                   decider=decider)
    lines += ["",
              f"shapes in their named colour (eval_demo's rule): {right:.3f} of {len(shapes)}; the first interior "
              f"token "
              f"drawn that shows a non-background colour shows the final colour {predicts:.3f} of the time and the "
              f"named one {first_named:.3f} ({len(first)} shapes); later interior tokens agree with the final colour "
              f"{later:.3f}; right when e1 drawn named {right_if_e1:.3f} ({len(e_named)}), otherwise "
              f"{right_if_not:.3f}",
              f"background named (eval_demo's rule): {bg_right:.3f} of {len(backgrounds)}; mass on tokens of the named "
              f"colour at its first {train_demo.ENTRY_TOKENS} tokens: " + ", ".join(f"{v:.3f}" for v in bg_mass)
              + "; drawn named: " + ", ".join(f"{v:.2f}" for v in bg_drawn)
              + f"; the first token's colour agrees with the outcome in {bg_first:.3f} of scenes",
              f"inside a shape once begun (interior tokens after the first): where the colour drawn most so far is the "
              f"named one ({copy['on']} tokens) the mass on it {copy['on_named']:.3f}; where it is another "
              f"({copy['off']}), the mass on that one {copy['off_mode']:.3f} and on the named {copy['off_named']:.3f}; "
              f"a shape's interior tokens show its most drawn colour {purity:.3f} of the time, that colour is the "
              f"named one in {mode_named:.3f} of shapes and eval's final colour in {final_mode:.3f}",
              f"the decider (the first token touching a shape drawn showing a non-background colour; {decider['n']} "
              f"shapes): the onset itself {decider['at_onset']:.3f}, an interior token {decider['interior']:.3f}; mass "
              f"there on named / swap / other / background only: " + " / ".join(f"{v:.3f}" for v in decider["mass"])
              + f"; it draws the named colour {decider['named']:.3f}, eval's final colour {decider['is_final']:.3f}; "
              f"shapes right when it drew the named colour {decider['right_if_named']:.3f}, otherwise "
              f"{decider['right_if_not']:.3f}",
              f"the background's whole top region: tokens drawn in the named colour {bg_all['right_top_named']:.3f} "
              f"(mass {bg_all['right_top_mass']:.3f}) in the scenes it is right, {bg_all['wrong_top_named']:.3f} "
              f"(mass {bg_all['wrong_top_mass']:.3f}) in the {len(wrong_bg)} wrong; their first off-colour token "
              f"(raster index): {bg_all['wrong_first_off_row']}; off-colour tokens in a caption's other colour "
              f"{bg_all['wrong_off_in_caption']:.3f}"]
    return "\n".join(lines), summary


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="folder of gpt.json, gpt.safetensors, vq.json, vq.safetensors")
    p.add_argument("--num", type=int, default=16, help="test scenes 0..num-1, one batch")
    p.add_argument("--shares", default=None, help="cache file of the codes' colour shares (per VQ)")
    p.add_argument("--teacher-only", action="store_true", help="only the teacher-forced measures (no sampling)")
    p.add_argument("--json", default=None, help="write the per-shape records and the summary here")
    args, rest = p.parse_known_args(argv)
    files = ["--gpt-model", os.path.join(args.model, "gpt.json"),
             "--gpt-ckpt", os.path.join(args.model, "gpt.safetensors"),
             "--vq-model", os.path.join(args.model, "vq.json"), "--vq-ckpt", os.path.join(args.model, "vq.safetensors")]
    margs = eval_demo.parse_args(files + ["--device", "cpu"] + rest).model
    device, _, backend, model, size, vq = eval_demo.load(margs)
    engine = eval_demo.make_engine(margs, model, backend)
    t0 = time.perf_counter()
    batch = scenes.scenes(range(args.num), "test")
    if args.teacher_only:
        for name, v in teacher_forced(model, vq, margs, batch, size, device, args.shares).items():
            print(name + ": " + "; ".join(f"{pos} " + " / ".join(f"{x:.3f}" for x in m) for pos, m in v.items()))
        return None
    shapes, backgrounds, _ = trace(model, engine, vq, margs, batch, size, device, args.shares)
    text, summary = report(shapes, backgrounds)
    summary["teacher_forced"] = teacher_forced(model, vq, margs, batch, size, device, args.shares)
    text += ("\n\nteacher forced, the same guided filtered distribution (mass on named / swap / other / background "
             "only):")
    for name, v in summary["teacher_forced"].items():
        text += "\n  " + name + ": " + "; ".join(f"{pos} " + " / ".join(f"{x:.3f}" for x in m) for pos, m in v.items())
    print(f"{args.model}: {args.num} test scenes, {size} px, cfg {margs.cfg_scale}, top-k {margs.top_k}, "
          f"seed {margs.seed}, {time.perf_counter() - t0:.0f} s; mass of the CFG-merged, top-k filtered distribution "
          f"on tokens showing (>= {SHOW:.0%} of the patch) each colour class, and the class drawn")
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(summary=summary, shapes=shapes, backgrounds=backgrounds), f, indent=1)
    return summary


if __name__ == "__main__":
    main()
