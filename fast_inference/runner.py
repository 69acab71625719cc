"""One shape's static buffers and the functions that run its prefill and decode steps over them.

A step (inputs -> blocks -> head -> CFG merge, temperature, top-k/top-p, draw -> token written, position advanced)
reads and writes only buffers: no inputs to copy, no host sync, so it can be captured once and replayed N-1 times.
The Engine (engine.py) wires the plan's kernels into a runner (its contexts, heads, draw, inputs, prefetcher) and
captures or compiles its steps.
"""
from dataclasses import replace

import torch
import torch.nn as nn

from fast_inference.kernels import attention_triton
from fast_inference.kernels.prefetch_triton import run_beside
from fast_inference.model import Context
from fast_inference.sampling import cfg_merge, sample


def cache_windows(prefix_len, num_tokens, max_seq, groups):
    """The decode steps in `groups` runs of equal length -> (cache lengths, the window of each step).
    Step i writes and attends up to position prefix_len + i, so its run's length covers the run's
    last position (rounded up to 8, at most max_seq); runs of equal length share one window."""
    steps = max(num_tokens - 1, 1)
    per = -(-steps // groups)
    need = [min(max_seq, -(-(prefix_len + (i // per + 1) * per) // 8) * 8) for i in range(steps)]
    lengths = sorted(set(need))
    return lengths, [lengths.index(n) for n in need]


class ShapeRunner(nn.Module):
    """One shape's static buffers (batch, tokens, control grid, settings) and the functions that run its prefill and
    steps over them, with the plan's implementations (wired by the Engine)."""

    # Re-running a step from the same token and position rewrites the same KV slot with the same values, so a
    # capture's warm-up puts back only these buffers (and the RNG), not the caches (graphs.snapshot).
    STATE = ("token", "input_pos", "out", "logits")

    def __init__(self, model, plan, num_tokens, prefix_len, num_controls, top_k, keep_logits):
        super().__init__()
        s = plan.situation
        self.model, self.plan = model, plan
        self.batch, self.num_tokens, self.prefix_len, self.cfg = s.batch, num_tokens, prefix_len, s.cfg
        self.top_k, self.top_p, self.sample_logits = top_k, s.top_p, s.sample
        self.keep_logits = keep_logits  # each step's logits into `logits` (teacher forcing reads them)
        rows = s.rows
        dtype, D = model.tok_embeddings.weight.dtype, model.args.dim
        tree = plan.jacobi is not None and plan.situation.draft_tree
        model.setup_caches(rows, prefix_len + num_tokens, dtype, spare=plan.jacobi.nodes if tree else 0)
        self.cache = model.layers[0].attention.kv_cache  # graphs are bound to these cache tensors
        device = model.output.weight.device
        if plan.text_sums != "none":  # RoPE's zero rows make the text's keys zero: one partial (attention_triton)
            H, hd = model.args.n_head, model.args.head_dim
            for layer in model.layers:
                layer.attention.kv_cache.text = (torch.zeros(rows, H, hd, device=device),
                                                 torch.zeros(rows, device=device), prefix_len)
        if plan.windows > 1:  # the cache length SDPA reads in each window of steps
            self.kv_lens, self.step_window = cache_windows(prefix_len, num_tokens, model.max_seq, plan.windows)
        else:
            self.kv_lens, self.step_window = [None], [0]
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)
        batch = s.batch
        buf("token", torch.zeros(batch, 1, dtype=torch.long, device=device))
        buf("input_pos", torch.zeros(1, dtype=torch.long, device=device))
        buf("out", torch.zeros(batch, num_tokens, dtype=torch.long, device=device))
        buf("logits", torch.zeros(rows, model.args.vocab_size, device=device))
        buf("noise", torch.zeros(batch, model.args.vocab_size, device=device))  # the fused draw's race noise
        buf("draws", torch.zeros(1 + batch, dtype=torch.long, device=device))  # the fused draw's counts, zeros between
        buf("key_valid", torch.ones(rows, model.max_seq, dtype=torch.bool, device=device))
        buf("controls", torch.zeros(3, rows, num_controls, D, dtype=dtype, device=device))
        # Tensors, not constants, so a new cfg scale or temperature replays the same graph.
        buf("cfg_scale", torch.ones((), device=device))
        buf("temperature", torch.ones((), device=device))
        buf("seed", torch.zeros((), dtype=torch.long, device=device))  # the fused draw's Philox key, per call
        # The rows each kind of step runs at (guided: both CFG halves; without CFG every step is "unguided")
        self.rows_plan = {True: plan.guided, False: plan.unguided or plan.guided}
        self.contexts, self.heads = {}, {}  # per kind of step: the model's Context, the head
        self.prefill_ctx = Context()
        self.inputs_fn = self.draw_fn = self.prefetcher = self.text_table = None
        self.finish_fn = None  # finish_fn(self, h, guided): ShapeRunner.finish compiled, where the plan compiles it
        self.capture_prefill = plan.prefill == "eager_graph"
        self.prefix = None  # a captured prefill's input, copied in for each image
        self.prefill_logits = None  # the prefill's output: the captured tensor where it is replayed

    def key(self):
        return (self.batch, self.num_tokens, self.prefix_len, self.controls.shape[2], self.cfg,
                self.top_k, self.top_p, self.sample_logits, self.controls.dtype, self.keep_logits)

    def prefill(self, prefix):
        """Prefix positions 0..T-1 -> the caches, and the logits of the last (first_token draws from them)."""
        input_pos = torch.arange(prefix.shape[1], device=prefix.device)
        logits = self.model(prefix, input_pos, self.key_valid, self.controls, last_only=True, ctx=self.prefill_ctx)
        if self.plan.text_sums != "none":
            caches = [layer.attention.kv_cache for layer in self.model.layers]
            attention_triton.layer_text_sums(caches, self.key_valid, self.text_table)
        return logits[:, -1]

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
        """The step to capture or compile, reading the cache window w: over all rows (both CFG halves when cfg is on)
        if guided, else the conditional half only (after cfg_interval, or without CFG)."""
        ctx = replace(self.contexts[guided], kv_len=self.kv_lens[w])
        if guided:
            return lambda: self._advance(self.key_valid, self.controls, self.cfg, ctx)
        return lambda: self._advance(self.key_valid[: self.batch], self.controls[:, : self.batch], False, ctx)

    def _advance(self, key_valid, controls, guided, ctx):
        # Weights and keys into L2 ahead of the kernels that read them, beside the step: inside its graph only
        run_beside(self.prefetcher, key_valid.shape[0], lambda: self._step(key_valid, controls, guided, ctx))

    def _step(self, key_valid, controls, guided, ctx):
        """The step's inputs, blocks, head and draw."""
        if self.inputs_fn is not None:  # embeddings, RoPE row and control rows in one kernel
            x, inputs = self.inputs_fn(self.model, self.token, self.input_pos, controls, guided)
            ctx = replace(ctx, inputs=inputs)
        else:
            x = self.model.tok_embeddings(torch.cat([self.token, self.token]) if guided else self.token)
        h = self.model.blocks(x, self.input_pos, key_valid, controls, last_only=True, ctx=ctx)
        if self.finish_fn is None:
            self.finish(h, guided)
        else:
            self.finish_fn(self, h, guided)

    def finish(self, h, guided):
        """Last hidden state -> logits -> CFG merge -> filtered draw -> token written, position advanced."""
        self.emit(self.heads[guided](h)[:, -1], guided, self.plan.head_noise)

    def emit(self, logits, guided, noise_ready=False):
        """Logits (rows, V) predicting the token after input_pos -> the token drawn, to `token` and `out`
        (and the logits, in float32, to `logits` if keep_logits); the position advanced. noise_ready: the
        fused draw's race noise is made for this step (the fused head), else the draw makes it."""
        if self.keep_logits:
            self.logits[: logits.shape[0]].copy_(logits)
        if self.draw_fn is not None:  # one kernel's draw (or two), the position advanced by it too
            self.draw_fn(logits, self.token, self.out, self.input_pos, self.seed, self.cfg_scale, self.temperature,
                         self.prefix_len, self.top_k, guided, self.sample_logits, self.noise, noise_ready, self.draws)
            return
        logits = logits.float()
        token = sample(cfg_merge(logits, self.cfg_scale) if guided else logits, self.temperature, self.top_k,
                       self.top_p, self.sample_logits, race=True)
        self.token.copy_(token)
        self.out.index_copy_(1, self.input_pos - self.prefix_len + 1, token)
        self.input_pos.add_(1)
