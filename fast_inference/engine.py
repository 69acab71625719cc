"""The fast engine: static KV caches and ONE captured decode step per token.

The step (embed -> transformer -> CFG merge -> temperature/top-k/top-p -> exponential-race draw
-> write the token) reads and writes only buffers: the model's KV caches and the `Sampler`'s
token, position, output, mask and control buffers. So it has no inputs to copy, no host sync, and
can be captured once and replayed N-1 times:
  backend "inductor":  compile_scope "block" (default): one compiled transformer block shared by
                       all layers (regional compilation, ~1/n_layer of the compile time) and a
                       compiled head (norm, output), in a step captured by hand as below
                       (inductor's kernels with programmatic dependent launch on Hopper+; the
                       weights and the next attention's first keys pulled into L2 beside the step,
                       paced by the attention and the down projection); the
                       embeddings, RoPE row and control rows in one Triton kernel (decode_inputs);
                       at <= 16 rows (n <= 8 under CFG) decode_block's fused Triton kernels
                       instead, with nothing compiled (fused_block=True), their weights pulled
                       into L2 just ahead of them by a kernel beside the step (prefetch); the
                       sampling in one Triton kernel (decode_sampling; sampling.py's ops compiled
                       for top-p < 1);
                       compile_scope "step": torch.compile(step, mode=reduce-overhead|max-autotune,
                       fullgraph=True), as gpt-fast; int8 weights (quantize.py): the fused
                       kernels up to 16 rows, the eager block beyond, nothing compiled
  backend "cudagraph": torch.cuda.CUDAGraph captured by hand around the eager step (no Triton);
                       its SDPA reads a static window of the cache per group of steps (one graph
                       per window, CACHE_WINDOWS), not the whole cache; up to 4 rows in bf16 on
                       Hopper+ the blocks' projections run as smem_gemv's CUDA C++ kernels (NVRTC)
                       and the attention as smem_attention's (filled keys only: no windows); on
                       Hopper+ the draw and the step's inputs as one CUDA C++ kernel each (cuda_draw,
                       cuda_inputs; top-p < 1: sampling.py's ops), and in the eager blocks and prefill
                       RoPE with the cache write and SiLU x up (fused_ops through cuda_ops); past
                       smem_gemv's rows the eager blocks' attention is smem_attention's too, which
                       does their steps' RoPE and cache write itself
  backend "eager":     the same steps run op by op (CPU, debugging)
Where the steps are captured by hand the eager prefill is captured too from a shape's second image on
(replayed per image, its prefix copied in; the first token's draw runs after it, outside its graph), and so is
the control encoder with the rest of prepare() (Engine._prepare). Where
the steps run the compiled block, and with compile_prefill up to 8 images too, the prefill's blocks run it
(no graph; from the shape's first image, so that every image of a seed is the same).
It computes what generate.py computes; only the draw differs (same distribution, see sampling.py).
"""
import functools
import logging
import os
import time

import torch
import torch.nn as nn

from fast_inference import (cuda_draw, cuda_inputs, cuda_ops, decode_attention, decode_block, decode_inputs,
                            decode_sampling, prefetch, smem_attention, smem_gemv)
from fast_inference.generate import prepare
from fast_inference.pdl import use_pdl
from fast_inference.quantize import is_int8
from fast_inference.sampling import cfg_merge, sample

log = logging.getLogger("fast_inference")

# Without the Triton decode attention (backends cudagraph and eager) a step's SDPA reads a static
# window of the cache, one per run of steps: with 8 runs a step reads on average 1/16 of the
# image's keys past the filled part, instead of the whole cache. One captured graph per window.
CACHE_WINDOWS = 8
BACKENDS = ("inductor", "cudagraph", "eager")
COMPILE_SCOPES = ("step", "block")


def inductor_pdl(device):
    """Inductor's programmatic dependent launch on Hopper+: each of its kernels starts while the one
    before it drains (n = 32 on an H200: 3.58 -> 3.38 ms/step, only while the block's step graph is the
    process's one CUDA graph capture; docs/PERF_NOTES.md #18). Off with
    TORCHINDUCTOR_ENABLE_PDL=0. Process-wide, as the compile cache directory: the config, and the
    environment for inductor's compile workers. Called just before compiling: importing inductor
    takes seconds, and the fused path (<= 16 rows) never needs it."""
    if os.environ.get("TORCHINDUCTOR_ENABLE_PDL", "1") != "1" or not use_pdl(device):
        return
    import torch._inductor.config

    if hasattr(torch._inductor.config.triton, "enable_pdl"):  # torch >= 2.9
        os.environ["TORCHINDUCTOR_ENABLE_PDL"] = "1"
        torch._inductor.config.triton.enable_pdl = True


