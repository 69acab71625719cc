"""ControlAR sampling from the command line: a control image and a prompt in, a PNG out, fast.

    python fast_inference/fast_engine.py                      # embedded demo: the trained demo model
    python fast_inference/fast_engine.py --prompt "a red circle and a blue square on a white background"
    python fast_inference/fast_engine.py --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base \
        --vq-ckpt checkpoints/vq_ds16_t2i.pt --t5-path checkpoints/t5-ckpt/flan-t5-xl \
        --condition-type hed --condition-path condition/example/hed.png --condition-is-map --prompt "a house"

Flags keep the names and defaults of the official sample_t2i.py / sample_t2i_MR.py / sample_c2i.py. A thin layer over
the library (pipeline.Pipeline): parse, check, build the pipeline, run its phases with a time each, save.
"""
import functools
import os
import re
import sys
import time

PROCESS_START = time.perf_counter()  # before the heavy imports, so the report can say what they cost

if __package__ in (None, ""):  # run as a script: make `fast_inference` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from fast_inference import plan as plans
from fast_inference.components import (CONDITION_TYPES, ROOT, check_grid, check_writable, default_backend, describe,
                                       find_multiple, is_demo, model_args, pick_device, precision_dtype, run_memory,
                                       t5_folder, use_demo_model, uses_demo_text)
from fast_inference.engine import Engine, sync
from fast_inference.flags import Parser, add_model_args, add_text_args, cli_main, is_user_error
from fast_inference.pipeline import DEMO_SCENE, Pipeline, PipelineConfig, check_config, control_shape
from fast_inference.settings import (SamplingParams, UserError, check_draft_grid, check_ranges, check_speculative,
                                     flag_name)

EXAMPLES_DIR = os.path.join(ROOT, "condition", "example")


def parse_args(argv=None):
    p = Parser(description="ControlAR sampling (fast engine)")
    add_model_args(p)
    p.add_argument("--condition-path", default=None, help="control image (default: the demo draws one)")
    p.add_argument("--prompt", default=None, help="text prompt (T5 from --t5-path, default checkpoints/t5-ckpt; the "
                   "demo model's own word encoder for it)")
    p.add_argument("--prompt-file", default=None, help="one prompt per line, encoded in one pass")
    p.add_argument("--caption-emb", default=None, help="precomputed caption .npz (caption_emb, prompt)")
    add_text_args(p)
    p.add_argument("--t5-feature-dim", type=int, default=None, help="must be the model's caption_dim (2048)")
    p.add_argument("--no-left-padding", action="store_true",
                   help="keep T5's right padding (the models were trained left padded)")
    p.add_argument("--class-label", type=int, default=None,
                   help="c2i class (default: the .npy beside --condition-path, as sample_c2i.py)")
    p.add_argument("--num-images", type=int, default=1,
                   help="samples per prompt, from the same control (>= 1; as many as fit the free memory)")
    p.add_argument("--warmup", type=int, default=0, help="untimed generations and VQ decodes first (compile, capture; "
                   ">= 0)")
    p.add_argument("--out", default=None,
                   help="PNG file: a grid of the control map, then the samples (default under sample/)")
    p.add_argument("--save-samples", default=None, help="directory: each sample as {i}.png")
    p.add_argument("--save-tokens", default=None, help=".npy of the token ids [num_images, H/16*W/16]")
    p.add_argument("--compile", action="store_true", help="the official flag: same as --backend inductor")
    p.add_argument("--explain", nargs="?", const="here", default=None, metavar="DEVICE",
                   help="print the decode plan of this run (which kernel runs each operation) and exit, loading no "
                        "weights; DEVICE plans for another one instead of this machine's: cpu, sm_80, sm_90, ...")
    return use_demo_model(p.parse_args(argv))


# ---- checks before any heavy work --------------------------------------------------------------

