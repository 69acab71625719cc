"""ControlAR as a long-running server: a JSON API and a web page over engines kept warm, many users' requests decoded
as one batch (continuous batching: continuous.py; scheduling: scheduler.py).

    python fast_inference/serve.py                            # the embedded demo model on http://127.0.0.1:8000
    python fast_inference/serve.py --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base \
        --vq-ckpt checkpoints/vq_ds16_t2i.pt --t5-path checkpoints/t5-ckpt/flan-t5-xl --port 8000

The model flags are fast_engine.py's (checkpoints are chosen here, at start-up, never by a request); its sampling
flags are the requests' defaults. One engine per visible GPU (--device cuda:0,cuda:1; on the CPU one, or
--engines-per-device N). Needs `pip install -r requirements-serve.txt` (Starlette, uvicorn).

API (JSON; every error is {"error": ..., "field": ...} with a 4xx status, an unknown page or method too):
  GET  /                        the web page
  GET  /v1/info                 the model, the defaults and limits, the engines and the queue
  GET  /v1/examples/TYPE.png    a built-in example control map (drawn, never read from disk)
  POST /v1/control              {"control", "condition_type", "width", "height"} -> the control map as a PNG
  POST /v1/jobs                 a request -> 202 {"id", ...}; 503 with Retry-After when the queue is full
  GET  /v1/jobs/ID              its status: tokens done, images' URLs, error
  GET  /v1/jobs/ID/events       Server-Sent Events: progress (tokens, rows, a preview's URL), then done/failed/
                                cancelled; closing the stream before the end cancels the job
  GET  /v1/jobs/ID/images/K.png its K-th image; /v1/jobs/ID/preview.png the rows done so far
  DELETE /v1/jobs/ID            cancel
  POST /v1/generate             a request, answered when done: {"id", "status", "images": [base64 PNG]}; a client
                                that disconnects cancels it
  GET  /healthz                 {"ok": true}; 503 while shutting down
A request: {"control": {"example": "hed"} | {"image": BASE64, "is_map": false}, "condition_type", "prompt" |
"caption_emb": BASE64 .npz | "class_label" (c2i), "cfg_scale", "top_k", "top_p", "temperature", "seed",
"num_images", "control_strength", "width", "height", "preview_every" (grid rows; 0 none)}; all optional, each checked
against the ranges /v1/info gives. Ctrl-C / SIGTERM drains: new jobs 503, the socket open for the rest, the jobs
--shutdown-grace seconds to finish and be fetched, then the rest cancelled and their waiting clients answered.
"""
import asyncio
import base64
import binascii
import contextlib
import copy
import io
import json
import logging
import math
import os
import signal
import sys
import threading
import time

if __package__ in (None, ""):  # run as a script: make `fast_inference` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch
from PIL import Image

try:  # the server's libraries (requirements-serve.txt); serve() says how to install them where they are missing
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError:
    Starlette = None

from fast_inference.continuous import Request
from fast_inference.demo_text import DemoTextEncoder
from fast_inference.components import (CONDITION_TYPES, check_memory, default_backend, describe, is_demo,
                                       make_engine, model_args, precision_dtype, t5_folder, use_demo_model, vq_config)
from fast_inference.engine import vq_kernels
from fast_inference.flags import Parser, add_model_args, add_text_args, cli_main, is_user_error
from fast_inference.pipeline import Pipeline, PipelineConfig, demo_rgb, demo_scene, encode_prompts
from fast_inference.settings import RANGES, UserError, check_ranges, flag_name
from fast_inference.scenes import VOCABULARY
from fast_inference.scheduler import FINAL, Job, QueueFull, Scheduler

log = logging.getLogger("fast_inference")
CLIENTS_GRACE = 5.0  # seconds a shutdown waits for its answers to the cancelled jobs' clients to go out
DRAIN_BYTES = 64 * 2**20  # a refused body is read and dropped up to this size; past it the connection is closed
PNG_LEVEL = 1  # zlib's fastest: a 512 px answer in half the time of the default 6, 12% more bytes (PERF_NOTES)
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_page.html")
SERVER_RANGES = dict(port=(0, 65535, None), batch=(1, 64, "images one engine decodes at once"),
                     max_queue=(1, None, "jobs accepted and not finished"), max_body_mb=(1, 1024, None),
                     max_side=(16, 16384, "pixels"), engines_per_device=(1, 16, None), shutdown_grace=(0, None, None),
                     keep_jobs=(1, None, None), steps_ahead=(0, None, "0 = no bound"), decoders=(1, 8, None))


class BadRequest(Exception):
    """A request's mistake: a 4xx answer naming the field (and what to send instead)."""

    def __init__(self, field, message, status=400):
        super().__init__(message)
        self.field, self.status = field, status


