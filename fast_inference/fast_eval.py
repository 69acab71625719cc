"""Sharded, resumable generation over a validation split, then the official metrics.

    python fast_inference/fast_eval.py --gpt-ckpt checkpoints/edge_base.safetensors --adapter-size base \
        --vq-ckpt checkpoints/vq_ds16_t2i.pt --condition-type canny --data-path data/multigen_val \
        --sample-dir sample/multigen/canny --batch 32 --metrics
    python fast_inference/fast_eval.py --condition-type canny --metrics   # the demo model on 64 demo-set scenes
    torchrun --nproc_per_node 8 fast_inference/fast_eval.py ...        # the same, on 8 GPUs

Outputs are named as the official test_t2i.py names them, so its metric scripts work on our
folders: <sample-dir>/visualization/{index:06d}.png (the image) and annotations/{index:06d}.png
(channel 0 of the control, or the seg label map). Each file is written under <sample-dir>/.tmp
and renamed into place, so a killed run leaves only whole files; running the same command again
skips every sample that has both.

Batches and seeds. The positions of the sorted samples are cut into fixed batches [kB, (k+1)B),
B = --batch. Batch k is sampled after torch.manual_seed(seed * 2**32 + kB), always with B rows:
rows outside --start/--end or already finished are filled with a copy of a sample and dropped.
Rows do not interact, so a sample's image depends on the seed, its position, B and its own inputs
only -- not on --start/--end, the number of ranks, or what an earlier run finished: a resumed or
re-sharded run writes the same bytes. (The official script seeds rank r with
global_seed * world_size + r, which ties every image to the GPU count.) Under torchrun, rank r
takes every world_size-th batch of the range and the GPU LOCAL_RANK.
"""
import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

if __package__ in (None, ""):  # run as a script: make `fast_inference` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from tqdm import tqdm

from fast_inference import conditions, data, metrics
from fast_inference import plan as plans
from fast_inference.components import (ROOT, check_writable, is_demo, model_args, pick_device, run_memory,
                                       sample_tokens, use_demo_model)
from fast_inference.engine import Engine
from fast_inference.flags import Parser, add_model_args, cli_main, is_user_error
from fast_inference.pipeline import Pipeline, PipelineConfig
from fast_inference.settings import (SamplingParams, UserError, check_draft_grid, check_ranges, check_speculative,
                                     flag_name)
from fast_inference.images import save_image, save_png_uint8


# Settings that change the images: a sample dir only ever holds the output of one combination.
OUTPUT_SETTINGS = ("gpt_model", "gpt_ckpt", "gpt_type", "vq_model", "vq_ckpt", "codebook_size", "codebook_embed_dim",
                   "image_size", "image_H", "image_W", "downsample_size", "cls_token_num", "adapter_size",
                   "condition_type", "condition_ckpt", "condition_is_map", "pos_interp", "t5_path", "cfg_scale",
                   "cfg_interval", "top_k", "top_p", "temperature", "control_strength", "seed", "engine", "batch",
                   "data_path", "manifest")
# Settings whose files are compared by content (settings.json's "content"), so that they may move (a copy on a
# node's local disk resumes the folder) while another file behind the same path is refused.
CONTENT_SETTINGS = ("gpt_model", "gpt_ckpt", "vq_ckpt", "condition_ckpt", "t5_path")
EVAL_RANGES = dict(start=(0, None, None), end=(1, None, None), batch=(1, None, None), num_workers=(0, None, None))