def cache_windows(prefix_len, num_tokens, max_seq, groups):
    """The decode steps in `groups` runs of equal length -> (cache lengths, the window of each step).
    Step i writes and attends up to position prefix_len + i, so its run's length covers the run's
    last position (rounded up to 8, at most max_seq); runs of equal length share one window."""
    steps = max(num_tokens - 1, 1)
    per = -(-steps // groups)
    need = [min(max_seq, -(-(prefix_len + (i // per + 1) * per) // 8) * 8) for i in range(steps)]
    lengths = sorted(set(need))
    return lengths, [lengths.index(n) for n in need]


def captures_prefill(hand_capture, prefill_block, compiled):
    """Whether the engine captures the prefill too, replaying it for every image of a shape: its ~1,000 small
    eager kernels take 17-40 ms of CPU for ~5 ms of GPU work at n = 1 (H200). Where its steps are captured by
    hand and the prefill runs eagerly; not through the compiled block (no CUDA graph there) or compiled whole."""
    return hand_capture and prefill_block is None and not compiled


def default_cache_dir():
    return os.path.join(os.path.expanduser("~"), ".cache", "controlar_fast", "inductor")


class Sampler(nn.Module):
    """Static buffers and the step functions for one (batch, tokens, control grid, settings) shape."""

    def __init__(self, model, batch, num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                 decode_attention=None, block_fn=None, draw_fn=None, windows=1, inputs_fn=None,
                 keep_logits=True):
        super().__init__()
        self.model = model
        self.decode_attention, self.block_fn, self.draw_fn = decode_attention, block_fn, draw_fn
        self.inputs_fn = inputs_fn  # the step's inputs in one kernel (decode_inputs', cuda_inputs'); None: the model's
        self.batch, self.num_tokens, self.prefix_len, self.cfg = batch, num_tokens, prefix_len, cfg
        self.top_k, self.top_p, self.sample_logits = top_k, top_p, sample_logits
        self.keep_logits = keep_logits  # each step's logits into `logits` (teacher forcing reads them)
        self.finish_fn = self.finish  # the engine may compile it
        self.logits_fn = model.logits  # or decode_block.logits (norm fused into the output GEMV)
        rows = 2 * batch if cfg else batch
        model.setup_caches(rows, prefix_len + num_tokens, model.tok_embeddings.weight.dtype)
        self.cache = model.layers[0].attention.kv_cache  # graphs are bound to these cache tensors
        # RoPE's zero rows make the text's keys zero (SPEC 2.5): the decode attention kernel takes them as one
        # partial, their values' sum and count, made after each prefill (decode_attention.text_sums)
        text_len = prefix_len if (decode_attention is not None and getattr(decode_attention, "text", True)
                                  and not model.freqs_cis[:prefix_len].any()) else 0
        for layer in model.layers:
            layer.attention.kv_cache.text_len = text_len
        # The cache length SDPA reads in each window of steps (None: the whole cache, or the kernel's own;
        # the engine asks for windows only where there is no decode_attention kernel)
        if windows > 1:
            self.kv_lens, self.step_window = cache_windows(prefix_len, num_tokens, model.max_seq, windows)
        else:
            self.kv_lens, self.step_window = [None], [0]
        device, dtype, D = model.output.weight.device, model.tok_embeddings.weight.dtype, model.args.dim
        self.text_table = None  # the engine's, for the text partials of all layers in one kernel (layer_text_sums)
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)
        buf("token", torch.zeros(batch, 1, dtype=torch.long, device=device))
        buf("input_pos", torch.zeros(1, dtype=torch.long, device=device))
        buf("out", torch.zeros(batch, num_tokens, dtype=torch.long, device=device))
        buf("logits", torch.zeros(rows, model.args.vocab_size, device=device))
        # The fused draw's race noise, made by the fused head where the engine says so (head_noise)
        self.head_noise = False
        buf("noise", torch.zeros(batch, model.args.vocab_size, device=device))
        buf("draws", torch.zeros(1 + batch, dtype=torch.long, device=device))  # the fused draw's counts, zeros between
        buf("key_valid", torch.ones(rows, model.max_seq, dtype=torch.bool, device=device))
        buf("controls", torch.zeros(3, rows, num_controls, D, dtype=dtype, device=device))
        # Tensors, not constants, so a new cfg scale or temperature replays the same graph.
        buf("cfg_scale", torch.ones((), device=device))
        buf("temperature", torch.ones((), device=device))
        buf("seed", torch.zeros((), dtype=torch.long, device=device))  # the fused draw's Philox key, per call
        self.capture_prefill = False  # the engine decides (captures_prefill)
        self.prefetcher = None  # prefetch.Prefetcher, counted by the fused block or the compiled block's attention
        self.prefix = None  # a captured prefill's input, copied in for each image
        self.prefill_logits = None  # the prefill's output: the captured tensor where it is replayed
        self.prefill_block = None  # the prefill's block_fn: None (eager) or the engine's compiled block

    def key(self):
        return (self.batch, self.num_tokens, self.prefix_len, self.controls.shape[2], self.cfg,
                self.top_k, self.top_p, self.sample_logits, self.controls.dtype, self.keep_logits)

    def _sample(self, logits):
        return sample(logits, self.temperature, self.top_k, self.top_p, self.sample_logits, race=True)

    def prefill(self, prefix):
        """Prefix positions 0..T-1 -> the caches, and the logits of the last (first_token draws from them)."""
        T = prefix.shape[1]
        input_pos = torch.arange(T, device=prefix.device)
        # SDPA over the prefix's keys only, not the whole cache (masked past T anyway): GPT-XL's prefill at n = 1
        # 3.92 -> 3.30 ms of GPU on an H200, the same logits bit for bit
        logits = self.model(prefix, input_pos, self.key_valid, self.controls, last_only=True,
                            block_fn=self.prefill_block, kv_len=min(-(-T // 8) * 8, self.model.max_seq))[:, -1]
        if self.cache.text_len:
            caches = [layer.attention.kv_cache for layer in self.model.layers]
            decode_attention.layer_text_sums(caches, self.key_valid, self.text_table)
        return logits

    def first_token(self, logits):
        """The first image token, drawn from the prefill's logits into out[:, 0]. Never in the prefill's graph: the
        fused draw's kernels launch under PDL, and in a second graph of the shape they cost every step PDL's overlap
        (docs/PERF_NOTES.md, "The prefill's graph without its draw")."""
        self.input_pos.fill_(self.prefix_len - 1)  # the position whose next token is drawn
        self.emit(logits, self.cfg)

    def window(self, i):
        """The window (index into kv_lens) of decode step i."""
        return self.step_window[min(i, len(self.step_window) - 1)]

    def step_fn(self, guided, w):
        """The step to capture or compile, reading the cache window w: `step` if guided, else
        `step_conditional`."""
        kv_len = self.kv_lens[w]
        if guided:
            return lambda: self.step(kv_len)
        return lambda: self.step_conditional(kv_len)

    def step(self, kv_len=None):
        """One guided decode step over all rows (both CFG halves when cfg is on)."""
        self._advance(self.key_valid, self.controls, self.cfg, kv_len)

    def step_conditional(self, kv_len=None):
        """After cfg_interval: the conditional half only, at half the batch (same tokens out)."""
        self._advance(self.key_valid[: self.batch], self.controls[:, : self.batch], False, kv_len)

    def _advance(self, key_valid, controls, guided, kv_len):
        # Weights and keys into L2 ahead of the kernels that read them, beside the step: inside its graph only (prefetch.py)
        fetching = self.prefetcher is not None and self.prefetcher.start(key_valid.shape[0])
        if self.inputs_fn is not None:  # embeddings, RoPE row and control rows in one kernel
            x, inputs = self.inputs_fn(self.model, self.token, self.input_pos, controls, guided)
        else:
            x, inputs = self.model.tok_embeddings(torch.cat([self.token, self.token]) if guided else self.token), None
        h = self.model(x, self.input_pos, key_valid, controls, last_only=True, decode_attention=self.decode_attention,
                       block_fn=self.block_fn, hidden=True, kv_len=kv_len, inputs=inputs)
        self.finish_fn(h, guided)
        if fetching:
            self.prefetcher.join()
        elif self.prefetcher is not None:
            self.prefetcher.reset()

    def finish(self, h, guided):
        """Last hidden state -> logits -> CFG merge -> filtered draw -> token written, position advanced."""
        self.emit(self.logits_fn(h)[:, -1], guided, self.head_noise)

    def emit(self, logits, guided, noise_ready=False):
        """Logits (rows, V) predicting the token after input_pos -> the token drawn, to `token` and `out`
        (and the logits, in float32, to `logits` if keep_logits); the position advanced. noise_ready: the
        fused draw's race noise is made for this step (decode_block.logits), else the draw makes it."""
        if self.keep_logits:
            self.logits[: logits.shape[0]].copy_(logits)
        if self.draw_fn is not None:  # one kernel's draw (or two), the position advanced by it too
            self.draw_fn(logits, self.token, self.out, self.input_pos, self.seed, self.cfg_scale, self.temperature,
                         self.prefix_len, self.top_k, guided, self.sample_logits, self.noise, noise_ready, self.draws)
            return
        logits = logits.float()
        token = self._sample(cfg_merge(logits, self.cfg_scale) if guided else logits)
        self.token.copy_(token)
        self.out.index_copy_(1, self.input_pos - self.prefix_len + 1, token)
        self.input_pos.add_(1)


class Engine:
    """Generate with the fast path; `generate` takes the same arguments as generate.generate."""

    def __init__(self, model, backend="inductor", compile_mode="reduce-overhead", cache_dir=None,
                 compile_prefill=False, compile_scope="block", fused_block=True):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; use one of {BACKENDS}")
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"unknown compile scope {compile_scope!r}; use one of {COMPILE_SCOPES}")
        self.model, self.backend, self.compile_mode = model, backend, compile_mode
        # As gpt-fast's --compile_prefill: the prefill compiled where it would run eagerly. With compile scope
        # "block" (bf16) it runs the compiled block (a few seconds of compile; past 8 images it does anyway),
        # else it is compiled as one graph (~50 s for GPT-XL): that pays off over many batches of one shape.
        self.compile_prefill = compile_prefill
        self.device = model.output.weight.device
        if backend == "cudagraph" and self.device.type != "cuda":
            raise ValueError("--backend cudagraph needs a CUDA device; use --backend eager or inductor on CPU")
        if backend == "inductor":
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir or default_cache_dir())
        if model.layers[0].feed_forward.w13 is None:
            model.fuse_projections()
        # inductor turns int8 projections into slow kernels: decode_block's or eager ones instead
        self.int8 = is_int8(model)
        if self.int8 and backend == "inductor" and compile_scope == "step":
            raise ValueError("int8 weights run with compile_scope 'block'")
        self.block_scope = backend == "inductor" and compile_scope == "block"
        self.block_fn = None  # the compiled block, made when a shape first needs it
        self.compile_seconds = 0.0
        self.hand_capture = self.device.type == "cuda" and (backend == "cudagraph" or self.block_scope)
        self.fused_block = fused_block and self.block_scope
        # The split-KV Triton kernel needs Triton; the cudagraph backend promises to run without it.
        self.decode_attention = None
        if backend == "inductor" and decode_attention.available(self.device):
            self.decode_attention = decode_attention.decode_attention
        self.sampler = None
        self.conditions = None  # prepare()'s graph for one set of inputs' shapes and settings (_prepare)
        self.marks = None  # the last generate()'s Marks: last_timings

    @property
    def last_timings(self):
        """Seconds of the last generate()'s condition encoder, prefill and decode (compile and capture left out);
        {} before the first. Reading it waits for the GPU: generate() itself does not."""
        return self.marks.seconds() if self.marks else {}

    # ---- building the step for a shape ---------------------------------------------------------

    def _sampler_for(self, batch, num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                     keep_logits):
        s = self.sampler
        want = (num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                self.model.tok_embeddings.weight.dtype, keep_logits)
        mine = s is not None and self.model.layers[0].attention.kv_cache is s.cache
        if mine and s.key()[1:] == want and s.batch >= batch:
            return s  # a smaller batch is padded up to the captured one
        if s is not None:
            log.info("new shape (batch %d, %d tokens): building new caches and graphs", batch, num_tokens)
        self.sampler = None
        self.model.clear_caches()
        rows = 2 * batch if cfg else batch
        block_fn, attention = None, self.decode_attention
        fused = self.fused_block and attention is not None and decode_block.supported(self.model, rows)
        prefetcher = None
        if fused:  # up to 16 rows the fused kernels beat the compiled block, and need no compiler at all
            block_fn = decode_block.decode_block
            if prefetch.available(self.device):
                prefetcher = prefetch.Prefetcher(self.model)
                block_fn = functools.partial(block_fn, prefetcher=prefetcher)
            attention = functools.partial(attention, pdl=decode_block.attention_pdl(rows, self.device, self.int8),
                                          merge_pdl=decode_block.merge_pdl(rows, self.device, self.int8))
        elif self.block_scope and self.int8:
            log.warning("int8 weights at %d rows: the block runs eagerly, slower than bf16 there (fused kernels up "
                        "to %d rows); use --quantize none for large batches", rows, decode_block.MAX_ROWS)
            block_fn = run_block
        elif self.block_scope:
            block_fn = self.compiled_block()
            if attention is not None and prefetch.available(self.device):  # paced by the attention's and down's counts
                prefetcher = prefetch.Prefetcher(self.model, compiled=True)
                attention = functools.partial(attention, progress=prefetcher.progress)
                block_fn = functools.partial(block_fn, progress=prefetcher.progress)
        elif self.backend == "cudagraph" and smem_gemv.builds_block(self.model.layers[0], {rows, batch}, self.device):
            # no Triton: the four projections with their norms, RoPE, cache writes and residuals as smem_gemv's CUDA
            # kernels (README, "Other modes")
            block_fn = functools.partial(decode_block.decode_block, kernels=smem_gemv.ALL)
            # and between them the decode attention in CUDA C++ too where it builds, else SDPA
            if smem_attention.builds(self.model.layers[0].attention, prefix_len + num_tokens, {rows, batch},
                                     self.device):
                attention = smem_attention.decode_attention
            log.info("decode block for %d rows: smem_gemv's CUDA C++ kernels (%s) and %s", rows,
                     ", ".join(smem_gemv.ALL), "smem_attention's" if attention else "SDPA")
        elif self.backend == "cudagraph" and smem_attention.builds(self.model.layers[0].attention,
                                                                   prefix_len + num_tokens, {rows, batch}, self.device):
            # past smem_gemv's rows the eager block's attention is smem_attention's looping kernel (no cache windows)
            attention = smem_attention.decode_attention
            log.info("decode block for %d rows: eager, with smem_attention's decode attention", rows)
        if self.block_scope:
            dtype, layer = self.model.tok_embeddings.weight.dtype, self.model.layers[0]
            cuda = smem_gemv.used(rows, dtype, self.device, layer) if fused and not self.int8 else ()
            log.info("decode block for %d rows: %s%s", rows, "fused Triton kernels" if fused else
                     "eager (int8)" if self.int8 else "compiled (inductor)",
                     f" ({', '.join(cuda)} in CUDA C++: smem_gemv)" if cuda else "")
        # The draw in Triton's kernels where the attention is Triton's; the cudagraph backend promises no Triton, so
        # there in CUDA C++ where it builds. Else sampling.py's ops.
        draw_fn = None
        if self.decode_attention is not None and decode_sampling.supported(self.device, top_p):
            draw_fn = decode_sampling.draw
        elif self.backend == "cudagraph" and cuda_draw.builds(self.model.args.vocab_size,
                                                              self.model.output.weight.dtype, self.device, top_p):
            draw_fn = cuda_draw.draw
        # Cache windows where the steps are captured or run eagerly, for SDPA: a compiler would compile each, and a
        # decode attention kernel reads only the filled keys.
        windows = CACHE_WINDOWS if self.backend in ("cudagraph", "eager") and attention is None else 1
        # The step's inputs in one kernel where the ops around the blocks run eagerly (block scope), on the cudagraph
        # backend in CUDA C++
        inputs_fn = None
        if self.block_scope and attention is not None and decode_inputs.supported(self.device):
            inputs_fn = decode_inputs.step_inputs
        elif self.backend == "cudagraph" and cuda_inputs.builds(self.model, self.device):  # no Triton there
            inputs_fn = cuda_inputs.step_inputs
        if self.backend == "cudagraph":  # fused_ops' kernels in CUDA C++ there (cuda_ops), built before any capture
            cuda_ops.builds(self.device, self.model.tok_embeddings.weight.dtype)
        s = Sampler(self.model, batch, num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                    attention, block_fn, draw_fn, windows, inputs_fn, keep_logits)
        if fused:  # the fused head, which also makes the fused draw's noise
            s.head_noise = draw_fn is decode_sampling.draw and sample_logits
            noise = (s.noise, s.input_pos, s.seed) if s.head_noise else None
            s.logits_fn = functools.partial(decode_block.logits, self.model, noise=noise)
        s.prefetcher = prefetcher
        # the text partials in one Triton kernel where the Triton attention runs; torch's ops per layer elsewhere
        # (smem_attention's: the cudagraph backend promises no Triton)
        if s.cache.text_len and self.device.type == "cuda" and self.decode_attention is not None:
            s.text_table = decode_attention.text_table([layer.attention.kv_cache for layer in self.model.layers])
        if prefetcher is not None:  # a plan per row count the steps run at (CFG on, and off after cfg_interval)
            for r in {rows, batch}:
                down = prefetcher.compiled and decode_block.serves_down(self.model.layers[0], r)
                prefetcher.prepare(r, s.input_pos, down)
        self._build(s)
        self.sampler = s
        return s

    def compiled_block(self):
        """Regional compilation: blocks are inlined modules whose weights and caches become graph
        inputs, so one compiled block serves every layer; CUDA graphs are then captured by hand."""
        if self.block_fn is None:  # the first torch.compile imports dynamo and inductor (seconds)
            mode = "max-autotune-no-cudagraphs" if self.compile_mode == "max-autotune" else None
            inductor_pdl(self.device)
            if self.device.type == "cuda":
                decode_block.tile_counts(self.device)  # for down(): made before tracing, so that it persists
            self.block_fn = torch.compile(run_block, mode=mode, fullgraph=True, dynamic=False)
        return self.block_fn

    def _build(self, s):
        self.graphs = {}
        self.prefill_fn = s.prefill
        # Where the steps run the compiled block the prefill does too: ~2 s more compile at the first image, and
        # GPT-XL at n = 32 62 -> 28 ms per batch (H200; ~1,900 eager kernels, CPU-bound). The fused kernels'
        # shapes (<= 8 images) keep it eager unless compile_prefill, so that they start without the compiler.
        # From a shape's first image either way: one seed, one image.
        # the steps run the compiled block (its prefetcher's count bound or not)
        compiled = self.block_fn is not None and getattr(s.block_fn, "func", s.block_fn) is self.block_fn
        if self.block_scope and not self.int8 and (compiled or self.compile_prefill):
            s.prefill_block = self.compiled_block()
        self.prefill_compiled = False
        if self.backend == "inductor" and self.compile_prefill and s.prefill_block is None:
            inductor_pdl(self.device)
            self.prefill_fn = torch.compile(s.prefill, fullgraph=True, dynamic=False)
        s.capture_prefill = captures_prefill(self.hand_capture, s.prefill_block, self.prefill_fn != s.prefill)
        self.step_fns = {(guided, w): s.step_fn(guided, w) for guided in (True, False)
                         for w in range(len(s.kv_lens))}
        if compiled:
            # The head too (final norm and output projection; without the fused draw also CFG merge,
            # top-k and draw: ~40 small kernels eager); fallback_random keeps the eager random stream.
            if s.draw_fn is not None:
                s.logits_fn = torch.compile(self.model.logits, fullgraph=True, dynamic=False)
            else:
                s.finish_fn = torch.compile(s.finish, fullgraph=True, dynamic=False, options={"fallback_random": True})
        if self.backend == "inductor" and not self.block_scope:
            inductor_pdl(self.device)
            compile_kw = dict(mode=self.compile_mode, fullgraph=True, dynamic=False)
            if self.device.type == "cpu":
                compile_kw.pop("mode")  # CUDA graphs do not exist on the CPU
            self.step_fns = {key: torch.compile(f, **compile_kw) for key, f in self.step_fns.items()}
        self.warm = dict.fromkeys(self.step_fns, False)

    def _run_prefill(self, s, prefix):
        """The prefill, replayed from its graph where the engine captures it, then the first token's draw. A
        shape's first image runs it as it comes (a one-image process would pay the capture, ~2 more prefills,
        for nothing); the second captures it (timed as compile/capture time; the capture runs it once), later
        ones replay. A prefill through the compiled block (prefill_block) is timed as compile time at its first
        call."""
        if "prefill" in self.graphs:
            s.prefix.copy_(prefix)
            self.graphs["prefill"].replay()  # its logits: the captured tensor, rewritten
        elif s.capture_prefill and s.prefix is not None:
            t0 = synced(self.device)
            s.prefix.copy_(prefix)
            self.graphs["prefill"] = capture(s, lambda: setattr(s, "prefill_logits", self.prefill_fn(s.prefix)))
            self.compile_seconds += elapsed(t0, self.device)
        elif s.prefill_block is not None and not self.prefill_compiled:
            t0 = synced(self.device)
            s.prefill_logits = self.prefill_fn(prefix)  # compiles the block for the prefill's shape
            self.compile_seconds += elapsed(t0, self.device)
            self.prefill_compiled = True
        else:
            s.prefill_logits = self.prefill_fn(prefix)
            if s.capture_prefill:
                s.prefix = prefix.clone()  # the graph's input from the next image on
        s.first_token(s.prefill_logits)

    def _prepare(self, cond, condition, emb_masks, cfg_scale, control_strength):
        """prepare(): the control encoder, the prefix and the control tokens, 214 small eager kernels (4.4-4.6 ms for
        0.98 ms of GPU work at n = 1 on an H200; replayed 1.1 ms). Where the steps are captured by hand it is captured
        too, per set of inputs' shapes and settings: the first image runs it as it comes, the second captures it
        (timed as capture time), later ones copy their inputs in and replay; its outputs are then the graph's
        tensors, rewritten per image."""
        inputs = (cond, condition, emb_masks)
        run = lambda *a: prepare(self.model, *a, cfg_scale, control_strength)
        on_device = all(t is None or t.device == self.device for t in inputs)
        if not (self.hand_capture and on_device):
            return run(*inputs)
        # prepare() reads cfg_scale only as "> 1" and bakes control_strength in
        key = (tuple(None if t is None else (t.shape, t.dtype) for t in inputs), cfg_scale > 1.0,
               float(control_strength))
        c = self.conditions
        if c is None or c["key"] != key:  # one set at a time: a new one drops the last one's graph
            self.conditions = dict(key=key)
            return run(*inputs)
        if "graph" not in c:
            t0 = synced(self.device)
            c["inputs"] = [None if t is None else t.clone() for t in inputs]
            c["graph"] = capture(None, lambda: c.update(outputs=run(*c["inputs"])))
            self.compile_seconds += elapsed(t0, self.device)
        else:
            for static, t in zip(c["inputs"], inputs):
                if t is not None:
                    static.copy_(t)
            c["graph"].replay()
        return c["outputs"]

    def _run_step(self, s, key):
        """One decode step of kind key = (guided, window); the first call of each kind is timed as
        compile/capture time."""
        if self.warm[key]:
            if self.hand_capture:
                self.graphs[key].replay()
            else:
                self.step_fns[key]()
            return
        t0 = synced(self.device)
        if self.hand_capture:
            self.graphs[key] = capture(s, self.step_fns[key])
        else:
            # reduce-overhead records its graph on the first calls; run them on a saved state.
            saved = snapshot(s)
            for _ in range(3 if self.device.type == "cuda" else 1):
                restore(s, saved)
                self.step_fns[key]()
            restore(s, saved)
            self.step_fns[key]()
        self.compile_seconds += elapsed(t0, self.device)
        self.warm[key] = True

    # ---- generation ----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, cond, max_new_tokens, emb_masks=None, cfg_scale=1.0, cfg_interval=-1, condition=None,
                 control_strength=1.0, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True, forced=None):
        """Tokens (B, N). `forced` (B, N): feed these tokens instead of the sampled ones (teacher
        forcing, for tests); the logits of every step are then returned too."""
        if condition is None:
            raise ValueError("ControlAR needs a control image (condition) for every sample")
        B = cond.shape[0]
        marks = Marks(self.device)
        compile_before = self.compile_seconds
        p = self._prepare(cond, condition, emb_masks, cfg_scale, control_strength)
        marks.mark("condition", self.compile_seconds - compile_before)

        t0 = time.perf_counter()  # a new shape: caches and compile set-up (imports dynamo the first time)
        cfg = cfg_scale > 1.0
        T, num_controls = p.prefix.shape[1], p.controls.shape[2]
        s = self._sampler_for(B, max_new_tokens, T, num_controls, cfg, top_k, top_p, sample_logits, forced is not None)
        self.compile_seconds += time.perf_counter() - t0
        p = pad_rows(p, B, s.batch, cfg)
        s.key_valid.copy_(p.key_valid(self.model.max_seq))
        s.controls.copy_(p.controls)
        s.cfg_scale.fill_(float(cfg_scale))
        s.temperature.fill_(max(float(temperature), 1e-5))
        if s.draw_fn is not None:  # from torch's generator: torch.manual_seed fixes the images
            s.seed.copy_(torch.randint(0, 2**62, (), device=self.device))

        marks.mark(None)  # the new shape's set-up above is compile time
        compile_before = self.compile_seconds
        self._run_prefill(s, p.prefix)
        marks.mark("prefill", self.compile_seconds - compile_before)
        logits = [s.logits.clone()] if forced is not None else None
        compile_before = self.compile_seconds
        for i in range(max_new_tokens - 1):
            if forced is not None:
                s.token[:B].copy_(forced[:, i : i + 1])
            guided = cfg and not (-1 < cfg_interval < i)
            self._run_step(s, (guided, s.window(i)))
            if forced is not None:
                logits.append(s.logits[: (2 * s.batch if guided else s.batch)].clone())
        tokens = s.out[:B].clone()
        marks.mark("decode", self.compile_seconds - compile_before)
        self.marks = marks
        if forced is not None:
            return tokens, [unpad_logits(l, B, s.batch) for l in logits]
        return tokens


def run_block(layer, x, freqs, attend, input_pos, progress=None):
    # the model's attend reads input_pos; past the fused block's rows w2 and its add run as one kernel, which
    # counts for a prefetcher (progress)
    return layer(x, freqs, attend, decode_block.down_for(layer, x, progress))


def pad_rows(p, B, batch, cfg):
    """Pad a partial batch to the captured batch by repeating its last sample (results dropped)."""
    if B == batch:
        return p
    halves = 2 if cfg else 1

    def pad(t, dim):
        parts = t.chunk(halves, dim=dim)
        return torch.cat([torch.cat([h, h.narrow(dim, B - 1, 1).repeat_interleave(batch - B, dim)], dim)
                          for h in parts], dim)

    return type(p)(pad(p.prefix, 0), pad(p.text_mask, 0), pad(p.controls, 1))


def unpad_logits(logits, B, batch):
    halves = logits.shape[0] // batch
    return torch.cat([h[:B] for h in logits.chunk(halves)])


# Re-running a step from the same token/position rewrites the same KV slot with the same values,
# so warm-up and capture only need these small buffers (and the RNG) put back, not the caches.
STEP_STATE = ("token", "input_pos", "out", "logits")


def snapshot(s):
    rng = torch.cuda.get_rng_state(s.token.device) if s.token.is_cuda else torch.get_rng_state()
    return {name: getattr(s, name).clone() for name in STEP_STATE}, rng


def restore(s, saved):
    state, rng = saved
    for name in STEP_STATE:
        getattr(s, name).copy_(state[name])
    if s.token.is_cuda:
        torch.cuda.set_rng_state(rng, s.token.device)
    else:
        torch.set_rng_state(rng)


def capture(s, step):
    """Capture `step` into a CUDA graph by hand (warm-up on a side stream first, the Sampler s's state restored;
    s None: a step without state)."""
    saved = snapshot(s) if s is not None else None
    put_back = lambda: s is None or restore(s, saved)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            put_back()
            step()
    torch.cuda.current_stream().wait_stream(stream)
    put_back()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    put_back()
    graph.replay()
    return graph


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def elapsed(t0, device):
    sync(device)
    return time.perf_counter() - t0


def synced(device):
    """perf_counter() once the GPU has done the work queued before: a compile or capture timed from it leaves it out."""
    sync(device)
    return time.perf_counter()


class Marks:
    """The phases of one generate(), each from the mark before it to its own, minus its compile time. On CUDA the marks
    are events: without a host sync between phases the CPU queues the next phase (the VQ decode's ~600 launches)
    while the GPU runs the decode's steps."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = [(None, self._now(), 0.0)]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase, compile_s=0.0):
        """phase: its name, or None for a stretch not reported (a new shape's set-up)."""
        self.marks.append((phase, self._now(), compile_s))

    def seconds(self):
        if self.cuda:
            self.marks[-1][1].synchronize()
        span = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        return {phase: max(span(a, b) - compile_s, 0.0)
                for (_, a, _), (phase, b, compile_s) in zip(self.marks, self.marks[1:]) if phase}