def check_args(args):
    """Everything that can be checked cheaply, so a mistake costs no model loading."""
    check_ranges(args)
    check_speculative(args, engine=args.engine, backend=args.backend, compile_scope=args.compile_scope)
    check_config(args)
    for flag in ("condition_path", "caption_emb", "prompt_file"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise UserError(f"--{flag.replace('_', '-')} {path} not found")
    for flag in ("image_H", "image_W"):
        side = getattr(args, flag)
        if side is not None and (side <= 0 or side % 16):
            fit = max(16, find_multiple(side, 16))
            raise UserError(f"--{flag.replace('_', '-')} {side} is not a positive multiple of 16; use e.g. {fit}")
    if sum(x is not None for x in (args.caption_emb, args.prompt_file, args.prompt)) > 1:
        raise UserError("give one text source: --prompt, --prompt-file or --caption-emb")
    if (args.prompt is not None or args.prompt_file) and not t5_folder(args) and not uses_demo_text(args):
        raise UserError("--prompt/--prompt-file need the text encoder: pass --t5-path checkpoints/t5-ckpt/flan-t5-xl "
                        "(or use --caption-emb FILE.npz)")
    if not is_demo(args) and args.condition_path is None and not args.explain:  # --explain reads no inputs
        raise UserError("--condition-path is required outside the demo: the control image (or map)")
    if args.out and os.path.isdir(args.out):
        raise UserError(f"--out {args.out} is a directory; give a file name like {os.path.join(args.out, 'grid.png')}")
    if args.save_tokens and os.path.isdir(args.save_tokens):
        raise UserError(f"--save-tokens {args.save_tokens} is a directory; give a file name like tokens.npy")
    if args.save_samples and os.path.isfile(args.save_samples):
        raise UserError(f"--save-samples {args.save_samples} is a file; give a directory")
    check_format("--out", args.out, ".png", "a PNG")
    check_format("--save-tokens", args.save_tokens, ".npy", "a NumPy .npy")
    for path in (args.out, args.save_tokens, args.save_samples and os.path.join(args.save_samples, "0.png")):
        if path:
            check_writable(path)


def check_format(flag, path, ext, what):
    """An output file named with the extension of the one format it is written in (no image.jpg holding a PNG)."""
    if path and not path.lower().endswith(ext):
        stem = os.path.splitext(path)[0] if os.path.splitext(path)[1] else path
        raise UserError(f"{flag} {path}: it is written as {what} file only; name it {stem}{ext}")


def planned_shape(args, image_size, model_type):
    """(H, W) of the control map the run will make, from the image's header alone (no pixel decoded)."""
    from fast_inference import conditions

    if args.condition_path is None:  # the demo draws its map
        return args.image_H or image_size, args.image_W or image_size
    H, W = conditions.read_size(args.condition_path)
    return control_shape(H, W, args.condition_is_map or model_type == "c2i", args.condition_type, args.image_H,
                         args.image_W)


# ---- inputs ------------------------------------------------------------------------------------

def read_prompt_file(path):
    with open(path, encoding="utf-8") as f:
        prompts = [line.strip() for line in f if line.strip()]
    if not prompts:
        raise UserError(f"--prompt-file {path} has no prompts (one per line)")
    return prompts


def prompt_count(args):
    """The prompts the run will encode: --prompt-file's lines, else one."""
    return len(read_prompt_file(args.prompt_file)) if args.prompt_file else 1


def class_label(args, num_classes):
    """--class-label, else the label saved beside the control map (sample_c2i.py: <map>.npy)."""
    label = args.class_label
    npy = os.path.splitext(args.condition_path)[0] + ".npy" if args.condition_path else None
    if label is None and npy and os.path.isfile(npy):
        try:
            label = int(np.load(npy).reshape(-1)[0])
        except (ValueError, OSError, IndexError) as e:
            raise UserError(f"{npy}: cannot read a class label ({e}); pass --class-label N") from None
    if label is None:
        raise UserError(f"c2i needs a class: pass --class-label N (0..{num_classes - 1})")
    return label


def text_inputs(args, pipe):
    """(cond, masks, names) of the run's prompts (--prompt, --prompt-file, --caption-emb) or its class label."""
    if pipe.model_type == "c2i":
        return pipe.encode_prompt(class_label=class_label(args, pipe.margs.num_classes))
    dim = pipe.margs.caption_dim
    if args.caption_emb is None and not uses_demo_text(args) and args.t5_feature_dim not in (None, dim):
        raise UserError(f"--t5-feature-dim {args.t5_feature_dim} but the model's caption_dim is {dim}; drop the flag")
    prompt = read_prompt_file(args.prompt_file) if args.prompt_file else args.prompt
    return pipe.encode_prompt(prompt, caption_emb=args.caption_emb)


# ---- run ---------------------------------------------------------------------------------------

def explain(args):
    """--explain: the decode plan of the run the flags describe, on this machine or on args.explain's device, from the
    model's configuration alone (no weights)."""
    margs, image_size = model_args(args)
    builds = lambda kernel, *key: True  # another device: its CUDA C++ kernels taken to build
    if args.explain == "here":
        device, dtype, backend = pick_device(args)
        capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        builds = functools.partial(Engine.builds_on, device)
    else:
        target = args.explain.lower().replace("sm_", "sm")
        if not (target == "cpu" or re.fullmatch(r"sm\d\d+", target)):
            raise UserError(f"--explain {args.explain}: name a device as cpu or sm_XY (sm_80 Ampere, sm_90 Hopper)")
        capability = None if target == "cpu" else (int(target[2:-1]), int(target[-1]))
        device = torch.device("cpu" if target == "cpu" else "cuda")
        dtype = precision_dtype(args.precision, device.type == "cuda", capability is not None and capability >= (8, 0))
        backend = default_backend(args, device)
    H, W = args.image_H or image_size, args.image_W or image_size
    prompts = 1
    if args.prompt_file:
        with open(args.prompt_file, encoding="utf-8") as f:
            prompts = max(1, sum(1 for line in f if line.strip()))
    drafts = plans.given_drafts(args.draft_window, args.draft_coupling, args.draft_tree)
    s = plans.Situation(
        backend=backend, compile_scope=args.compile_scope, compile_prefill=args.compile_prefill, device=device.type,
        capability=capability, triton=plans.triton_available(), interpret=plans.interpreting(), dtype=dtype,
        int8=args.quantize == "int8", top_p=args.top_p, cfg=args.cfg_scale > 1.0, batch=prompts * args.num_images,
        dim=margs.dim, n_head=margs.n_head, ffn_hidden=margs.ffn_hidden, vocab_size=margs.vocab_size,
        max_seq=margs.prefix_len + (H // 16) * (W // 16), builds=builds,
        overrides=tuple(dict(plans.environment_overrides() + plans.parse_overrides(args.plan)).items()),
        draft_window=drafts.window if args.speculative == "jacobi" else 0,
        draft_tree=drafts.tree if args.speculative == "jacobi" else (), draft_coupling=drafts.coupling,
        draft_init=args.draft_init, auto_drafts=drafts.auto)
    print(plans.explain(plans.make(s)))
    print(plans.explain_server(s))  # and a server's steps (serve.py), rows at their own positions


def default_out(args, model_type, demo):
    name = f"sample_{model_type}_{args.condition_type}" + ("_demo" if demo else "") + ".png"
    return os.path.join(ROOT, "sample", "example", name)


def save_outputs(args, out, images, control, tokens, caption=None):
    """The grid (control map, then the samples), then per-sample PNGs and the tokens; each atomic. With a caption
    (the demo) the grid is a figure: cells enlarged, the caption written below."""
    from fast_inference.images import save_figure, save_image

    grid = torch.cat([control[None].to(images.device, images.dtype), images])
    if caption is None:
        save_image(grid, out, nrow=4, padding=2)
    else:
        save_figure(grid, out, caption, nrow=4, padding=2)
    if args.save_samples:
        for i, img in enumerate(images):
            save_image(img, os.path.join(args.save_samples, f"{i}.png"))
    if args.save_tokens:
        os.makedirs(os.path.dirname(os.path.abspath(args.save_tokens)), exist_ok=True)
        tmp = args.save_tokens + ".tmp.npy"
        np.save(tmp, tokens.cpu().numpy().astype(np.int64))
        os.replace(tmp, args.save_tokens)


def weights_note(args, demo):
    """What the run draws with: the demo model's control and what to try next, or what random weights make of the
    output (None when every weight is loaded)."""
    if demo:
        where = args.condition_path or f"scene {DEMO_SCENE} of the demo set's test split"
        return (f"{args.condition_type} control: {where}. Try --prompt with the words of fast_inference/scenes.py, "
                "another --condition-type or --seed; real checkpoints: see checkpoints/README.md")
    if not args.gpt_ckpt:
        vq = "" if args.vq_ckpt else " and the VQ decoder"
        return f"no --gpt-ckpt: RANDOM weights in the transformer{vq}, so the tokens and the PNGs are noise"
    if not args.vq_ckpt:
        return "no --vq-ckpt: the VQ decoder has RANDOM weights, so the PNGs are noise (tokens are real)"
    return None


def run(args):
    t_start = time.perf_counter()
    check_args(args)
    if args.explain:
        return explain(args)
    params = SamplingParams.from_args(args)
    device, dtype, backend = pick_device(args)
    demo = is_demo(args)
    margs, image_size = model_args(args)
    out = args.out or default_out(args, margs.model_type, demo)
    check_writable(out)
    H, W = planned_shape(args, image_size, margs.model_type)
    check_grid(margs, H, W, image_size)
    run_memory(args, margs, H, W, prompt_count(args) * args.num_images, device, dtype,
               "use a smaller --image-size, --image-H/--image-W or --num-images")
    t0 = time.perf_counter()
    pipe = Pipeline(PipelineConfig.from_args(args), keep_text_encoder=False, spell=flag_name)
    t_models = time.perf_counter() - t0
    if demo and not all(os.path.isfile(os.path.join(EXAMPLES_DIR, f"{t}.png")) for t in CONDITION_TYPES):
        from fast_inference.conditions import write_examples

        write_examples(EXAMPLES_DIR)  # 512x512 example maps to try real checkpoints on
    t0 = time.perf_counter()
    control = pipe.prepare_control(args.condition_path, is_map=args.condition_is_map, height=args.image_H,
                                   width=args.image_W)
    t_control = time.perf_counter() - t0
    H, W = control.shape[1:]
    check_draft_grid(params, H, W)
    num_tokens = (H // 16) * (W // 16)
    t0 = time.perf_counter()
    cond, mask, prompts = text_inputs(args, pipe)
    t_text = time.perf_counter() - t0
    engine = pipe.engine_for(params)
    weights = " (int8 weights)" if args.quantize == "int8" else ""
    print(f"{describe(args, pipe.margs, demo)} | {args.engine} engine{'' if engine is None else ' (' + backend + ')'} | "
          f"{str(dtype).replace('torch.', '')}{weights} on {device} | {len(prompts)} prompt(s) x {args.num_images} "
          f"image(s) | {H}x{W} = {num_tokens} tokens")
    if demo:
        print(f"  prompt: {' | '.join(prompts)!r}")
    note = weights_note(args, demo)
    if note:
        print("  " + note)
    for _ in range(args.warmup):  # the VQ decode's first call builds its kernels (seconds): warm it up too
        pipe.decode(pipe.generate_tokens(cond, mask, control, params), H, W)
    t0 = time.perf_counter()
    tokens = pipe.generate_tokens(cond, mask, control, params)
    sync(device)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    images = pipe.decode(tokens, H, W)
    sync(device)
    t_vq = time.perf_counter() - t0
    save_outputs(args, out, images, control, tokens, caption=" | ".join(prompts) if demo else None)
    times = dict(imports=t_start - PROCESS_START, models=t_models, control=t_control, text=t_text, generate=t_gen,
                 vq=t_vq, total=time.perf_counter() - PROCESS_START)
    report(engine, times, tokens)
    print(f"saved {out}" + "".join(f", {p}" for p in (args.save_samples, args.save_tokens) if p))


def report(engine, times, tokens):
    n = tokens.numel()
    parts = [f"imports {times['imports']:.1f}s", f"models {times['models']:.1f}s", f"control {times['control']:.2f}s", f"text {times['text']:.2f}s"]
    if engine is not None and engine.last_timings:
        tm = engine.last_timings
        decode = tm["decode"]
        parts += [f"condition encoder {tm['condition']:.3f}s", f"prefill {tm['prefill']:.3f}s",
                  f"decode {decode:.2f}s ({n / max(decode, 1e-9):.0f} tok/s)"]
        spec = engine.last_speculation
        if spec:  # passes per image, tokens per pass, and a pass's time
            passes = sum(spec["passes"]) / len(spec["passes"])
            s = engine.plan.situation  # the drafts the passes ran (the plan's choice where the flags were left out)
            tree = f" in a {plans.tree_words(s.draft_tree)} tree" if s.draft_tree else ""
            parts.append(f"passes of {s.draft_window}{tree}, {s.draft_coupling}: {passes:.0f} per image, "
                         f"{spec['tokens_per_pass']:.2f} tokens per pass, "
                         f"{1e3 * decode / max(spec['batch_passes'], 1):.2f} ms per pass")
        if engine.backend != "eager":
            parts.append(f"compile/capture {engine.compile_seconds:.1f}s")
    else:
        parts.append(f"generate {times['generate']:.2f}s ({n / max(times['generate'], 1e-9):.0f} tok/s)")
    parts += [f"VQ decode {times['vq']:.2f}s", f"total {times['total']:.1f}s"]
    print("  " + " | ".join(parts))


def main(argv=None):
    args = parse_args(argv)
    cli_main(lambda: run(args), args.debug, is_user_error)


if __name__ == "__main__":
    main()