def parse_args(argv=None):
    p = Parser(description="ControlAR batch evaluation: sharded, resumable generation and metrics")
    add_model_args(p)
    g = p.add_argument_group("evaluation")
    g.add_argument("--data-path", "--code-path", default=None,
                   help="extracted validation split (image/, caption_emb/, control/ or control_depth/, label/)")
    g.add_argument("--manifest", default=None, help="JSONL: id, control, caption_emb or prompt[, class_label, label]; "
                   "paths relative to its folder, and inside it")
    g.add_argument("--allow-outside-paths", action="store_true",
                   help="let --manifest paths leave its folder (absolute, ../, symlinks out): for trusted manifests")
    g.add_argument("--start", type=int, default=0, help="first sample position (in the sorted ids; >= 0)")
    g.add_argument("--end", type=int, default=None, help="one past the last position (default: all; >= 1)")
    g.add_argument("--batch", type=int, default=32,
                   help="images per batch (fixed; the seed depends on it; >= 1, as many as fit the free memory)")
    g.add_argument("--sample-dir", default=None,
                   help="output folder (default sample/eval/<condition-type>); one run writes it at a time")
    g.add_argument("--num-workers", type=int, default=4, help="data-loading processes (0: load in line; >= 0)")
    g.add_argument("--metrics", action="store_true", help="compute the metrics after generating")
    g.add_argument("--metrics-only", action="store_true", help="only compute the metrics of --sample-dir")
    g.add_argument("--pred-dir", default=None, help="seg: the segmenter's label maps {name}.png, for mIoU")
    g.add_argument("--seg-dataset", choices=sorted(metrics.SEG_DATASETS), default="ade20k",
                   help="seg: label conventions of the mIoU (ADE20K shift/ignore 0, or COCO-Stuff ignore 255)")
    g.add_argument("--fid-ref", default=None, help="real images for FID (default <data-path>/image)")
    args = use_demo_model(p.parse_args(argv))
    args.sample_dir = args.sample_dir or os.path.join("sample", "eval", args.condition_type)
    return args


# ---- sharding and seeding -----------------------------------------------------------------------

def dist_env():
    """(rank, world_size, local_rank) from torchrun's environment; (0, 1, 0) without it."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def shard(start, end, batch, rank=0, world=1):
    """This rank's batches as (first position of the batch, positions of it in [start, end))."""
    first_batch, stop = start // batch, -(-end // batch)
    return [(k * batch, list(range(max(k * batch, start), min((k + 1) * batch, end))))
            for k in range(first_batch + rank, stop, world)]


def batch_seed(seed, first):
    return seed * 2**32 + first


# ---- outputs ------------------------------------------------------------------------------------

def output_paths(sample_dir, name):
    return (os.path.join(sample_dir, "visualization", name + ".png"),
            os.path.join(sample_dir, "annotations", name + ".png"))


def finished(sample_dir, name):
    return all(os.path.isfile(p) for p in output_paths(sample_dir, name))


def publish(write, x, path):
    """Write under <sample-dir>/.tmp, then rename: the output folders only ever hold whole PNGs
    (the official metric scripts read every file there)."""
    if os.path.isfile(path):
        return
    tmp_dir = os.path.join(os.path.dirname(os.path.dirname(path)), ".tmp")
    tmp = os.path.join(tmp_dir, f"{os.getpid()}_{os.path.basename(os.path.dirname(path))}_{os.path.basename(path)}")
    write(x, tmp)
    os.replace(tmp, path)


def save_batch(sample_dir, names, rows, images, controls, labels):
    for i, (name, row, label) in enumerate(zip(names, rows, labels)):
        vis, ann = output_paths(sample_dir, name)
        publish(save_image, images[row], vis)
        if label is not None:
            publish(save_png_uint8, label, ann)  # seg: raw class ids, mode 'L', as test_t2i.py
        else:
            publish(save_image, controls[i, 0], ann)