# ---- command line ------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = Parser(description="ControlAR server: a JSON API and a web page over warm engines, requests batched")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free one; default %(default)s)")
    p.add_argument("--batch", type=int, default=None,
                   help="images one engine decodes at once, requests joining and leaving (default 32 on a GPU, 8 on "
                        "the CPU; at most 64)")
    p.add_argument("--engines-per-device", type=int, default=1, help="engines (models) per device (default 1)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="jobs accepted and not yet finished; past it a request gets 503 (default %(default)s)")
    p.add_argument("--max-body-mb", type=int, default=16, help="largest request body in MiB (default %(default)s)")
    p.add_argument("--max-side", type=int, default=2048,
                   help="largest side of an uploaded image, in pixels (default %(default)s)")
    p.add_argument("--keep-jobs", type=int, default=256, help="finished jobs kept for download (default %(default)s)")
    p.add_argument("--steps-ahead", type=int, default=8,  # docs/PERF_NOTES.md, "Tenth session": 8 against 0 (none)
                   help="on a GPU, steps an engine issues ahead of the GPU before it waits (0: until the launch queue "
                        "is full; default %(default)s)")
    p.add_argument("--decoders", type=int, default=1,
                   help="threads per engine decoding finished requests' images with the VQ, each request at its own "
                        "batch, each thread on its own CUDA stream (at most 8; default %(default)s)")
    p.add_argument("--warm", choices=["auto", "on", "off"], default="auto",
                   help="before serving, run each engine's batch at every step size once (its compiles and CUDA "
                        "graphs, met later under load, stall the batch): auto, where the backend compiles or captures "
                        "(not eager; default %(default)s)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds Ctrl-C / SIGTERM lets the jobs accepted finish and be fetched (new ones get 503) "
                        "before cancelling the rest (default %(default)s)")
    add_text_args(p)
    p.add_argument("--no-left-padding", action="store_true", help="keep T5's right padding")
    args = use_demo_model(p.parse_args(argv))
    args.prompt = args.prompt_file = args.caption_emb = args.condition_path = args.out = None  # a request's, not ours
    args.save_tokens = args.save_samples = args.explain = None
    args.t5_feature_dim, args.class_label, args.num_images, args.warmup = None, None, 1, 0
    return args


def check_args(args):
    """What the server refuses before loading anything: one line naming the fix."""
    check_ranges(args)
    check_ranges(args, SERVER_RANGES)
    if args.engine == "reference":
        raise UserError("the server runs the fast engine; drop --engine reference")
    if args.speculative != "none":
        raise UserError("the server decodes one token per step; drop --speculative (fast_engine.py runs it)")
    if args.cfg_interval != -1:
        raise UserError("the server guides every token; drop --cfg-interval")
    if args.condition_type not in CONDITION_TYPES:
        raise UserError(f"unknown --condition-type {args.condition_type!r}; use one of {', '.join(CONDITION_TYPES)}")
    for flag in ("gpt_ckpt", "vq_ckpt"):
        path = getattr(args, flag)
        if path is not None and not os.path.isfile(path):
            raise UserError(f"--{flag.replace('_', '-')} {path} not found")
    if args.condition_ckpt is not None and not os.path.exists(args.condition_ckpt):
        raise UserError(f"--condition-ckpt {args.condition_ckpt} not found")
    if args.t5_path is not None and not os.path.isdir(args.t5_path):
        raise UserError(f"--t5-path {args.t5_path} is not a folder; pass the local flan-t5-xl folder")
    for flag in ("image_H", "image_W"):
        side = getattr(args, flag)
        if side is not None and side % 16:
            raise UserError(f"--{flag.replace('_', '-')} {side} is not a multiple of 16; use e.g. {-(-side // 16) * 16}")


def devices(args):
    """The engines' devices: --device as a comma list, default every visible GPU (else the CPU), each
    --engines-per-device times."""
    names = args.device.split(",") if args.device else (
        [f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"])
    out = []
    for name in names:
        try:
            device = torch.device(name.strip())
        except RuntimeError:
            raise UserError(f"unknown --device {name!r}; use cpu, cuda, cuda:N or a comma list of them") from None
        if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
            raise UserError(f"--device {name}: no such CUDA GPU is visible; use --device cpu")
        out += [device] * args.engines_per_device
    return out


# ---- the models ----------------------------------------------------------------------------------------------------

class Service:
    """Everything the server holds: the models on each device, the engines' scheduler, the text encoder."""

    def __init__(self, args):
        self.args = args
        self.devices = devices(args)
        first = self.devices[0]
        cuda = first.type == "cuda"
        self.dtype = precision_dtype(args.precision, cuda, cuda and torch.cuda.is_bf16_supported())
        self.backend = default_backend(args, first)
        if self.backend == "cudagraph" and not cuda:
            raise UserError("--backend cudagraph needs a CUDA device; use --backend eager on the CPU")
        self.demo = is_demo(args)
        self.margs, self.image_size = model_args(args)
        self.batch = args.batch or (32 if cuda else 8)
        S = self.image_size  # the largest batch a device holds: its engines' batches at the full grid, under CFG
        for device in set(self.devices):
            check_memory(self.margs, S, S, self.batch * self.devices.count(device), 4.0, device, self.dtype,
                         "use a smaller --batch or fewer --engines-per-device", vq_cfg=vq_config(args))
        # the first device's model, VQ and text encoder as a Pipeline builds them (random weights from --seed)
        self.pipe = Pipeline(PipelineConfig.from_args(args), device=str(first), spell=flag_name)
        model, vq = self.pipe.model, self.pipe.vq
        self.scheduler = Scheduler(max_queue=args.max_queue, keep=args.keep_jobs, steps_ahead=args.steps_ahead,
                                   decoders=args.decoders)
        # each engine its own model (its own caches), copied before any engine fuses its projections
        models = [model] + [copy.deepcopy(model).to(device) for device in self.devices[1:]]
        vqs = {}
        for device, m in zip(self.devices, models):
            if device not in vqs:
                vqs[device] = vq_kernels(vq if device == first else copy.deepcopy(vq).to(device), self.backend, device,
                                         args.plan)
            self.scheduler.add_worker(make_engine(args, m, self.backend), vqs[device], self.batch)
        self.clients = 0  # waiting for a job's end (/v1/generate, event streams): the drain waits for them
        self.text_lock = threading.Lock()  # T5 encodes one prompt at a time
        self.text = self.pipe.load_text_encoder()  # the demo model's words (on the CPU), T5, or None
        self.t5_path = t5_folder(args) if self.text is not None and not isinstance(self.text, DemoTextEncoder) else None
        self.ranges = request_ranges(self.scheduler.capacity, self.margs.block_size)
        self.defaults = dict(cfg_scale=args.cfg_scale, top_k=args.top_k, top_p=args.top_p,
                             temperature=args.temperature, control_strength=args.control_strength, seed=args.seed,
                             num_images=1, condition_type=args.condition_type, preview_every=0)
        if args.warm == "on" or (args.warm == "auto" and self.backend != "eager"):
            request = warm_request(self)
            for worker in self.scheduler.workers:
                worker.warm(request)

    def prompt_example(self):
        """The page's placeholder: the demo scene's caption where the demo model's words are the text encoder."""
        return demo_scene().caption if isinstance(self.text, DemoTextEncoder) else None

    def info(self):
        a = self.margs
        return dict(model=describe(self.args, a, self.demo), model_type=a.model_type,
                    demo=self.demo, text_encoder=self.text is not None, prompt_example=self.prompt_example(),
                    prompt_words=list(VOCABULARY) if isinstance(self.text, DemoTextEncoder) else None, condition_types=list(CONDITION_TYPES),
                    image_size=self.image_size, grid_tokens=a.block_size, caption_dim=a.caption_dim,
                    num_classes=a.num_classes,
                    defaults=self.defaults, ranges={k: list(v[:2]) for k, v in self.ranges.items()},
                    limits=dict(max_images=self.scheduler.capacity, max_tokens=a.block_size, side_multiple=16,
                                max_side=self.args.max_side, max_body_bytes=self.args.max_body_mb * 2**20,
                                max_queue=self.args.max_queue),
                    accepting=self.scheduler.accepting,
                    engines=[dict(device=str(w.engine.device), busy=w.busy, steps=w.steps,
                                  images_stepped=w.images_stepped,
                                  seconds={k: round(v, 3) for k, v in w.seconds.items()}, jobs_done=w.jobs_done,
                                  job_seconds={k: round(v, 3) for k, v in w.job_seconds.items()})
                             for w in self.scheduler.workers],
                    queue=dict(active=self.scheduler.active, pending=len(self.scheduler.pending)),
                    backend=self.backend, precision=str(self.dtype).replace("torch.", ""))


# ---- requests ------------------------------------------------------------------------------------------------------

REQUEST_RANGES = {k: RANGES[k] for k in ("cfg_scale", "top_k", "top_p", "temperature", "control_strength", "seed")}
REQUEST_RANGES.update(num_images=(1, None, "the server's batch"), preview_every=(0, None, "0 = no preview"),
                      width=(16, None, "a multiple of 16"), height=(16, None, "a multiple of 16"))
INTEGERS = ("top_k", "seed", "num_images", "preview_every", "width", "height", "class_label")
KNOWN = set(REQUEST_RANGES) | {"control", "condition_type", "prompt", "caption_emb", "class_label"}
CONTROL_FIELDS = {"example": {"example"}, "image": {"image", "is_map"}}


def request_ranges(capacity, grid):
    """The ranges a server enforces (and /v1/info advertises): REQUEST_RANGES with num_images at most the batch and a
    side at most 16 x the model's grid tokens (a one-token-high strip; width/16 x height/16 <= grid is checked too)."""
    ranges = dict(REQUEST_RANGES, num_images=(1, capacity, "the server's batch"))
    for name in ("width", "height"):
        ranges[name] = (16, 16 * grid, f"a multiple of 16; width/16 x height/16 at most {grid}")
    return ranges


def number(body, name, default, ranges=REQUEST_RANGES):
    """body[name] as a number in its range (an integer where it must be), else BadRequest naming it."""
    value = body.get(name, default)
    low, high, note = ranges[name]
    integer = name in INTEGERS
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer and value != int(value):
        ok = False
    if not ok or value < low or (high is not None and value > high):
        kind = "a whole number" if integer else "a number"
        raise BadRequest(name, f"{name} must be {kind} in {low}..{'' if high is None else high}"
                         + (f" ({note})" if note else "") + f", got {value!r}")
    return int(value) if integer else float(value)


def decode_base64(value, name, limit):
    if not isinstance(value, str) or not value:
        raise BadRequest(name, f"{name} must be a base64 string")
    if value.startswith("data:"):  # a data URL from a browser's FileReader
        value = value.partition(",")[2]
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(name, f"{name} is not valid base64") from None
    if len(data) > limit:
        raise BadRequest(name, f"{name} is {len(data)} bytes; at most {limit}", 413)
    return data


def read_upload(data, max_side):
    """An uploaded image's bytes -> uint8 RGB (H, W, 3): its size checked from the header before any pixel is decoded."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            W, H = im.size
            if max(H, W) > max_side or min(H, W) < 1:
                raise BadRequest("control.image", f"the control image is {W}x{H} (width x height); its sides must be "
                                 f"at most {max_side} pixels (--max-side)", 413)
            return np.array(im.convert("RGB"))
    except BadRequest:
        raise
    except Exception as e:  # noqa: BLE001 (PIL raises many kinds for a file that is not an image)
        raise BadRequest("control.image", f"control.image is not an image PIL can read ({type(e).__name__}); send a "
                         "PNG or JPEG") from None


def side(service, body, name, default):
    value = number(body, name, default, service.ranges)
    if value % 16:
        raise BadRequest(name, f"{name} {value} is not a multiple of 16; use e.g. {-(-value // 16) * 16}")
    return value


def example_rgb(service, kind, H, W):
    """uint8 (H, W, 3): a built-in example map, the demo scene's on the demo model (as fast_engine.py's), else drawn."""
    from fast_inference import conditions

    return demo_rgb(kind, H, W) if service.demo else conditions.draw_example(kind, H, W)


def control_map(service, body):
    """The request's control map (3, H, W) in [-1, 1] on the CPU and its condition type: a built-in example drawn at
    width x height (default the model's image size), or the upload, fitted to what the model draws (or resized to
    width x height) as fast_engine.py resizes it, extracted as its type asks."""
    from fast_inference import conditions

    control = control_fields(body)
    kind = condition_type(service, body, control)
    args = service.args
    if "example" in control:
        W = side(service, body, "width", args.image_W or service.image_size)
        H = side(service, body, "height", args.image_H or service.image_size)
        check_grid(service, H, W)
        return conditions.extract_control(example_rgb(service, kind, H, W), kind, is_map=True), kind
    is_map = control.get("is_map", False) or service.margs.model_type == "c2i"
    rgb = read_upload(decode_base64(control["image"], "control.image", args.max_body_mb * 2**20), args.max_side)
    step = 32 if kind == "depth" and not is_map else 16  # pipeline.control_shape's rounding
    fit_H, fit_W = fitted_size(*rgb.shape[:2], step, service.margs.block_size)
    W = side(service, body, "width", args.image_W or fit_W)
    H = side(service, body, "height", args.image_H or fit_H)
    check_grid(service, H, W)
    if (H, W) != rgb.shape[:2]:
        rgb = conditions.resize_to(rgb, H, W)
    ckpt = args.condition_ckpt if kind == args.condition_type else None
    if not is_map and kind in ("hed", "lineart", "depth") and ckpt is None:
        raise BadRequest("condition_type", f"this server has no {kind} annotator (start it with --condition-type "
                         f"{kind} --condition-ckpt ...); send a ready map with control.is_map true")
    try:
        return conditions.extract_control(rgb, kind, ckpt=ckpt, is_map=is_map), kind
    except conditions.ConditionError as e:
        raise BadRequest("control.image", str(e)) from None


def control_fields(body):
    """body["control"] checked: {"example": TYPE} or {"image": BASE64, "is_map": bool}, nothing else."""
    control = body.get("control", {"example": None})
    if not isinstance(control, dict) or ("example" in control) == ("image" in control):
        raise BadRequest("control", 'control must be {"example": TYPE} or {"image": BASE64, "is_map": false}')
    form = "example" if "example" in control else "image"
    extra = sorted(set(control) - CONTROL_FIELDS[form])
    if extra:
        raise BadRequest(f"control.{extra[0]}", f"control.{extra[0]} does not go with control.{form}; an example "
                         'is {"example": TYPE}, an upload {"image": BASE64, "is_map": false}')
    if not isinstance(control.get("is_map", False), bool):
        raise BadRequest("control.is_map", "control.is_map must be true or false")
    return control


def condition_type(service, body, control):
    """The request's condition type: condition_type, else its example's type, else the server's default. An example
    is a map of its own type: another condition_type with it is refused."""
    example = control.get("example")
    if example is not None and example not in CONDITION_TYPES:
        raise BadRequest("control.example", f"unknown example {example!r}; use one of {', '.join(CONDITION_TYPES)}")
    kind = body.get("condition_type", example or service.defaults["condition_type"])
    if kind not in CONDITION_TYPES:
        raise BadRequest("condition_type", f"unknown condition_type {kind!r}; use one of {', '.join(CONDITION_TYPES)}")
    if example not in (None, kind):
        raise BadRequest("control.example", f"the example {example!r} is a {example} map, not a {kind} map; send "
                         f'condition_type "{example}", or control {{"example": "{kind}"}}')
    return kind


def fitted_size(h, w, step, grid):
    """An upload's (H, W): its size rounded up to multiples of step, or where that needs more than the model's grid
    tokens, the largest multiples of step near its aspect ratio that the grid holds."""
    H, W = -(-h // step) * step, -(-w // step) * step
    if (H // 16) * (W // 16) <= grid:
        return H, W
    scale = math.sqrt(grid * 256 / (h * w))
    H = max(step, min(int(h * scale), grid // (step // 16) * 16) // step * step)  # room for one step of width
    W = max(step, min(int(w * scale), grid // (H // 16) * 16) // step * step)
    return H, W


def check_grid(service, H, W):
    tokens, grid, S = (H // 16) * (W // 16), service.margs.block_size, service.image_size
    if tokens > grid:
        raise BadRequest("width", f"{W}x{H} (width x height) needs {tokens} tokens but the model draws at most {grid} "
                         f"({S}x{S}, or any width/16 x height/16 <= {grid}); ask for a smaller width and height")


def text_condition(service, body, seed):
    """(cond, mask) of the request: a class label (c2i), an uploaded caption embedding, or the prompt through the
    model's text encoder (T5, or the demo model's words; no prompt: the demo scene's caption, as fast_engine.py's)."""
    from fast_inference import text

    a = service.margs
    if a.model_type == "c2i":
        if "prompt" in body or "caption_emb" in body:
            raise BadRequest("prompt", "this server's model is class-conditional (c2i); send class_label instead")
        label = body.get("class_label", 0 if service.demo else None)
        if label is None:
            raise BadRequest("class_label", f"this c2i model needs class_label (0..{a.num_classes - 1})")
        if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < a.num_classes:
            raise BadRequest("class_label", f"class_label must be a whole number in 0..{a.num_classes - 1}")
        return torch.tensor([label]), None
    if "class_label" in body:
        raise BadRequest("class_label", "this server's model is text-conditional (t2i); send prompt or caption_emb")
    if "prompt" in body and "caption_emb" in body:
        raise BadRequest("prompt", "send one of prompt and caption_emb")
    T = a.cls_token_num
    if "caption_emb" in body:
        data = decode_base64(body["caption_emb"], "caption_emb", service.args.max_body_mb * 2**20)
        try:
            emb, mask, _ = text.load_caption_emb(io.BytesIO(data), T, name="caption_emb")
        except text.TextError as e:
            raise BadRequest("caption_emb", str(e)) from None
        if emb.shape[2] != a.caption_dim:
            raise BadRequest("caption_emb", f"caption_emb width {emb.shape[2]} != the model's caption_dim "
                             f"{a.caption_dim}; use embeddings of the model's text encoder")
        try:
            text.check_values(emb, "caption_emb", "send values the model's precision holds", service.dtype)
        except text.TextError as e:
            raise BadRequest("caption_emb", str(e)) from None
        return emb, mask
    prompt = body.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or len(prompt) > 2000):
        raise BadRequest("prompt", "prompt must be a string of at most 2,000 characters")
    if service.text is None:
        if prompt:
            raise BadRequest("prompt", "this server has no text encoder (start it with --t5-path); send caption_emb "
                             "(an extracted .npz, base64) or leave prompt out")
        raise BadRequest("prompt", "send caption_emb (an extracted .npz, base64): the server has no text encoder")
    if isinstance(service.text, DemoTextEncoder):  # no prompt: the demo scene's caption, as fast_engine.py's
        try:
            return service.text.encode_left_padded(prompt or demo_scene().caption)
        except text.TextError as e:
            raise BadRequest("prompt", str(e)) from None
    gpu = service.scheduler.gpu.shared() if service.devices[0].type == "cuda" else contextlib.nullcontext()
    with service.text_lock, gpu:  # T5 on the first GPU: not while a worker captures a graph
        emb, mask = encode_prompts(service.text, [prompt or "a high-quality image"], T,
                                               not service.args.no_left_padding)
    text.check_t5_output(emb, service.t5_path)
    return emb.cpu(), mask.cpu()


def warm_request(service):
    """The request the engines warm with: the default settings, the built-in example of the server's condition type at
    the model's image size, the default caption (zeros of a caption's shape where no text encoder is loaded)."""
    a = service.margs
    control, kind = control_map(service, {"control": {"example": service.args.condition_type}})
    if a.model_type == "c2i":
        cond, mask = torch.tensor([0]), None
    elif service.text is None:
        cond, mask = torch.zeros(1, a.cls_token_num, a.caption_dim), torch.ones(1, a.cls_token_num, dtype=torch.int64)
    else:
        cond, mask = text_condition(service, {}, service.defaults["seed"])
    values = {k: v for k, v in service.defaults.items() if k != "preview_every"}
    return Request(cond=cond, mask=mask, control=control, **dict(values, condition_type=kind))


def make_request(service, body):
    """A request body (a JSON object) -> (Request, preview_every), every field checked."""
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise BadRequest(unknown[0], f"unknown field(s) {unknown}; known: {', '.join(sorted(KNOWN))}")
    d = service.defaults
    values = {k: number(body, k, d[k], service.ranges) for k in ("cfg_scale", "top_k", "top_p", "temperature",
                                                                 "control_strength", "seed", "num_images",
                                                                 "preview_every")}
    control, kind = control_map(service, body)
    cond, mask = text_condition(service, body, values["seed"])
    preview = values.pop("preview_every")
    return Request(cond=cond, mask=mask, control=control, condition_type=kind, **values), preview


# ---- the web application: routes over a Service (request.app.state.service), errors answered once -----------------

def create_app(service):
    routes = [Route("/", page), Route("/v1/info", info), Route("/healthz", health),
              Route("/v1/examples/{kind}.png", example),
              Route("/v1/control", control, methods=["POST"]),
              Route("/v1/jobs", create_job, methods=["POST"]),
              Route("/v1/jobs/{job}", one_job, methods=["GET", "DELETE"]),
              Route("/v1/jobs/{job}/events", events),
              Route("/v1/jobs/{job}/images/{k:int}.png", image),
              Route("/v1/jobs/{job}/preview.png", preview),
              Route("/v1/generate", generate, methods=["POST"])]
    app = Starlette(routes=routes, exception_handlers={BadRequest: bad_request, HTTPException: http_error})
    app.state.service = service
    return app


async def bad_request(request, e):
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return JSONResponse({"error": str(e), "field": e.field}, status_code=e.status, headers=headers)


async def http_error(request, e):
    """The router's 404 and 405 as the API's JSON."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 405:
        message, field = f"{where}: the method is not allowed here; use {e.headers.get('Allow')}", "method"
    elif e.status_code == 404:
        message, field = f"{where}: no such page; GET / is the page, GET /v1/info the API's limits", "path"
    else:
        message, field = f"{where}: {e.detail}", None
    return JSONResponse({"error": message, "field": field}, status_code=e.status_code, headers=e.headers)


