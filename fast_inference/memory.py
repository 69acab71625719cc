"""The bytes a run holds at its peak, counted from its shapes before anything is built, and what the device (and the
process's own limits: ulimit -v, a cgroup) can still give. Every count is a lower bound of what the tools hold
(tests/test_memory.py measures them on the CPU), so a refusal is never a false alarm; figures in docs/PERF_NOTES.md
("Memory: what a run holds at batch 128").

A run's peak is the larger of two moments: the transformer as built (float32, before its cast), and later the model in
its dtype with the KV caches, the VQ decoder's weights, and either a speculative pass's (images, window, vocabulary)
tensors or the VQ decoding of one chunk of images (vq.VQModel.decode_code) beside every image's pixels.
"""
import os
import resource
from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True)
class Shapes:
    """What a run's memory depends on: images (rows / 2 under CFG) of H x W, the KV caches' dtype, int8 weights, a
    speculative pass's window (0: none) and draft coupling, and the images decoded by the VQ in this run."""
    H: int
    W: int
    images: int
    cfg: bool
    dtype: torch.dtype
    int8: bool = False
    window: int = 0
    coupling: str = "gumbel"
    decoded: int = 0


def meta_tensors(module):
    return [*module.parameters(), *module.buffers()]


def built_bytes(tensors):
    """Bytes of tensors as built (their own dtypes: float32 for a model before its cast)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def cast_bytes(tensors, dtype, int8=False):
    """Bytes of tensors after the model's cast to dtype (int8 weights: at least one byte each)."""
    size = 1 if int8 else torch.finfo(dtype).bits // 8
    return sum(t.numel() * (size if t.is_floating_point() else t.element_size()) for t in tensors)


def transformer_tensors(margs):
    """The transformer's parameters and buffers, built on the meta device: shapes only, nothing allocated."""
    from fast_inference.model import Transformer

    with torch.device("meta"):
        return meta_tensors(Transformer(margs))


def kv_bytes(margs, rows, num_tokens, dtype):
    """The KV caches of rows sequences of the prefix and num_tokens image tokens (model.setup_caches: rounded to 8)."""
    seq = -(-(margs.prefix_len + num_tokens) // 8) * 8
    return margs.n_layer * 2 * rows * margs.n_head * seq * margs.head_dim * (torch.finfo(dtype).bits // 8)


def pass_bytes(images, window, vocab, cfg, coupling):
    """A speculative pass's (images, window, vocabulary) tensors held at once (speculative.py): its drafts'
    distributions q and the pass's p (float32), with either the head's float32 logits of every row or the draws'
    noise (coupled, gumbel or pathwise: position_noise's int64 keys beside their float32 noise; fresh: float32)."""
    n = images * window * vocab
    logits = 4 * (2 if cfg else 1)
    noise = 12 if coupling in ("gumbel", "pathwise") else 4
    return n * (8 + max(logits, noise))


def vq_decode_bytes(vq_cfg, images, H, W):
    """The VQ decoding of `images` images (float32, vq.VQModel.decode_code): one chunk's two full-resolution maps of
    the decoder's last level, and every image's pixels."""
    from fast_inference.vq import VQModel

    if images == 0:
        return 0
    chunk = min(images, VQModel.images_per_chunk(H, W))
    return 4 * H * W * (2 * chunk * vq_cfg.ch + images * vq_cfg.out_channels)


def needed(margs, vq_cfg, s: Shapes):
    """A lower bound of the bytes a run of these shapes holds at its peak (the module's docstring)."""
    from fast_inference.vq import VQModel

    gpt = transformer_tensors(margs)
    with torch.device("meta"):
        vq = built_bytes(meta_tensors(VQModel(vq_cfg)))
    num_tokens = (s.H // 16) * (s.W // 16)
    rows = s.images * (2 if s.cfg else 1)
    passes = pass_bytes(s.images, s.window, margs.vocab_size, s.cfg, s.coupling) if s.window else 0
    running = (cast_bytes(gpt, s.dtype, s.int8) + kv_bytes(margs, rows, num_tokens, s.dtype) + vq
               + max(passes, vq_decode_bytes(vq_cfg, s.decoded, s.H, s.W)))
    return max(built_bytes(gpt), running)


# ---- what the device can give ---------------------------------------------------------------------------------


def available(device):
    """(bytes this run may still take or None when unknown, how that reads in a message): the GPU's free memory; on
    the CPU the least of the host's MemAvailable + SwapFree and what the process's limits leave."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free, f"{device} has {free / GiB:.1f} GiB free"
    room = [(host_free(), f"{device} has {{}} GiB free"),
            (limit_left(resource.RLIMIT_AS, "VmSize"), "the process's address-space limit (ulimit -v) leaves {} GiB"),
            (limit_left(resource.RLIMIT_DATA, "VmData"), "the process's data limit (ulimit -d) leaves {} GiB"),
            (cgroup_left(), "its cgroup's memory limit (memory.max) leaves {} GiB")]
    room = [(b, words) for b, words in room if b is not None]
    if not room:
        return None, ""
    b, words = min(room, key=lambda r: r[0])
    return b, words.format(f"{b / GiB:.1f}")


def host_free():
    info = proc_fields("/proc/meminfo")
    return info["MemAvailable"] + info.get("SwapFree", 0) if "MemAvailable" in info else None


def proc_fields(path):
    """{"Name": bytes} of a /proc file of "Name:   N kB" lines ({} when unreadable)."""
    try:
        with open(path) as f:
            lines = [line.split() for line in f]
    except OSError:
        return {}
    return {p[0].rstrip(":"): int(p[1]) * 1024 for p in lines if len(p) == 3 and p[2] == "kB" and p[1].isdigit()}


def limit_left(which, field):
    """What a resource limit (RLIMIT_AS: VmSize, RLIMIT_DATA: VmData) leaves this process, or None without one."""
    soft = resource.getrlimit(which)[0]
    used = proc_fields("/proc/self/status").get(field)
    if soft == resource.RLIM_INFINITY or used is None:
        return None
    return max(soft - used, 0)


def cgroup_left():
    """The least that memory.max - memory.current leaves in this process's cgroup and those above it (cgroup v2), or
    None without a limit."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.strip().split(":", 2)[2] for line in f if line.startswith("0::"))
    except (OSError, StopIteration, IndexError):
        return None
    left, folder = None, os.path.join("/sys/fs/cgroup", path.lstrip("/"))
    while folder.startswith("/sys/fs/cgroup"):
        limit = read_number(os.path.join(folder, "memory.max"))
        used = read_number(os.path.join(folder, "memory.current"))
        if limit is not None and used is not None:
            left = limit - used if left is None else min(left, limit - used)
        if folder == "/sys/fs/cgroup":
            break
        folder = os.path.dirname(folder)
    return None if left is None else max(left, 0)


def read_number(path):
    """An integer file of a cgroup (None: unreadable, or "max")."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