def output_settings(args, margs, resolved):
    """What the images depend on: the flags, the model's arguments as resolved (a JSON config's content), and the
    sha256 of every file read (checkpoints, the T5 and annotator folders)."""
    path_keys = {"gpt_ckpt", "vq_ckpt", "condition_ckpt", "t5_path", "data_path", "manifest"}
    settings = {k: os.path.abspath(v) if k in path_keys and v else v for k, v in vars(args).items()
                if k in OUTPUT_SETTINGS}
    settings.update(resolved)
    if args.speculative != "none":  # another random stream (the same distribution); absent from older folders
        # the draft flags as given (None: the plan's choice at each batch, plan.given_drafts)
        settings.update(speculative=args.speculative, draft_window=args.draft_window, draft_init=args.draft_init,
                        draft_coupling=args.draft_coupling,
                        **({"draft_tree": list(args.draft_tree)} if args.draft_tree is not None else {}))
    cache_path = os.path.join(args.sample_dir, HASHES)
    cache = read_json(cache_path)
    content = {"model": dataclasses.asdict(margs)}
    for k in ("gpt_ckpt", "vq_ckpt", "condition_ckpt", "t5_path"):
        content[k] = content_hash(getattr(args, k), cache) if getattr(args, k) else None
    metrics.write_json(cache, cache_path)
    return dict(settings, content=content)


HASHES = ".hashes.json"  # <sample-dir>'s cache of file hashes: each file is read once per folder