def service_of(request):
    return request.app.state.service


async def read_json(request):
    """The body as a JSON object; one past --max-body-mb is read to its end (up to DRAIN_BYTES) and refused."""
    limit = service_of(request).args.max_body_mb * 2**20
    size = request.headers.get("content-length")
    over = size is not None and (not size.isdigit() or int(size) > limit)
    data, seen = bytearray(), 0
    try:
        async for chunk in request.stream():
            seen += len(chunk)
            over = over or seen > limit
            if not over:
                data += chunk
            elif seen > DRAIN_BYTES:
                break
    except ClientDisconnect:
        if not over:
            raise
    if over:  # refused after reading to the end: a client still sending would fail before reading the answer
        raise BadRequest("body", f"the body is larger than {limit} bytes (--max-body-mb)", 413)
    try:
        body = json.loads(bytes(data) or b"{}")
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest("body", f"the body is not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BadRequest("body", "the body must be a JSON object")
    return body


async def submit(request):
    """The request's body checked and queued as a Job, or BadRequest (a JSON 503 when full or shutting down)."""
    service = service_of(request)
    body = await read_json(request)
    if not service.scheduler.accepting:  # before any work on the body
        raise BadRequest("queue", "the server is shutting down; send the request to another server", 503)
    req, preview = await run_in_threadpool(make_request, service, body)
    job = Job(req, preview_every=preview)
    try:
        service.scheduler.submit(job)
    except QueueFull as e:
        raise BadRequest("queue", f"{e}; retry later", 503) from None
    return job


def find(request):
    job = service_of(request).scheduler.get(request.path_params["job"])
    if job is None:
        raise BadRequest("id", "no such job (unknown, or finished long ago and dropped)", 404)
    return job


@contextlib.contextmanager
def waiting_client(service):
    """A client waiting for a job's end (/v1/generate, an event stream): a shutdown's drain waits for it."""
    service.clients += 1
    try:
        yield
    finally:
        service.clients -= 1


async def page(request):
    with open(PAGE, encoding="utf-8") as f:
        return HTMLResponse(f.read())


async def info(request):
    return JSONResponse(service_of(request).info())


async def health(request):
    ok = service_of(request).scheduler.accepting
    return JSONResponse({"ok": ok, "accepting": ok}, status_code=200 if ok else 503)


async def example(request):
    service, kind = service_of(request), request.path_params["kind"]
    if kind not in CONDITION_TYPES:
        raise BadRequest("kind", f"no example {kind!r}; use one of {', '.join(CONDITION_TYPES)}", 404)
    size = service.args.image_H or service.image_size, service.args.image_W or service.image_size
    return Response(await run_in_threadpool(lambda: png(example_rgb(service, kind, *size))), media_type="image/png")


async def control(request):
    from fast_inference.images import to_uint8

    body = await read_json(request)
    x, _ = await run_in_threadpool(control_map, service_of(request), body)
    return Response(await run_in_threadpool(png, to_uint8(x)), media_type="image/png")


async def create_job(request):
    job = await submit(request)
    return JSONResponse(status(job), status_code=202)


async def one_job(request):
    """GET: its status; DELETE: cancel it."""
    job = find(request)
    if request.method == "DELETE":
        service_of(request).scheduler.cancel(job, "a client asked (DELETE)")
    elif job.status in ("failed", "cancelled"):
        job.collected = True
    return JSONResponse(status(job))


async def image(request):
    job, k = find(request), request.path_params["k"]
    if job.status != "done" or not 0 <= k < len(job.images):
        raise BadRequest("k", f"no image {k} (the job is {job.status})", 404)
    data = await run_in_threadpool(png, job.images[k])
    job.fetched.add(k)
    job.collected = job.collected or len(job.fetched) == len(job.images)
    disposition = f'inline; filename="{job.id}_{k}.png"'
    return Response(data, media_type="image/png", headers={"Content-Disposition": disposition})


async def preview(request):
    job = find(request)
    if job.preview is None:
        raise BadRequest("preview", "no preview yet (ask for one with preview_every)", 404)
    return Response(await run_in_threadpool(png, job.preview), media_type="image/png")


async def events(request):
    stream = event_stream(service_of(request), find(request))
    return StreamingResponse(stream, media_type="text/event-stream", headers={"Cache-Control": "no-store"})


async def event_stream(service, job):
    """progress events while the job changes (not twice the same), then its final event; a client that leaves before
    the end cancels the job."""
    sent, finished = None, False
    with waiting_client(service), watch(job) as changed:
        try:
            while True:
                await changed.wait()
                changed.clear()
                now = status(job)
                if changes(now, sent):
                    final = job.status in FINAL
                    yield f"event: {job.status if final else 'progress'}\ndata: {json.dumps(now)}\n\n"
                    sent = now
                if job.status in FINAL:
                    job.collected = job.collected or job.status != "done"
                    finished = True
                    return
        finally:
            if not finished:  # the client went away: its rows are freed
                service.scheduler.cancel(job, "its event stream was closed")


async def generate(request):
    """A job answered when it ends, its images as base64 PNGs; a client that leaves first cancels it."""
    service, job = service_of(request), await submit(request)
    with waiting_client(service), watch(job) as changed:
        try:
            await wait_or_leave(request, job, changed)
        finally:
            if job.status not in FINAL:  # the client gone (or this task cancelled)
                service.scheduler.cancel(job, "its client disconnected")
    if job.status not in FINAL:
        return Response(status_code=499)  # nobody reads it: the client has gone
    out = status(job)
    if job.status == "done":
        out["images"] = [base64.b64encode(await run_in_threadpool(png, a)).decode() for a in job.images]
    job.collected = True
    return JSONResponse(out, status_code=outcome_code(job, service.scheduler.accepting))


def status(job):
    """A job's status as the API gives it."""
    base = f"/v1/jobs/{job.id}"
    n = job.request.num_images
    return dict(id=job.id, status=job.status, tokens_done=job.tokens_done, tokens_total=job.tokens_total,
                num_images=n, seed=job.request.seed, width=job.request.control.shape[2],
                height=job.request.control.shape[1], engine=job.engine, error=job.error,
                images=[f"{base}/images/{k}.png" for k in range(n)] if job.status == "done" else [],
                preview=f"{base}/preview.png" if job.preview is not None else None,
                seconds=round((job.finished or time.monotonic()) - job.created, 3))


def changes(now, sent):
    """Whether status `now` says more than `sent` did (the seconds alone change every time)."""
    return sent is None or {**now, "seconds": None} != {**sent, "seconds": None}


def outcome_code(job, accepting):
    """/v1/generate's HTTP status for a final job: 200 done, 500 failed, 409 cancelled (503 by a shutdown)."""
    if job.status == "cancelled":
        return 409 if accepting else 503
    return 200 if job.status == "done" else 500


@contextlib.contextmanager
def watch(job):
    """An asyncio.Event set (from the worker's thread) whenever the job changes, while the block runs."""
    loop, changed = asyncio.get_running_loop(), asyncio.Event()
    watcher = lambda: loop.call_soon_threadsafe(changed.set)
    job.watchers.append(watcher)
    changed.set()
    try:
        yield changed
    finally:
        job.watchers.remove(watcher)


async def wait_or_leave(request, job, changed):
    """Until the job ends or its client disconnects."""
    while job.status not in FINAL:
        try:
            await asyncio.wait_for(changed.wait(), timeout=0.25)
            changed.clear()
        except asyncio.TimeoutError:
            pass
        if job.status not in FINAL and await request.is_disconnected():
            return


def png(array):
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(array)).save(buf, format="PNG", compress_level=PNG_LEVEL)
    return buf.getvalue()


