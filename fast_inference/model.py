"""The ControlAR transformer: LlamaGen's GPT plus the ControlAR control path, t2i and c2i. Plain torch.

One definition serves the reference sampler and the fast engine. State-dict keys are the official
ones (see tests/data/manifest_*.json), so official checkpoints load unchanged. Nothing from a
previous call lives on the module: control tokens, positions and masks are arguments; only the KV
cache is a buffer, written in place at the positions it is given. The fast engine changes how the blocks
run through one small `Context` (its kernels for the attention, a block, the element-wise ops), never what
they compute; the model imports none of them.
"""
import json
import math
import os
from dataclasses import dataclass, fields
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

NUM_CONTROL_LISTS = 3  # condition_layers has three MLPs in every official checkpoint


@dataclass
class ModelArgs:
    # Field names follow the official ModelArgs so a JSON of official arguments loads as is.
    dim: int = 4096
    n_layer: int = 32
    n_head: int = 32
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    block_size: int = 256  # image tokens of the grid RoPE is laid on (a perfect square)
    cls_token_num: int = 120
    caption_dim: int = 2048
    num_classes: int = 1000
    condition_token_num: int = 0  # c2i only; the official scripts use 0
    model_type: str = "t2i"  # t2i | c2i
    adapter_size: str = "small"  # DINOv2 small | base (t2i)
    condition_type: str = "canny"  # decides the adapter's resize mode (nearest for canny/seg)
    pos_interp: str = "v444"  # DINOv2 position-table interpolation: v444 (default) | v445
    class_dropout_prob: float = 0.1  # training only; accepted for compatibility

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.n_kv_head != self.n_head:
            raise ValueError("n_kv_head != n_head is not used by any ControlAR model")
        if self.model_type not in ("t2i", "c2i"):
            raise ValueError(f"model_type must be t2i or c2i, got {self.model_type!r}")
        # Sizes checked here, up front: a config that fails them would fail deep inside the model.
        for name in ("dim", "n_layer", "n_head", "multiple_of", "vocab_size", "block_size", "cls_token_num",
                     "caption_dim", "num_classes", "condition_token_num"):
            value, low = getattr(self, name), 0 if name == "condition_token_num" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("rope_base", "norm_eps", "ffn_dim_multiplier"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (int, float)) or not 0 < value < math.inf):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if self.dim % self.n_head or (self.dim // self.n_head) % 4:
            raise ValueError(f"dim {self.dim} must split into n_head {self.n_head} heads of a multiple of 4 "
                             "(2-D RoPE turns a quarter of each head per axis); e.g. 64 per head")
        if self.adapter_size not in ("small", "base", "tiny"):
            raise ValueError(f"adapter_size must be small, base or tiny (the demo model's), got {self.adapter_size!r}")
        if self.pos_interp not in ("v444", "v445"):
            raise ValueError(f"pos_interp must be v444 or v445, got {self.pos_interp!r}")
        if math.isqrt(self.block_size) ** 2 != self.block_size:
            raise ValueError(f"block_size must be a perfect square, got {self.block_size}")

    @property
    def head_dim(self):
        return self.dim // self.n_head

    @property
    def ffn_hidden(self):
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)

    @property
    def layer_internal(self):
        # Official: n_layer // 3, which is 0 (a crash) below three layers; inject before every block then.
        return max(1, self.n_layer // 3)

    @property
    def prefix_len(self):
        # Positions before the first image token; their RoPE rows are zero (a LlamaGen quirk).
        return self.cls_token_num + (self.condition_token_num if self.model_type == "c2i" else 0)

    @classmethod
    def read_json(cls, path):
        """The ModelArgs fields of a JSON file (training-only official fields dropped); one-line errors."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model config {path} not found")
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(config, dict):
            raise ValueError(f'{path} must hold a JSON object of model arguments, e.g. {{"n_layer": 3}}')
        known = {f.name for f in fields(cls)}
        # Training-only fields of the official ModelArgs: accepted, irrelevant at inference.
        config = {k: v for k, v in config.items() if k not in TRAINING_ONLY}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"{path}: unknown model argument(s) {unknown}; use the official ModelArgs field "
                             f"names: {', '.join(sorted(known))}")
        return config

    @classmethod
    def from_name(cls, name, **overrides):
        """A name of the official table or a path to a JSON of ModelArgs fields; overrides win."""
        if name.endswith(".json"):
            config = cls.read_json(name)
        elif name in GPT_CONFIGS:
            config = dict(GPT_CONFIGS[name])
        else:
            raise ValueError(f"unknown model {name!r}; use one of {sorted(GPT_CONFIGS)} or a .json of model arguments")
        config.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**config)


TRAINING_ONLY = {"initializer_range", "token_dropout_p", "attn_dropout_p", "resid_dropout_p", "ffn_dropout_p",
                 "drop_path_rate", "max_batch_size", "max_seq_len"}

# Official constructor names -> (n_layer, n_head, dim).
GPT_CONFIGS = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-XXXL": dict(n_layer=48, n_head=40, dim=2560),
    "GPT-1B": dict(n_layer=22, n_head=32, dim=2048),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
    "GPT-7B": dict(n_layer=32, n_head=32, dim=4096),
}


@dataclass(frozen=True)
class EagerOps:
    """Kernels that stand in for the eager blocks' element-wise torch ops, each in the same roundings (None: torch's):
    rms_norm(x, weight, eps, delta=None) -> y, or (x + delta, y) with delta; silu_mul(gate_up) -> SiLU(gate) * up;
    rope_and_cache(q, k, v, freqs, cache, input_pos) -> as the function of that name below."""
    rms_norm: Optional[Callable] = None
    silu_mul: Optional[Callable] = None
    rope_and_cache: Optional[Callable] = None


TORCH_OPS = EagerOps()


@dataclass(frozen=True)
class Context:
    """How the blocks run; the defaults are plain torch, the reference's. The fast engine's plan fills it.
    ops: the eager blocks' element-wise kernels. attention: a decode attention kernel for one-token steps,
    attention(q, k_cache, v_cache, key_valid, input_pos, fresh=(k, v, freqs) or None, text=cache.text) that reads only
    the filled cache and does rope_and_cache's work itself (fresh None: q is rotated and the step's key and value are
    in the cache). block: runs a block in place of the layer, block(layer, x, freqs, attend, input_pos[, control=]);
    block_adds_control: it adds the next block's control rows itself. kv_len: SDPA reads the first kv_len cache
    positions only. inputs: step_inputs(input_pos, controls) made ahead, a control row already added into x None.
    rows: the cache rows the batch's rows are (a request's prefill inside a server's batch, continuous.py), None for
    the first B; torch's RoPE and SDPA only. window: (seqlens (B,), masks (B, S) int64) for rows at their own
    positions (input_pos (B, S)): each row's filled keys before its S queries and the queries' bitmasks of the window's
    keys, window key m at cache slot seqlens + m (window_slots: a draft tree's rows, draft_tree.py, share positions
    but not slots); the rows' keys are written there, and attention is a window kernel, attention(q, k_cache, v_cache,
    key_valid, seqlens, masks, text=) after the ops' RoPE and cache write (attention_triton.window_attention), or
    without one SDPA with window_mask."""
    ops: EagerOps = TORCH_OPS
    attention: Optional[Callable] = None
    block: Optional[Callable] = None
    block_adds_control: bool = False
    kv_len: Optional[int] = None
    inputs: Optional[tuple] = None
    rows: Optional[torch.Tensor] = None
    window: Optional[tuple] = None


REFERENCE = Context()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # Statistics in float32, cast back, THEN scale (the order changes bf16 results). Eager, PyTorch's
        # fused kernel does the first part (two kernels instead of eight per norm: the backends without a
        # compiler are launch-bound); inductor would call that kernel as is, so compiled code spells it out
        # for inductor to fuse with its neighbours.
        if not torch.compiler.is_compiling():
            return F.rms_norm(x, x.shape[-1:], eps=self.eps) * self.weight
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rms_norm(ops, norm, x, delta=None):
    """norm(x), or with delta the residual add before it, (x + delta, norm(x + delta)): one kernel where ops has one
    (for contiguous tensors, its layout)."""
    if ops.rms_norm is not None and x.is_contiguous() and (delta is None or delta.is_contiguous()):
        return ops.rms_norm(x, norm.weight, norm.eps, delta)
    if delta is None:
        return norm(x)
    h = x + delta
    return h, norm(h)


class Int8Linear(nn.Module):
    """A bias-free Linear whose weight is int8 with one scale per output row (quantize.py makes them)."""

    def __init__(self, weight, scales):
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales)

    def forward(self, x):
        return int8_linear(x, self.weight, self.scales)


def int8_linear(x, weight, scales):
    # As gpt-fast's int8 mode: the product rounded to x's dtype, then times the row scales (rounded again).
    return F.linear(x, weight.to(x.dtype)) * scales


class MLP(nn.Module):
    """Linear -> tanh-GELU -> Linear, no biases (the official MLP used by every embedder)."""

    def __init__(self, in_features, hidden_features, out_features):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """t2i prefix: T5 caption embeddings -> model width; the learned null caption for CFG."""

    def __init__(self, caption_dim, dim, uncond_len=120):
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim)
        # The official class always builds 120 rows, whatever cls_token_num is.
        self.register_buffer("uncond_embedding", torch.randn(uncond_len, caption_dim) / caption_dim**0.5)

    def forward(self, caption):
        return self.cap_proj(caption)

    def null(self, batch, length):
        if self.uncond_embedding.shape[0] < length:
            raise ValueError(f"CFG needs {length} null-caption rows, the model has {self.uncond_embedding.shape[0]}")
        return self.uncond_embedding[:length].unsqueeze(0).expand(batch, -1, -1)


class LabelEmbedder(nn.Module):
    """c2i prefix: class label -> one token; label num_classes is the null class for CFG."""

    def __init__(self, num_classes, dim):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels):
        return self.embedding_table(labels).unsqueeze(1)


class ConditionEmbedder(nn.Module):
    """Projects adapter features to control tokens; its zero buffer is a training leftover."""

    def __init__(self, block_size, dim):
        super().__init__()
        self.cap_proj = MLP(dim, dim, dim)
        # Unused at inference, but in every checkpoint; its rows reveal the training block_size.
        self.register_buffer("uncond_embedding", torch.zeros(block_size, dim))

    def forward(self, x):
        return self.cap_proj(x)


class FeedForward(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.register_buffer("w13", None, persistent=False)
        self.register_buffer("w13_scales", None, persistent=False)  # int8 w13 (quantize.py)

    def fuse(self):
        """One GEMM for gate and up: w1 and w3 become views of one (2F, D) weight (same keys).
        Call it after loading and casting: a later .to() would un-share the views."""
        w13 = torch.cat([self.w1.weight.data, self.w3.weight.data])
        self.w1.weight.data, self.w3.weight.data = w13.chunk(2)
        self.w13 = w13

    def gated(self, x, ops=TORCH_OPS):
        """SiLU(w1 x) * w3 x: what w2 reads."""
        if self.w13 is None:
            return F.silu(self.w1(x)) * self.w3(x)
        w13 = F.linear(x, self.w13) if self.w13_scales is None else int8_linear(x, self.w13, self.w13_scales)
        if ops.silu_mul is not None:
            return ops.silu_mul(w13)
        gate, up = w13.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x, ops=TORCH_OPS):
        return self.w2(self.gated(x, ops))


class KVCache(nn.Module):
    """Static cache of keys (after RoPE) and values, written in place by absolute position."""

    def __init__(self, max_batch, n_head, max_seq, head_dim, dtype):
        super().__init__()
        shape = (max_batch, n_head, max_seq, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype), persistent=False)
        # A decode attention kernel's text partial, (sums, counts, T): the prefix's first T keys (zero: RoPE's zero
        # rows) as one partial, their values' sum and count (the engine's, after each prefill); None: it reads them
        self.text = None

    def update(self, input_pos, k, v, rows=None):
        """k and v (B, H, S, hd) written at input_pos: (S,) for every row, or (B, S) a row's own (rows at different
        positions: speculative passes). A step may run on the first rows only (CFG switched off by cfg_interval).
        rows (B,): the cache rows to write instead (a request's prefill inside a server's batch); their copies are
        returned."""
        if rows is not None:
            self.k_cache[rows[:, None], :, input_pos] = k.transpose(1, 2)
            self.v_cache[rows[:, None], :, input_pos] = v.transpose(1, 2)
            return self.k_cache[rows], self.v_cache[rows]
        k_cache, v_cache = self.k_cache[: k.shape[0]], self.v_cache[: k.shape[0]]
        if input_pos.dim() == 1:
            k_cache.index_copy_(2, input_pos, k)
            v_cache.index_copy_(2, input_pos, v)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None]
            k_cache[rows, :, input_pos] = k.transpose(1, 2)
            v_cache[rows, :, input_pos] = v.transpose(1, 2)
        return k_cache, v_cache


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_head, self.head_dim = args.n_head, args.head_dim
        self.wqkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)
        self.kv_cache = None

    def forward(self, x, freqs, attend):
        B, S, D = x.shape
        q, k, v = (t.view(B, S, self.n_head, self.head_dim) for t in self.wqkv(x).split(D, dim=-1))
        # RoPE on q and k and the cache write are attend's (rope_and_cache), so a kernel may fuse them
        y = attend(q, k, v, freqs, self.kv_cache)
        return self.wo(y.transpose(1, 2).reshape(B, S, D))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x, freqs, attend, ops=TORCH_OPS, down=None, delta=None, defer=False):
        """ops: the element-wise kernels (EagerOps). down(a, w2, h): h + w2(a) in one kernel (the fast engine's
        compiled block at one-token steps). delta: the block before's feed-forward output, its residual add done here
        with the first norm (one kernel where ops has the norm); defer: return (h, the feed-forward output) for the
        next block to add."""
        x, n = (x, rms_norm(ops, self.attention_norm, x)) if delta is None else \
            rms_norm(ops, self.attention_norm, x, delta)
        h, y = rms_norm(ops, self.ffn_norm, x, self.attention(n, freqs, attend))
        if defer:
            return h, self.feed_forward(y, ops)
        if down is None:
            return h + self.feed_forward(y, ops)
        return down(self.feed_forward.gated(y, ops), self.feed_forward.w2, h)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        D = args.dim
        if args.model_type == "t2i":
            from fast_inference.dinov2 import Dinov2Adapter

            self.cls_embedding = CaptionEmbedder(args.caption_dim, D)
            self.adapter = Dinov2Adapter(args.adapter_size, args.condition_type, args.pos_interp)
        else:
            from fast_inference.vit import ViTAdapter

            self.cls_embedding = LabelEmbedder(args.num_classes, D)
            self.adapter = ViTAdapter()
        self.adapter_mlp = MLP(self.adapter.out_dim, D, D)
        self.tok_embeddings = nn.Embedding(args.vocab_size, D)
        self.condition_embeddings = nn.Embedding(args.vocab_size, D)  # unused at inference
        self.condition_mlp = ConditionEmbedder(args.block_size, D)
        self.condition_layers = nn.ModuleList(MLP(D, D, D) for _ in range(NUM_CONTROL_LISTS))
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(D, args.norm_eps)
        if args.model_type == "c2i":
            self.condition_norm = RMSNorm(D, args.norm_eps)  # in c2i checkpoints, never used
        self.output = nn.Linear(D, args.vocab_size, bias=False)
        self.register_buffer("freqs_cis", rope_table(args), persistent=False)
        self.max_batch = self.max_seq = -1

    # ---- caches -------------------------------------------------------------------------------

    def setup_caches(self, max_batch, max_seq, dtype, spare=0):
        """(Re)allocate the KV caches; a no-op when the shape and dtype are already right. The RoPE table is
        float32 whatever the model's dtype: made again if a .to(dtype) cast it, as the official setup_caches
        rebuilds it. spare: cache slots past max_seq, which no position reaches (a draft tree's rows, draft_tree.py)."""
        if self.freqs_cis.dtype != torch.float32:
            self.freqs_cis = precompute_freqs_cis_2d(self.args).to(self.freqs_cis.device)
        if max_seq > self.freqs_cis.shape[0]:
            # More tokens than the RoPE grid of block_size has cells.
            raise ValueError(f"{max_seq - self.args.prefix_len} image tokens exceed block_size {self.args.block_size}")
        max_seq = (max_seq + spare + 7) // 8 * 8
        cache = self.layers[0].attention.kv_cache
        if cache is not None and (self.max_batch, self.max_seq, cache.k_cache.dtype) == (max_batch, max_seq, dtype):
            return
        self.max_batch, self.max_seq = max_batch, max_seq
        device = self.output.weight.device
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch, self.args.n_head, max_seq, self.args.head_dim, dtype).to(device)

    def clear_caches(self):
        for layer in self.layers:
            layer.attention.kv_cache = None
        self.max_batch = self.max_seq = -1

    # ---- conditioning -------------------------------------------------------------------------

    def encode_control(self, condition, condition_type=None):
        """Control image (B,3,H,W) in [-1,1] -> adapter features (B, Nc, D). condition_type: the resize mode's type
        (t2i's DINOv2), if not the model's (a server's requests each name theirs)."""
        dtype = self.adapter_mlp.fc1.weight.dtype
        return self.adapter_mlp(self.adapter(condition.to(dtype), condition_type))

    def control_tokens(self, features, strength=1.0):
        """Adapter features -> the three control lists (3, B, Nc, D), scaled by control_strength."""
        c = self.condition_mlp(features)
        controls = torch.stack([layer(c) for layer in self.condition_layers])
        return controls if strength == 1.0 else controls * strength

    def prefix_embeddings(self, cond):
        """Caption embeddings (B,T,caption_dim) or class labels (B,) -> the prefix (B,T',D)."""
        if self.args.model_type == "c2i":
            return self.cls_embedding(cond)[:, : self.args.cls_token_num]
        dtype = self.tok_embeddings.weight.dtype
        return self.cls_embedding(cond.to(dtype))[:, : self.args.cls_token_num]

    def null_condition(self, cond):
        """The unconditional counterpart of cond for classifier-free guidance."""
        if self.args.model_type == "c2i":
            return torch.full_like(cond, self.args.num_classes)
        return self.cls_embedding.null(cond.shape[0], cond.shape[1]).to(cond.dtype)

    # ---- forward ------------------------------------------------------------------------------

    def fuse_projections(self):
        """Fuse gate/up projections for inference; state-dict keys and values are unchanged."""
        for layer in self.layers:
            layer.feed_forward.fuse()

    def step_inputs(self, input_pos, controls):
        """What the blocks read at input_pos, (S,) or (B, S) per row, besides x: the RoPE rows ([B,] S, hd/2, 2) and
        the control rows added before blocks 0, L, 2L (3, B, S, D; None without controls). The control token added at
        position p is number p - cls_token_num + 1 (zero where there is none), so token j is added where
        image token j is predicted (only the last prefix position during the prefill)."""
        freqs = self.freqs_cis[input_pos]
        if controls is None:
            return freqs, None
        idx = input_pos - self.args.cls_token_num + 1
        present = ((idx >= 0) & (idx < controls.shape[2])).to(controls.dtype)
        at = idx.clamp(0, controls.shape[2] - 1)
        if input_pos.dim() == 1:
            return freqs, controls[:, :, at] * present[None, None, :, None]
        rows = torch.arange(at.shape[0], device=at.device)[:, None]
        return freqs, controls[:, rows, at] * present[None, :, :, None]

    def forward(self, x, input_pos, key_valid, controls=None, last_only=False, ctx=REFERENCE):
        """Float32 logits of the blocks over embeddings x (B,S,D) at absolute positions input_pos (S,), of the last
        position only if last_only (the only one sampling uses). key_valid (B, max_seq) bool: which cache positions a
        query may see besides itself (the text mask for the prefix, True elsewhere). controls (3, B, Nc, D): the
        control lists (step_inputs picks the rows). ctx: how the blocks run (the fast engine's Context). A model
        without caches (none set up, or clear_caches) runs the whole sequence at once and stores nothing: training's
        forward, with autograd."""
        return self.logits(self.blocks(x, input_pos, key_valid, controls, last_only, ctx), ctx.ops)

    def blocks(self, x, input_pos, key_valid, controls=None, last_only=False, ctx=REFERENCE):
        """The last block's output (B, S or 1, D): forward without the head."""
        freqs, picked = self.step_inputs(input_pos, controls) if ctx.inputs is None else ctx.inputs
        ops = ctx.ops
        where = input_pos  # where a Context.block writes the rows' keys and values
        if ctx.attention is not None and ctx.window is not None:
            rot = rotations(freqs) if ops.rope_and_cache is None else None
            # the window's slots; past the cache (a chain's rows past the image: outputs unused) its last slot
            slots = where = window_slots(*ctx.window).clamp(max=key_valid.shape[1] - 1)

            def attend(q, k, v, freqs, cache):
                # each row's keys and values written at its window slots, then its queries against its filled keys
                # and the window's, as the window's masks say; k None: q rotated and the keys written (the fused
                # block's QKV kernel)
                if k is None:
                    q = q.transpose(1, 2)
                elif rot is None:
                    q, _, _ = ops.rope_and_cache(q, k, v, freqs, cache, slots)
                else:
                    q, _, _ = rope_and_cache(q, k, v, rot, cache, slots)
                return ctx.attention(q, cache.k_cache, cache.v_cache, key_valid, *ctx.window, text=cache.text)
        elif ctx.attention is not None and x.shape[1] == 1:
            def attend(q, k, v, freqs, cache):
                # The kernel rotates q and k and writes k and v; k None: q is rotated and the step's key
                # and value are in the cache already (the fused block's QKV kernel).
                fresh = None if k is None else (k.transpose(1, 2), v.transpose(1, 2), freqs)
                return ctx.attention(q.transpose(1, 2), cache.k_cache, cache.v_cache, key_valid, input_pos,
                                     fresh=fresh, text=cache.text)
        else:
            # Made once for all blocks: the mask as SDPA's additive form (else each block converts it), and the
            # rotations of the RoPE rows (three kernels per apply_rotary_emb instead of nine) unless a kernel rotates
            n = key_valid.shape[1] if ctx.kv_len is None else ctx.kv_len
            if ctx.window is None:
                mask, slots = attention_mask(key_valid[:, :n], input_pos), input_pos
            else:  # a draft tree's rows: their own cache slots and ancestry
                mask, slots = window_mask(key_valid[:, :n], *ctx.window), window_slots(*ctx.window)
            bias = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill_(~mask, float("-inf"))
            rot = rotations(freqs) if ops.rope_and_cache is None else None

            def attend(q, k, v, freqs, cache):
                if k is None:  # q rotated, the step's key and value in the cache (the fused block's QKV kernel)
                    q, k, v = q.transpose(1, 2), cache.k_cache[: q.shape[0]], cache.v_cache[: q.shape[0]]
                elif rot is None:
                    q, k, v = ops.rope_and_cache(q, k, v, freqs, cache, slots)
                else:
                    q, k, v = rope_and_cache(q, k, v, rot, cache, slots, ctx.rows)
                return F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], attn_mask=bias)

        def control_at(i):  # the control rows added before block i, or None
            if picked is None or i >= len(self.layers) or i % self.args.layer_internal:
                return None
            # Official code indexes a 4th list for GPT-1B/7B and crashes; we reuse the last one.
            return picked[min(i // self.args.layer_internal, NUM_CONTROL_LISTS - 1)]

        folds = ctx.block_adds_control  # the block adds the next block's control rows to its output itself
        delta = None  # the eager blocks' last residual add, left to the next block's first norm (one kernel fewer)
        for i, layer in enumerate(self.layers):
            control = control_at(i)
            if control is not None and not (folds and i > 0):
                if delta is not None:
                    x, delta = x + delta, None
                x = x + control
            if ctx.block is None:
                x, delta = layer(x, freqs, attend, ops, delta=delta, defer=True)
            elif folds:
                x = ctx.block(layer, x, freqs, attend, where, control=control_at(i + 1))
            else:
                x = ctx.block(layer, x, freqs, attend, where)
        if delta is not None:
            x = x + delta
        return x[:, -1:] if last_only else x

    def logits(self, x, ops=TORCH_OPS):
        """Hidden states (..., D) -> float32 logits (..., vocab_size)."""
        return self.output(rms_norm(ops, self.norm, x)).float()


def attention_mask(key_valid, input_pos):
    """Boolean (B,1,S,L) mask: query p sees key q iff q == p, or q <= p and key_valid[q]; input_pos (S,), or (B, S)
    a row's own positions.

    The forced diagonal keeps fully padded text rows from an empty softmax (official behaviour).
    """
    k_pos = torch.arange(key_valid.shape[1], device=key_valid.device)
    q_pos = input_pos[..., :, None]
    visible = (k_pos <= q_pos) & (key_valid[:, None, :] | (k_pos == q_pos))
    return visible[:, None]


def window_slots(start, ancestry):
    """The cache slots (B, S) of a window's rows: start, start + 1, ... (Context.window)."""
    return start[:, None] + torch.arange(ancestry.shape[1], device=start.device)


def window_mask(key_valid, start, ancestry):
    """Boolean (B,1,S,L) mask of a window's S rows (Context.window): row j sees cache key k < start[b] where
    key_valid says, and window key start[b] + m where bit m of ancestry[b, j] is set (itself and its ancestors), no
    other. The window's keys as one 64-bit word per row: at most 63 rows."""
    off = torch.arange(key_valid.shape[1], device=key_valid.device) - start[:, None]  # (B, L)
    inside = (off >= 0) & (off < ancestry.shape[1])
    bits = (ancestry[:, :, None] >> off.clamp(0, 62)[:, None, :]) & 1  # (B, S, L)
    visible = ((off < 0) & key_valid)[:, None, :] | (inside[:, None, :] & (bits == 1))
    return visible[:, None]


def rope_table(args):
    """precompute_freqs_cis_2d's table on the default device; on the meta device (a model built for its shapes,
    memory.py) its shape only, nothing computed."""
    if torch.get_default_device().type == "meta":
        return torch.empty(args.prefix_len + math.isqrt(args.block_size) ** 2, args.head_dim // 2, 2, device="meta")
    return precompute_freqs_cis_2d(args).to(torch.get_default_device())


def precompute_freqs_cis_2d(args):
    """(prefix + G*G, head_dim/2, 2) table of (cos, sin); the prefix rows are ZERO, not identity.

    Pairs 0..hd/4-1 rotate by the row index, pairs hd/4..hd/2-1 by the column index, on the
    sqrt(block_size) grid whatever the real image shape is (as the checkpoints were trained).
    Computed on the CPU whatever the default device, as the official table is (a GPU's cos and sin
    differ in the last bits).
    """
    half = args.head_dim // 2
    grid = math.isqrt(args.block_size)
    freqs = 1.0 / (args.rope_base ** (torch.arange(0, half, 2, device="cpu")[: half // 2].float() / half))
    t = torch.arange(grid, dtype=torch.float32, device="cpu")
    angles = torch.outer(t, freqs)  # (G, hd/4)
    grid_angles = torch.cat(
        [angles[:, None, :].expand(-1, grid, -1), angles[None, :, :].expand(grid, -1, -1)], dim=-1
    ).reshape(grid * grid, half)
    table = torch.stack([torch.cos(grid_angles), torch.sin(grid_angles)], dim=-1)
    return torch.cat([torch.zeros(args.prefix_len, half, 2, device="cpu"), table])


def rope_and_cache(q, k, v, rot, cache, input_pos, rows=None):
    """The official order before attention: RoPE on q and k (B,S,H,hd) by rot = rotations(freqs), k and v
    written to the cache at input_pos. -> q (B,H,S,hd) and the cache's first B rows of keys and values (rows: those
    cache rows, KVCache.update). Without a cache (training: the whole sequence at once) k and v are returned."""
    qk = heads_together(q, k)
    if qk is None:
        q, k = apply_rotary_emb(q, rot), apply_rotary_emb(k, rot)
    else:
        q, k = apply_rotary_emb(qk, rot).split(q.shape[2], dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return (q, k, v) if cache is None else (q, *cache.update(input_pos, k, v, rows))


def heads_together(q, k):
    """q and k (B,S,H,hd) as one (B,S,2H,hd) view where k's heads follow q's in memory (one projection's split), so
    that one rotation (three kernels) does both: the eager prefill is launch-bound. None otherwise, and when compiling
    (inductor fuses the two rotations anyway)."""
    B, S, H, hd = q.shape
    if torch.compiler.is_compiling() or k.shape != q.shape or k.stride() != q.stride() or q.stride()[2:] != (hd, 1):
        return None
    if k.data_ptr() != q.data_ptr() + H * hd * q.element_size() or k.dtype != q.dtype:
        return None
    return q.as_strided((B, S, 2 * H, hd), q.stride())


def rotations(freqs):
    """RoPE rows (S,hd/2,2) of (cos, sin) -> (S,hd/2,2,2) rotations [[cos, -sin], [sin, cos]]."""
    cos, sin = freqs.unbind(-1)
    return torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))


def apply_rotary_emb(x, rot):
    """Rotate adjacent pairs (x[2j], x[2j+1]) of x (B,S,H,hd) by rot = rotations(freqs) ([B,] S,hd/2,2,2), in
    float32: (x0 cos - x1 sin, x1 cos + x0 sin), each product rounded to float32 and then the two added, as
    the official code rounds (a product by -sin is the negated product by sin). The two added as one add, not a
    sum over the last dimension: the same values (a zero's sign aside), and PyTorch's reduction kernel over pairs was
    most of the eager rotation's time (GPT-XL's prefill at n = 1 on an H200: 22.2 -> 15.9 us a block)."""
    xs = x.reshape(*x.shape[:-1], -1, 1, 2)  # bf16 times float32 is float32: no copy to float32 first
    rows = rot.shape[0] if rot.dim() == 5 else 1  # a row's own positions' rotations (B, S, hd/2, 2, 2)
    p = xs * rot.view(rows, xs.shape[1], 1, xs.shape[3], 2, 2)
    return (p[..., 0] + p[..., 1]).flatten(3).type_as(x)