def content_hash(path, cache):
    """sha256 of a file's bytes, or of a folder's files (names and hashes; hidden ones skipped). cache maps a real
    path to (its stat, its hash): any write changes the stat (its ctime cannot be set back, unlike the mtime), so a
    resumed run reads nothing again, while a copy elsewhere or a file rewritten in place is hashed anew."""
    if os.path.isdir(path):
        h = hashlib.sha256()
        for folder, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # walked in this order
            for name in sorted(f for f in files if not f.startswith(".")):
                full = os.path.join(folder, name)
                h.update(f"{os.path.relpath(full, path)} {content_hash(full, cache)}\n".encode())
        return h.hexdigest()
    st = os.stat(path)
    key, stamp = os.path.realpath(path), [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    if cache.get(key, [None])[0] != stamp:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        cache[key] = [stamp, h.hexdigest()]
    return cache[key][1]


def read_json(path):
    """A JSON object from path; {} if it is missing or unreadable (a cache)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def flat(d, prefix=""):
    """{"content": {"model": {"dim": 64}}} -> {"content.model.dim": 64}: one key per value, for the diff."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_settings(sample_dir, settings):
    """Refuse a folder holding samples of other settings. Read only: settings.json is written once the run is
    certain to start (write_settings), so a run that fails before never blocks the corrected one."""
    path = os.path.join(sample_dir, "settings.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        before = json.load(f)
    now = dict(settings)
    if "content" in before:  # contents compared: those files may have moved
        before, now = ({k: v for k, v in d.items() if k not in CONTENT_SETTINGS} for d in (before, now))
    else:  # a folder from before contents were recorded: paths compared, as then
        now.pop("content")
    before, now = flat(before), flat(now)
    changed = sorted(k for k in set(before) | set(now) if before.get(k) != now.get(k))
    if changed:
        diff = ", ".join(f"{k}: {before.get(k)!r} -> {now.get(k)!r}" for k in changed)
        raise UserError(f"{sample_dir} holds samples made with other settings ({diff}); "
                        "use the same settings or another --sample-dir")


def write_settings(sample_dir, settings):
    path = os.path.join(sample_dir, "settings.json")
    if not os.path.isfile(path):
        os.makedirs(sample_dir, exist_ok=True)
        metrics.write_json(settings, path)


# ---- one writer per folder ------------------------------------------------------------------------
# Rank 0 holds an exclusive lock on <sample-dir>/.lock for the whole run, writes its job there, checks the
# folder's settings and marks the record checked; the other ranks of its job write nothing until then, and every
# process of another job is refused at once (a second job would only idle its GPUs for days, then find nothing to
# do). A POSIX (fcntl) lock: NFS shares it between nodes, forked DataLoader workers do not inherit it, and it ends
# with its process, so a killed run never blocks the next.

LOCK = ".lock"


def job_id(world):
    """What every rank of one torchrun job shares and no other live job does: its rendezvous endpoint (a port
    bound while the job lives) and run id; a single process is a job of its own."""
    if world == 1:
        return f"{socket.gethostname()}:{os.getpid()}"
    addr = os.environ.get("MASTER_ADDR", "")
    if addr in ("", "localhost", "::1") or addr.startswith("127."):
        addr = socket.gethostname()  # one node: its ranks share the host name
    return f"{addr}:{os.environ.get('MASTER_PORT', '')}:{os.environ.get('TORCHELASTIC_RUN_ID', '')}"


def lock_sample_dir(sample_dir, job, tries=20):
    """Rank 0: the folder's lock, holding our job's record -> the open fd (closing it releases the lock)."""
    os.makedirs(sample_dir, exist_ok=True)
    fd = os.open(os.path.join(sample_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    for _ in range(tries):  # other ranks' probes hold it for microseconds
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except (BlockingIOError, PermissionError):
            time.sleep(0.1)
        except OSError as e:  # a filesystem without locks (Lustre mounted without flock)
            print(f"warning: cannot lock {sample_dir} ({e.strerror}); make sure no other run writes it", file=sys.stderr)
            return fd
    else:
        holder = read_holder(fd)
        os.close(fd)
        raise UserError(busy(sample_dir, holder))
    write_record(fd, job, checked=False)
    return fd


def write_record(fd, job, checked):
    """The lock holder's record: its job, where it runs, and whether the folder's settings are checked."""
    record = dict(job=job, host=socket.gethostname(), pid=os.getpid(), since=time.strftime("%Y-%m-%d %H:%M:%S"),
                  checked=checked)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)


def wait_for_lock(sample_dir, job, grace=5.0, timeout=3600.0, poll=0.2):
    """Rank r > 0: write nothing until our rank 0 holds the folder's lock and has checked its settings (hashing
    the checkpoints the first time); refuse when another job holds it."""
    deadline, other_since = time.monotonic() + timeout, None
    while True:
        held, holder = probe_lock(os.path.join(sample_dir, LOCK))
        if held is None or (held and holder.get("job") == job and holder.get("checked")):
            return
        if held and holder.get("job") != job:  # another job's, or ours while its record is (re)written
            other_since = other_since or time.monotonic()
            if time.monotonic() - other_since > grace:
                raise UserError(busy(sample_dir, holder))
        else:
            other_since = None
        if time.monotonic() > deadline:
            raise UserError(f"rank 0 did not lock and check {sample_dir} in {timeout:.0f} s; see its error")
        time.sleep(poll)


def probe_lock(path):
    """(whether a process holds the lock, None where the filesystem has no locks; its record)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False, {}
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return False, {}
    except (BlockingIOError, PermissionError):
        return True, read_holder(fd)
    except OSError:
        return None, {}
    finally:
        os.close(fd)


def read_holder(fd):
    try:
        return json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}


def busy(sample_dir, holder):
    who = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {holder.get('since', '?')}"
    return (f"{sample_dir} is being written by another fast_eval.py run ({who}); wait for it to end or use another "
            "--sample-dir (a killed run's lock ends with its process)")


class RunLog:
    """One JSON object per line: the start (settings), every batch (timings), the end."""

    def __init__(self, sample_dir, rank, start, end):
        os.makedirs(os.path.join(sample_dir, "logs"), exist_ok=True)
        self.f = open(os.path.join(sample_dir, "logs", f"rank{rank}_{start}-{end}.jsonl"), "a", buffering=1)

    def write(self, event, **fields):
        self.f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


# ---- data ---------------------------------------------------------------------------------------

DEMO_SPLIT = 64  # scenes of the demo set's test split the evaluation demo writes and scores


def load_samples(args):
    if is_demo(args) and args.data_path is None and args.manifest is None:
        args.data_path = demo_split(args)
    if (args.data_path is None) == (args.manifest is None):
        raise UserError("give the validation data: --data-path DIR (the extracted split) or --manifest FILE.jsonl")
    if args.condition_type not in conditions.CONDITION_TYPES:
        raise UserError(f"unknown --condition-type {args.condition_type}; use one of {conditions.CONDITION_TYPES}")
    if args.data_path is not None:
        return data.official_samples(args.data_path, args.condition_type, args.condition_is_map)
    return data.manifest_samples(args.manifest, args.condition_type, args.condition_is_map, args.allow_outside_paths)


def demo_split(args):
    """The evaluation demo's data: the first DEMO_SPLIT test scenes of the demo set at the model's size, written once
    under sample/demo_set/ (demo_set.py; scripts/make_synthetic_set.py --scenes writes larger splits)."""
    from fast_inference import demo_set

    margs, size = model_args(args)
    H = args.image_H or args.image_W or size
    root = os.path.join(ROOT, "sample", "demo_set", f"test_{DEMO_SPLIT}_{H}px")
    print(f"demo: {DEMO_SPLIT} test scenes of the demo set in {root}")
    return demo_set.ensure_split(root, DEMO_SPLIT, H, margs.caption_dim)


class BatchReader(torch.utils.data.Dataset):
    """Item k: the samples batch k needs, read (and canny-extracted) in a DataLoader worker."""

    def __init__(self, batches, samples, condition_type, H, W, cls_token_num, text_mode):
        self.batches, self.samples = batches, samples
        self.kw = dict(condition_type=condition_type, H=H, W=W, cls_token_num=cls_token_num, text_mode=text_mode)

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, k):
        items = [data.read_sample(self.samples[p], **self.kw) for p in self.batches[k][1]]
        for item, p in zip(items, self.batches[k][1]):
            item["class_label"] = self.samples[p].class_label
        return items


def as_is(x):
    return x


def one_thread(_):
    torch.set_num_threads(1)


def control_map(item, args, device):
    """(3, H, W) in [-1, 1]: a ready map is rescaled; hed/lineart/depth networks run here, on the
    device, with test_t2i.py's semantics (lineart not inverted)."""
    if item["ready"]:
        return conditions.extract_control(item["source"], args.condition_type, is_map=True)
    return conditions.extract_control(item["source"], args.condition_type, ckpt=args.condition_ckpt, device=device,
                                      invert_lineart=False)


def text_batch(items, rows, text_mode, model, t5, device):
    """The prefix inputs of the B rows: (caption embeddings, mask) or (class labels, None)."""
    from fast_inference.text import check_t5_output, check_values

    if text_mode == "label":
        return torch.tensor([items[r]["class_label"] for r in rows], device=device), None
    T = model.args.cls_token_num
    if text_mode == "t5":
        # All B rows, fillers included: the encoder's numerics may depend on the batch size.
        emb, mask = t5.encode_left_padded([items[r]["prompt"] for r in rows])
        check_t5_output(emb, t5.path)
        return emb[:, :T].to(device), mask[:, :T].to(device)
    emb = torch.cat([items[r]["emb"] for r in rows])
    if emb.shape[-1] != model.args.caption_dim:
        raise UserError(f"caption embeddings have {emb.shape[-1]} features but the model takes caption_dim "
                        f"{model.args.caption_dim}; pass the matching model (--gpt-model) or --t5-path")
    check_values(emb, "the caption embeddings", "run with --precision bf16 or fp32", model.tok_embeddings.weight.dtype)
    return emb.to(device), torch.cat([items[r]["mask"] for r in rows]).to(device)


# ---- generation ---------------------------------------------------------------------------------

@dataclass
class Run:
    """What every batch needs: the settings, the models and the image shape."""
    args: argparse.Namespace
    device: torch.device
    model: torch.nn.Module
    vq: torch.nn.Module
    engine: Optional[Engine]
    t5: object
    text_mode: str  # emb | t5 | label
    H: int
    W: int


def sample_batch(run, items, first, positions):
    """One batch of B rows, seeded by its first position -> images (B, 3, H, W) on the CPU and the
    controls (len(items), 3, H, W). Row r holds position first + r; the other rows repeat a sample."""
    args, B = run.args, run.args.batch
    rows = [positions.index(first + r) if first + r in positions else 0 for r in range(B)]
    controls = torch.stack([control_map(it, args, run.device) for it in items])
    cond, mask = text_batch(items, rows, run.text_mode, run.model, run.t5, run.device)
    num_tokens = (run.H // 16) * (run.W // 16)
    torch.manual_seed(batch_seed(args.seed, first))
    tokens = sample_tokens(run.model, run.engine, cond, mask, controls[rows].to(run.device), num_tokens, args)
    # All B rows decoded: the same shapes in every batch keep a row's pixels independent of the others.
    shape = (B, run.vq.quantize.embedding.weight.shape[1], run.H // 16, run.W // 16)
    return run.vq.decode_code(tokens, shape).float().cpu(), controls


ANNOTATOR_FILES = {"hed": "ControlNetHED.pth", "lineart": "model.pth (lineart)", "depth": "a local Intel/dpt-large folder"}


def check_annotator(args, samples):
    """Before any model loads: controls extracted by a network need its weights."""
    kind = args.condition_type
    if kind in ANNOTATOR_FILES and not all(s.is_map for s in samples):
        if args.condition_ckpt is None or not os.path.exists(args.condition_ckpt):
            raise UserError(f"{kind} controls are extracted from the images: pass --condition-ckpt with "
                            f"{ANNOTATOR_FILES[kind]} (or ready maps with --condition-is-map)")


def image_shape(args, device, dtype):
    margs, image_size = model_args(args)
    H, W = args.image_H or image_size, args.image_W or image_size
    if H <= 0 or W <= 0 or H % 16 or W % 16 or (H // 16) * (W // 16) > margs.block_size:
        raise UserError(f"image size {H}x{W} must be multiples of 16 within the model's grid (--image-size {image_size})")
    run_memory(args, margs, H, W, args.batch, device, dtype, "use a smaller --batch or --image-size")
    check_draft_grid(args, H, W)
    return margs, H, W


def check_eval_args(args):
    """Before any data is listed or model built: every number in range, the input files there, and a writable
    output folder."""
    check_ranges(args)
    check_ranges(args, EVAL_RANGES)
    check_speculative(args, engine=args.engine, backend=args.backend, compile_scope=args.compile_scope)
    for flag in ("gpt_ckpt", "vq_ckpt", "condition_ckpt", "t5_path"):
        path = getattr(args, flag)
        if path is not None and not os.path.exists(path):
            raise UserError(f"--{flag.replace('_', '-')} {path} not found")
    if os.path.exists(args.sample_dir) and not os.path.isdir(args.sample_dir):
        raise UserError(f"--sample-dir {args.sample_dir} is a file; give a folder")
    check_writable(os.path.join(args.sample_dir, "settings.json"))


def build_run(args, device, dtype, backend, text_mode, H, W):
    pipe = Pipeline(PipelineConfig.from_args(args), spell=flag_name)  # random weights: the same in every run (--seed)
    model, vq, engine = pipe.model, pipe.vq, pipe.engine_for(SamplingParams.from_args(args))
    if engine is not None:  # the drafts the plan picks at --batch for every batch of the run, its last one too
        engine.pin_drafts(args.batch, args.cfg_scale > 1.0, args.top_p)
    t5 = None
    if text_mode == "t5":
        from fast_inference.text import T5Encoder

        t5 = T5Encoder(args.t5_path, device=device, dtype=dtype)  # in the run's precision, as test_t2i.py
    return Run(args, device, model, vq, engine, t5, text_mode, H, W)


def generate_split(args, held):
    """Generate this rank's share of [start, end); returns the names of the whole range. The folder stays this
    job's until `held` (an ExitStack) closes."""
    rank, world, local_rank = dist_env()
    if world > 1 and args.device in (None, "cuda") and torch.cuda.is_available():
        args.device = f"cuda:{local_rank}"
        torch.cuda.set_device(args.device)
    check_eval_args(args)
    device, dtype, backend = pick_device(args)
    margs, H, W = image_shape(args, device, dtype)
    samples = load_samples(args)
    text_mode = "label" if margs.model_type == "c2i" else "t5" if args.t5_path else "emb"
    data.check_text(samples, text_mode, margs.num_classes)
    check_annotator(args, samples)
    overrides = dict(plans.environment_overrides() + plans.parse_overrides(args.plan))  # they can change the images
    overrides = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    end = len(samples) if args.end is None else min(args.end, len(samples))
    if not 0 <= args.start < end:
        raise UserError(f"--start {args.start} --end {args.end} selects nothing of the {len(samples)} samples")
    resolved = dict(precision=str(dtype).replace("torch.", ""), device_type=device.type,
                    backend=backend if args.engine == "fast" else None,
                    compile_scope=args.compile_scope if (args.engine, backend) == ("fast", "inductor") else None,
                    # only when on: settings.json files written before the flags existed still match
                    **({"quantize": args.quantize} if args.quantize != "none" else {}),
                    **({"plan": overrides} if overrides and args.engine == "fast" else {}))
    # The folder becomes this job's: rank 0 locks it (until `held` closes), hashes the files and checks the settings;
    # the other ranks write nothing before that.
    job = job_id(world)
    if rank == 0:
        fd = lock_sample_dir(args.sample_dir, job)
        held.callback(os.close, fd)
        settings = output_settings(args, margs, resolved)
        check_settings(args.sample_dir, settings)
        write_record(fd, job, checked=True)
    else:
        wait_for_lock(args.sample_dir, job)
    mine = shard(args.start, end, args.batch, rank, world)
    batches = [(first, [p for p in positions if not finished(args.sample_dir, samples[p].name)])
               for first, positions in mine]
    batches = [b for b in batches if b[1]]
    todo = sum(len(b[1]) for b in batches)
    done = sum(len(b[1]) for b in mine) - todo
    names = [s.name for s in samples[args.start:end]]
    start_fields = dict(host=socket.gethostname(), pid=os.getpid(), rank=rank, world_size=world, device=str(device),
                        todo=todo, done_before=done, settings=vars(args))
    if not batches:
        print(f"rank {rank}: all {done} samples of its share of [{args.start}, {end}) are done in {args.sample_dir}")
        runlog = RunLog(args.sample_dir, rank, args.start, end)
        runlog.write("start", **start_fields)
        runlog.write("done", images=0, seconds=0.0)
        return names, rank, world

    # Workers start now (they never touch the GPU) and read ahead while the model loads.
    reader = BatchReader(batches, samples, args.condition_type, H, W, margs.cls_token_num, text_mode)
    workers = min(args.num_workers, len(batches))
    loader = iter(torch.utils.data.DataLoader(reader, batch_size=None, collate_fn=as_is, num_workers=workers,
                                              worker_init_fn=one_thread if workers else None,
                                              prefetch_factor=2 if workers else None))
    run = build_run(args, device, dtype, backend, text_mode, H, W)
    # The models loaded: the run starts now, and only now the folder is marked as made with these settings.
    if rank == 0:
        write_settings(args.sample_dir, settings)
    for d in ("visualization", "annotations", ".tmp"):
        os.makedirs(os.path.join(args.sample_dir, d), exist_ok=True)
    runlog = RunLog(args.sample_dir, rank, args.start, end)
    runlog.write("start", **start_fields)
    print(f"rank {rank}/{world}: {todo} images to make in {len(batches)} batches of {args.batch} ({done} done before) "
          f"| {args.engine} engine{'' if run.engine is None else ' (' + backend + ')'} | "
          f"{str(dtype).replace('torch.', '')} on {device} | {H}x{W} -> {args.sample_dir}")

    saver = ThreadPoolExecutor(1)  # PNG encoding overlaps the next batch
    pending = None
    passes = tokens = 0  # speculative passes of this rank's images, and the tokens they accepted
    t_run = time.perf_counter()
    with tqdm(total=todo, unit="img", desc=f"rank {rank}", position=rank, dynamic_ncols=True) as bar:
        for first, positions in batches:
            t0 = time.perf_counter()
            items = next(loader)
            errors = [it["error"] for it in items if "error" in it]
            if errors:
                raise UserError(errors[0])
            t_data = time.perf_counter() - t0
            images, controls = sample_batch(run, items, first, positions)
            t_gen = time.perf_counter() - t0 - t_data
            if pending is not None:
                pending.result()
            batch_names = [samples[p].name for p in positions]
            pending = saver.submit(save_batch, args.sample_dir, batch_names, [p - first for p in positions], images,
                                   controls, [it["annotation"] for it in items])
            bar.update(len(positions))
            runlog.write("batch", first=first, names=batch_names, data_s=round(t_data, 4), generate_s=round(t_gen, 4),
                         images_per_s=round(len(positions) / (time.perf_counter() - t0), 3),
                         engine=run.engine and run.engine.last_timings,
                         speculative=run.engine and run.engine.last_speculation or None,
                         compile_s=run.engine and round(run.engine.compile_seconds, 3))
            if run.engine is not None and run.engine.last_speculation:  # the rows of this batch's positions
                passes += sum(run.engine.last_speculation["passes"][p - first] for p in positions)
                tokens += len(positions) * ((run.H // 16) * (run.W // 16) - 1)  # the first from the prefill
    if pending is not None:
        pending.result()
    saver.shutdown()
    seconds = time.perf_counter() - t_run
    runlog.write("done", images=todo, seconds=round(seconds, 3), images_per_s=round(todo / seconds, 3))
    spec = f"; {passes / todo:.0f} passes per image, {tokens / passes:.2f} tokens per pass" if passes else ""
    print(f"rank {rank}: {todo} images in {seconds:.1f}s ({todo / seconds:.2f} images/s){spec}")
    return names, rank, world


def wait_for_ranks(sample_dir, names, poll=10.0):
    """Rank 0 under torchrun: it holds the folder's lock, and the metrics need every rank's outputs, until the
    other ranks are done (torchrun stops us if one fails)."""
    while True:
        missing = sum(not finished(sample_dir, n) for n in names)
        if not missing:
            return
        print(f"rank 0: waiting for {missing} images from the other ranks")
        time.sleep(poll)


def run_metrics(args):
    device = pick_device(args)[0]
    fid_ref = args.fid_ref or (os.path.join(args.data_path, "image") if args.data_path else None)
    metrics.evaluate(args.sample_dir, args.condition_type, device, args.condition_ckpt, args.pred_dir,
                     args.seg_dataset, fid_ref, keep_measured=True)


def user_mistake(e):
    if isinstance(e, torch.cuda.OutOfMemoryError):
        e.args = ("CUDA out of memory; use a smaller --batch",)
        return True
    return isinstance(e, data.DataError) or is_user_error(e)


def metrics_only(args):
    """--metrics-only: the metrics of a folder of this --condition-type (its settings.json), no run writing it."""
    made = read_json(os.path.join(args.sample_dir, "settings.json")).get("condition_type")
    if made not in (None, args.condition_type):
        raise UserError(f"--condition-type {args.condition_type} but {args.sample_dir} holds {made} samples (its "
                        f"settings.json); pass --condition-type {made}")
    with contextlib.ExitStack() as held:
        if os.path.isdir(args.sample_dir):  # a missing folder: run_metrics says so
            held.callback(os.close, lock_sample_dir(args.sample_dir, job_id(1)))
        run_metrics(args)


def run(args):
    if args.metrics_only:
        return metrics_only(args)
    with contextlib.ExitStack() as held:
        names, rank, world = generate_split(args, held)
        if rank != 0:
            return
        if world > 1:  # the folder stays locked until every rank of the job is done
            wait_for_ranks(args.sample_dir, names)
        if args.metrics:
            run_metrics(args)


def main(argv=None):
    args = parse_args(argv)
    cli_main(lambda: run(args), args.debug, user_mistake)


if __name__ == "__main__":
    main()