# ---- main ----------------------------------------------------------------------------------------------------------

def serve(args):
    try:
        import uvicorn
        import starlette  # noqa: F401
    except ImportError:
        raise UserError("the server needs Starlette and uvicorn: pip install -r requirements-serve.txt") from None
    check_args(args)
    t0 = time.perf_counter()
    service = Service(args)
    app = create_app(service)
    scheduler = service.scheduler

    class Server(uvicorn.Server):
        """uvicorn's server with a drain: the first Ctrl-C / SIGTERM stops new jobs (503) while the socket stays open
        for status and images; the jobs get --shutdown-grace seconds, the rest are cancelled and their waiting clients
        answered; then uvicorn stops. A second signal cancels at once, a third exits at once."""
        signals = 0

        def handle_exit(self, sig, frame):
            self.signals += 1
            if self.signals == 1:
                scheduler.accepting = False
                threading.Thread(target=self.drain, name="drain", daemon=True).start()
            elif self.signals == 2:
                hurry.set()
            else:
                self.should_exit = self.force_exit = True

        def drain(self):
            cancelled = scheduler.drain(args.shutdown_grace, hurry)
            deadline = time.monotonic() + CLIENTS_GRACE
            while service.clients and time.monotonic() < deadline:  # the cancelled jobs' answers go out
                time.sleep(0.05)
            if cancelled:
                log.warning("shutdown: %d job(s) cancelled after --shutdown-grace %g s", len(cancelled),
                            args.shutdown_grace)
            self.should_exit = True

        @contextlib.contextmanager
        def capture_signals(self):  # as uvicorn's, without raising the signal again at the end: a clean exit 0
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                engines = ", ".join(str(w.engine.device) for w in scheduler.workers)
                print(f"serving {service.info()['model']} on http://{host}:{port} ({len(scheduler.workers)} "
                      f"engine(s): {engines}; batch {service.batch}; ready in {time.perf_counter() - t0:.1f}s)",
                      flush=True)

    hurry = threading.Event()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", lifespan="off",
                            timeout_graceful_shutdown=CLIENTS_GRACE)
    server = Server(config)
    scheduler.start()
    try:
        server.run()
    finally:
        scheduler.close(grace=0)
    print("server stopped", flush=True)


def main(argv=None):
    args = parse_args(argv)
    cli_main(lambda: serve(args), args.debug, is_user_error)


if __name__ == "__main__":
    main()
