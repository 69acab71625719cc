"""The fast engine: static KV caches and ONE captured decode step per token, executing a decode plan.

plan.py chooses an implementation for every operation of a step and of the prefill from the situation (backend,
device, rows, dtype, settings); the Engine makes each new shape's plan and runner (runner.py: the shape's static
buffers and the functions that run its prefill and steps through the model's Context; speculative.py: its Jacobi
passes), wires the chosen kernels into it, captures its steps by hand (graphs.py: one pool for the shape's graphs)
or compiles them (torch.compile: the shared block, the head, or the whole step as gpt-fast does), and generates.
Where the steps are captured by hand, the eager prefill and the condition encoder (prepare) are captured too from a
shape's second image on, replayed per image with their inputs copied in; the first token's draw runs after the
prefill, outside its graph. It computes what generate.py computes; only the draw differs (the same distribution,
sampling.py).
"""
import functools
import logging
import math
import os
import time
from dataclasses import replace

import torch

from fast_inference import plan as plans
from fast_inference.continuous import ContinuousRunner
from fast_inference.generate import prepare
from fast_inference.graphs import Graphs, restore, snapshot
from fast_inference.kernels import (attention_cuda, attention_triton, block_cuda, block_triton, draw_cuda, draw_triton,
                                    eager_ops_cuda, eager_ops_triton, group_norm_triton, inputs_cuda, inputs_triton,
                                    prefetch_triton, verify_triton)
from fast_inference.kernels.block import fused_block
from fast_inference.kernels.pdl import EARLY
from fast_inference.model import TORCH_OPS, Context, EagerOps
from fast_inference.quantize import is_int8
from fast_inference.runner import ShapeRunner
from fast_inference.draft_tree import TreeRunner
from fast_inference.speculative import COUPLINGS, DEFAULT_INIT, DRAFT_INITS, JacobiRunner

log = logging.getLogger("fast_inference")

BACKENDS, COMPILE_SCOPES = plans.BACKENDS, plans.COMPILE_SCOPES
SPECULATIVE = ("none", "jacobi")
CUDA_KERNELS = dict(block_cuda=block_cuda, attention_cuda=attention_cuda, draw_cuda=draw_cuda,
                    inputs_cuda=inputs_cuda, eager_ops_cuda=eager_ops_cuda)
# the eager ops' kernels by the plan's names: (op, implementation) -> (module, function)
OPS = {("rms_norm", "cuda"): (eager_ops_cuda, "rms_norm"), ("silu_mul", "triton"): (eager_ops_triton, "silu_mul"),
       ("silu_mul", "cuda"): (eager_ops_cuda, "silu_mul"), ("rope", "triton"): (eager_ops_triton, "rope_and_cache"),
       ("rope", "cuda"): (eager_ops_cuda, "rope_and_cache")}


def default_cache_dir():
    return os.path.join(os.path.expanduser("~"), ".cache", "controlar_fast", "inductor")


def eager_ops(choice):
    """A plan's EagerOps choice as the model's EagerOps (the kernels' functions; torch's where None)."""
    pick = lambda op, name: getattr(*OPS[op, name]) if (op, name) in OPS else None
    return EagerOps(rms_norm=pick("rms_norm", choice.rms_norm), silu_mul=pick("silu_mul", choice.silu_mul),
                    rope_and_cache=pick("rope", choice.rope))


def vq_kernels(vq, backend, device, overrides=()):
    """The VQ decoder's norms through group_norm_triton where the plan says (Triton on CUDA, not the cudagraph
    backend), else torch's."""
    want = dict(plans.parse_overrides(overrides) + plans.environment_overrides())
    cuda = torch.device(device).type == "cuda"
    use = plans.vq_norm(backend, cuda, plans.triton_available(), want) == "triton"
    return vq.use_kernels(group_norm_triton if use else None)


def window_attention(p):
    """A pass's or a server step's attention (the plan's JacobiPass or OwnPositions): the Triton window attention in
    the form of its splits, or None (SDPA with each row's mask)."""
    if p.attention != "triton":
        return None
    if p.splits == "fold":
        return attention_triton.window_attention
    return functools.partial(attention_triton.window_attention, fold=False)


def decode_attention_at(rows, pdl=0, progress=None):
    """The Triton decode attention in the plan's form at `rows` rows (plan.decode_form), launched in PDL mode pdl, rows
    at their own positions as the steps' input_pos gives them; counted for a prefetcher's progress if given."""
    form, config = plans.decode_form(rows)
    return functools.partial(attention_triton.decode_attention, whole=form == "triton_whole", config=config, pdl=pdl,
                             progress=progress)


def compile_static(fn, **kw):
    """torch.compile(fn): whole graphs at static shapes. An engine compiles its block once per cache window and row
    count, and one process may build several engines (a server, tests), more than dynamo's 8 graphs per function."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, fullgraph=True, dynamic=False, **kw)


def run_block(layer, x, freqs, attend, input_pos, ops=TORCH_OPS, down=False, down_pdl=0, progress=None):
    """A block as the model's Context.block: the layer itself with its element-wise ops; with down, its w2 and
    residual add as block_triton's kernel (launched in PDL mode down_pdl, counted for a prefetcher's progress). The
    engine compiles it once for every layer (regional compilation)."""
    d = functools.partial(block_triton.down, progress=progress, pdl=down_pdl) if down else None
    return layer(x, freqs, attend, ops, down=d)


class Engine:
    """Generate with the fast path; `generate` takes the same arguments as generate.generate. overrides: plan
    overrides ("key=value" strings, plan.OVERRIDES), on top of CONTROLAR_PLAN's. speculative "jacobi": lossless
    speculative Jacobi passes of draft_window positions (speculative.py) instead of one token per step, the window's
    initial drafts by draft_init (speculative.DRAFT_INITS), their redraws' noise by draft_coupling (COUPLINGS);
    draft_tree (width, depth) or (width, depth, side, side depth): each pass a draft tree of the window (draft_tree.py,
    pathwise coupling), () a chain. draft_window, draft_coupling and draft_tree all None: the plan picks them for each
    batch (plan.given_drafts, choose_drafts); any given pins them."""

    def __init__(self, model, backend="inductor", compile_mode="reduce-overhead", cache_dir=None,
                 compile_prefill=False, compile_scope="block", fused_block=True, overrides=(), speculative="none",
                 draft_window=None, draft_init=DEFAULT_INIT, draft_coupling=None, draft_tree=None):
        self.model, self.backend, self.compile_mode = model, backend, compile_mode
        self.compile_scope, self.fused_block, self.compile_prefill = compile_scope, fused_block, compile_prefill
        self.device = model.output.weight.device
        if compile_scope not in COMPILE_SCOPES:
            raise ValueError(f"unknown compile scope {compile_scope!r}; use one of {COMPILE_SCOPES}")
        drafts = plans.given_drafts(draft_window, draft_coupling, draft_tree)
        if speculative not in SPECULATIVE or draft_init not in DRAFT_INITS or drafts.coupling not in COUPLINGS:
            raise ValueError(f"speculative {speculative!r}, draft init {draft_init!r}, coupling {draft_coupling!r}: use "
                             f"one of {SPECULATIVE}, of {DRAFT_INITS} and of {COUPLINGS}")
        if drafts.tree and drafts.coupling != "pathwise":
            raise ValueError(f"a draft tree is exact with draft coupling 'pathwise' only, not {draft_coupling!r}")
        # the drafts as given; each shape's plan runs them (plan.situation), or its choice where they were left out
        self.drafts = drafts if speculative == "jacobi" else plans.Drafts(0, drafts.coupling, ())  # 0: plain steps
        self.draft_init = draft_init
        self.overrides = tuple(dict(plans.environment_overrides() + plans.parse_overrides(overrides)).items())
        if model.layers[0].feed_forward.w13 is None:
            model.fuse_projections()
        self.int8 = is_int8(model)
        # the plan of one image, with nothing built: the backend's errors now, and how its steps run
        first = self.plan_unbuilt(1)
        self.hand_capture = first.step == "hand_graph"
        self.device_pdl = first.situation.pdl
        if backend == "inductor":
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = plans.inductor_cache_dir(cache_dir or default_cache_dir())
        self.block_fn = self.compiled_logits = None  # compiled when a shape first needs them
        self.compile_seconds = 0.0
        self.runner, self.plan = None, None  # the current shape's runner and plan
        self.graphs, self.conditions = Graphs(), None  # the shape's graphs; prepare()'s key (_prepare)
        self.marks = None  # the last generate()'s Marks: last_timings
        self.passes = None  # the last speculative generate()'s passes per image: last_speculation

    def situation(self, batch, cfg, top_p, sample_logits, max_seq):
        a, cuda = self.model.args, self.device.type == "cuda"
        return plans.Situation(
            backend=self.backend, compile_scope=self.compile_scope, fused_block=self.fused_block,
            compile_prefill=self.compile_prefill, device=self.device.type,
            capability=torch.cuda.get_device_capability(self.device) if cuda else None,
            triton=plans.triton_available(), interpret=plans.interpreting(),
            dtype=self.model.tok_embeddings.weight.dtype, int8=self.int8, top_p=top_p, sample=sample_logits, cfg=cfg,
            batch=batch, dim=a.dim, n_head=a.n_head, ffn_hidden=a.ffn_hidden, vocab_size=a.vocab_size,
            max_seq=max_seq, text_prefix=not self.model.freqs_cis[: a.prefix_len].any(),
            builds=functools.partial(self.builds_on, self.device), overrides=self.overrides,
            draft_window=self.drafts.window, draft_tree=self.drafts.tree, draft_coupling=self.drafts.coupling,
            draft_init=self.draft_init, auto_drafts=self.drafts.auto)

    def plan_unbuilt(self, batch, cfg=True, top_p=1.0):
        """The plan of `batch` images after the prefix, with no CUDA C++ kernel built (its choices, not its builds)."""
        return plans.make(replace(self.situation(batch, cfg, top_p, True, self.model.args.prefix_len + 1),
                                  builds=lambda *key: False))

    def pin_drafts(self, batch, cfg=True, top_p=1.0):
        """Where the plan picks the drafts (the draft settings left out), fix the ones it picks for `batch` images, so
        that every batch of a run (a smaller last one, a shard's) runs the same drafts -> the drafts."""
        if self.drafts.auto and self.drafts.window:
            s = self.plan_unbuilt(batch, cfg, top_p).situation
            self.drafts = plans.Drafts(s.draft_window, s.draft_coupling, tuple(s.draft_tree))
        return self.drafts

    @staticmethod
    def builds_on(device, kernel, *key):
        """Whether CUDA C++ kernel `kernel` (CUDA_KERNELS) builds on device for `key`: compiled now, before any capture.
        (The plan holds it with the device, not the engine: no reference cycle keeps a dropped engine's graphs.)"""
        return CUDA_KERNELS[kernel].builds(device, *key)

    @property
    def last_timings(self):
        """Seconds of the last generate()'s condition encoder, prefill and decode (compile and capture left out);
        {} before the first. Reading it waits for the GPU: generate() itself does not."""
        return self.marks.seconds() if self.marks else {}

    @property
    def last_speculation(self):
        """The last speculative generate()'s passes per image, image tokens per pass (the first token, drawn from the
        prefill, left out) and the passes the batch ran (until its last image was done); {} without. Reading it waits
        for the GPU."""
        if self.passes is None:
            return {}
        passes = self.passes.tolist()
        return dict(passes=passes, tokens_per_pass=self.passes_tokens * len(passes) / max(sum(passes), 1),
                    batch_passes=self.batch_passes)

    def explain(self, batch, num_tokens, cfg=True, top_p=1.0, sample_logits=True):
        """The plan of a shape, in words (fast_engine.py --explain)."""
        prefix = self.model.args.prefix_len
        return plans.explain(plans.make(self.situation(batch, cfg, top_p, sample_logits, prefix + num_tokens)))

    # ---- building the step for a shape ---------------------------------------------------------

    def _runner_for(self, batch, num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                    keep_logits):
        r = self.runner
        want = (num_tokens, prefix_len, num_controls, cfg, top_k, top_p, sample_logits,
                self.model.tok_embeddings.weight.dtype, keep_logits)
        mine = r is not None and self.model.layers[0].attention.kv_cache is r.cache
        if mine and r.key()[1:] == want and r.batch >= batch:
            return r  # a smaller batch is padded up to the captured one
        if r is not None:
            log.info("new shape (batch %d, %d tokens): building new caches and graphs", batch, num_tokens)
        self.runner, self.graphs = None, Graphs()  # a new pool (prepare()'s graph is captured again at its next image)
        self.model.clear_caches()
        p = plans.make(self.situation(batch, cfg, top_p, sample_logits, prefix_len + num_tokens))
        self.plan = p
        log.info("decode plan for %d rows: block %s, attention %s, draw %s (--explain prints it all)", p.guided.rows,
                 plans.describe_rows(p, p.guided)["block"], p.guided.attention, p.draw)
        if p.jacobi is None:
            r = ShapeRunner(self.model, p, num_tokens, prefix_len, num_controls, top_k, keep_logits)
        else:
            tree = p.jacobi.tree  # the asked (or chosen) tree, unless the plan runs the chain (p.chain_instead)
            runner, extra = (TreeRunner, (tree,)) if tree else (JacobiRunner, ())
            r = runner(self.model, p, num_tokens, prefix_len, num_controls, top_k, keep_logits, self.draft_init,
                       grid_width(num_tokens), p.situation.draft_coupling, *extra)
        self._wire(r, p)
        self._compile(r, p)
        self.runner = r
        return r

    def _wire(self, r, p):
        """The plan's kernels into the runner: its inputs, per kind of step the model's Context and the head, the
        draw, the prefetcher and the text partial's table."""
        if p.prefetch != "none":
            r.prefetcher = prefetch_triton.Prefetcher(self.model, compiled=p.prefetch == "compiled")
        step_ops, head_ops = eager_ops(p.step_ops or plans.EagerOps()), eager_ops(p.step_ops or p.eager)
        for guided, rows in r.rows_plan.items():
            r.contexts[guided] = Context(ops=step_ops, attention=self._attention(rows, r), block=self._block(p, rows, r),
                                         block_adds_control=p.block == "fused")
            if p.head == "fused":
                noise = (r.noise, r.input_pos, r.seed) if p.head_noise else None
                r.heads[guided] = functools.partial(block_triton.logits, self.model, noise=noise, pdl=rows.head.pdl,
                                                    dot=rows.head.impl == "triton_dot")
            else:
                r.heads[guided] = functools.partial(self.model.logits, ops=head_ops)
        r.prefill_ctx = Context(ops=eager_ops(p.prefill_ops), kv_len=min(-(-r.prefix_len // 8) * 8,
                                                                          self.model.max_seq))
        if p.inputs == "triton":
            r.inputs_fn = functools.partial(inputs_triton.step_inputs, pdl=p.inputs_pdl)
        elif p.inputs == "cuda":
            r.inputs_fn = inputs_cuda.step_inputs
        if p.draw == "triton":
            r.draw_fn = functools.partial(draw_triton.draw, pdl=EARLY if p.draw_pdl else False)
        elif p.draw == "cuda":
            r.draw_fn = draw_cuda.draw
        if p.text_sums == "triton":
            r.text_table = attention_triton.text_table([layer.attention.kv_cache for layer in self.model.layers])
        if r.prefetcher is not None:  # a schedule per row count the steps run at
            for rows in {rows.rows: rows for rows in r.rows_plan.values()}.values():
                r.prefetcher.prepare(rows.rows, r.input_pos, rows.prefetch_down)
        if p.jacobi is not None:
            self._wire_pass(r, p.jacobi)

    def _wire_pass(self, r, j):
        """The speculative pass's blocks and head (inductor's compiled block and head, or the eager model's), and the
        window kernels where the plan takes them."""
        ops = eager_ops(j.ops)
        block = (functools.partial(fused_block, rows=j.rows) if j.block == "fused" else
                 self.compiled_block() if j.block == "compiled" else None)
        attention = window_attention(j)
        if j.prefetch:  # the layer's later weights into L2 while its window attention runs (inside the pass's graph)
            r.pass_prefetcher = prefetch_triton.Prefetcher(self.model, compiled=True)
            r.pass_prefetcher.prepare(r.pass_rows, r.input_pos)
            attention = functools.partial(attention, progress=r.pass_prefetcher.progress)
        r.pass_ctx = Context(ops=ops, block=block, block_adds_control=j.block == "fused", attention=attention)
        r.pass_inputs = inputs_triton.window_inputs if j.inputs == "triton" else None
        r.verify = verify_triton if j.verify == "triton" else None
        if j.head == "compiled":
            r.pass_head = self.compiled_head()
        else:
            r.pass_head = functools.partial(self.model.logits, ops=ops)

    def _attention(self, rows, r):
        """The decode attention kernel of steps at the plan's Rows, bound to its form and launch (None: SDPA)."""
        if rows.attention.startswith("sdpa"):
            return None
        if rows.attention.startswith("cuda"):
            return functools.partial(attention_cuda.decode_attention, loop=rows.attention == "cuda_loop")
        kw = dict(whole=rows.attention == "triton_whole", config=rows.attention_config, pdl=rows.attention_pdl)
        if rows.merge_pdl is not None:
            kw["merge_pdl"] = rows.merge_pdl
        if rows.progress:
            kw["progress"] = r.prefetcher.progress
        return functools.partial(attention_triton.decode_attention, **kw)

    def _block(self, p, rows, r):
        """The model's Context.block of steps at the plan's Rows (None: the model's own eager blocks)."""
        if p.block == "fused":
            return functools.partial(fused_block, rows=rows, prefetcher=r.prefetcher)
        if p.block == "layer":
            return functools.partial(run_block, ops=eager_ops(p.step_ops))
        if p.block == "compiled":
            w2 = rows.projection("w2")
            kw = dict(down=w2.impl == "triton_dot_down", down_pdl=w2.pdl)
            if r.prefetcher is not None:
                kw["progress"] = r.prefetcher.progress
            return functools.partial(self.compiled_block(), **kw)
        return None

    def compiled_block(self):
        """Regional compilation: blocks are inlined modules whose weights and caches become graph
        inputs, so one compiled block serves every layer; CUDA graphs are then captured by hand."""
        if self.block_fn is None:  # the first torch.compile imports dynamo and inductor (seconds)
            mode = "max-autotune-no-cudagraphs" if self.compile_mode == "max-autotune" else None
            self.inductor_pdl()
            if self.device.type == "cuda":
                block_triton.tile_counts(self.device)  # for down(): made before tracing, so that it persists
            self.block_fn = compile_static(run_block, mode=mode)
        return self.block_fn

    def compiled_head(self):
        """The final norm and output projection, compiled once (~40 small kernels eager)."""
        if self.compiled_logits is None:
            self.compiled_logits = compile_static(self.model.logits)
        return self.compiled_logits

    def inductor_pdl(self):
        """Inductor's programmatic dependent launch on Hopper+ where the plan's settings allow it: process-wide, as the
        compile cache folder (its compile workers read the environment). Called just before compiling: importing
        inductor takes seconds, and the fused block never needs it."""
        if not plans.inductor_pdl(self.device_pdl):
            return
        import torch._inductor.config

        if hasattr(torch._inductor.config.triton, "enable_pdl"):  # torch >= 2.9
            os.environ["TORCHINDUCTOR_ENABLE_PDL"] = "1"
            torch._inductor.config.triton.enable_pdl = True

    def _compile(self, r, p):
        """What the plan compiles: the prefill (through the compiled block, or whole), the head, or the whole step."""
        self.prefill_fn, self.prefill_compiled = r.prefill, False
        if p.prefill == "compiled_block":  # from a shape's first image: one seed, one image
            r.prefill_ctx = replace(r.prefill_ctx, block=self.compiled_block())
        elif p.prefill == "compiled_whole":
            self.inductor_pdl()
            self.prefill_fn = compile_static(r.prefill)
        self.step_fns = {(guided, w): r.step_fn(guided, w) for guided in (True, False) for w in range(len(r.kv_lens))}
        if p.head == "compiled":  # the final norm and output projection (~40 small kernels eager)
            r.heads = dict.fromkeys(r.heads, self.compiled_head())
        elif p.head == "compiled_finish":  # with CFG merge, top-k and the draw; fallback_random: eager's random stream
            r.finish_fn = compile_static(ShapeRunner.finish, options={"fallback_random": True})
        if p.step == "compiled_step":
            self.inductor_pdl()
            compile_kw = dict(mode=self.compile_mode) if self.device.type != "cpu" else {}  # no CUDA graphs on the CPU
            self.step_fns = {key: compile_static(f, **compile_kw) for key, f in self.step_fns.items()}
        self.warm = dict.fromkeys(self.step_fns, False)

    def _run_prefill(self, r, prefix):
        """The prefill, replayed from its graph where the plan captures it, then the first token's draw. A shape's
        first image runs it as it comes (a one-image process would pay the capture, ~2 more prefills, for nothing);
        the second captures it (timed as compile/capture time; the capture runs it once), later ones replay. A prefill
        through the compiled block is timed as compile time at its first call."""
        if "prefill" in self.graphs:
            r.prefix.copy_(prefix)
            self.graphs.replay("prefill")  # its logits: the captured tensor, rewritten
        elif r.capture_prefill and r.prefix is not None:
            t0 = synced(self.device)
            r.prefix.copy_(prefix)
            self.graphs.capture("prefill", lambda: setattr(r, "prefill_logits", self.prefill_fn(r.prefix)), state=r)
            self.compile_seconds += elapsed(t0, self.device)
        elif self.plan.prefill == "compiled_block" and not self.prefill_compiled:
            t0 = synced(self.device)
            r.prefill_logits = self.prefill_fn(prefix)  # compiles the block for the prefill's shape
            self.compile_seconds += elapsed(t0, self.device)
            self.prefill_compiled = True
        else:
            r.prefill_logits = self.prefill_fn(prefix)
            if r.capture_prefill:
                r.prefix = prefix.clone()  # the graph's input from the next image on
        r.first_token(r.prefill_logits)

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
            self.graphs.drop("prepare")
            self.conditions = dict(key=key)
            return run(*inputs)
        if "prepare" not in self.graphs:
            t0 = synced(self.device)
            c["inputs"] = [None if t is None else t.clone() for t in inputs]
            self.graphs.capture("prepare", lambda: c.update(outputs=run(*c["inputs"])))
            self.compile_seconds += elapsed(t0, self.device)
        else:
            for static, t in zip(c["inputs"], inputs):
                if t is not None:
                    static.copy_(t)
            self.graphs.replay("prepare")
        return c["outputs"]

    def _run_step(self, r, key):
        """One decode step of kind key = (guided, window); the first call of each kind is timed as
        compile/capture time."""
        if self.warm[key]:
            if self.hand_capture:
                self.graphs.replay(key)
            else:
                self.step_fns[key]()
            return
        t0 = synced(self.device)
        if self.hand_capture:
            self.graphs.capture(key, self.step_fns[key], state=r)
        else:
            # reduce-overhead records its graph on the first calls; run them on a saved state.
            saved = snapshot(r)
            for _ in range(3 if self.device.type == "cuda" else 1):
                restore(r, saved)
                self.step_fns[key]()
            restore(r, saved)
            self.step_fns[key]()
        self.compile_seconds += elapsed(t0, self.device)
        self.warm[key] = True

    def _run_pass(self, r):
        """One speculative pass: replayed from its graph where the plan captures it; the first is timed as
        compile/capture time (where nothing is captured it runs once on a saved state first: the compiles)."""
        key = ("pass",)
        if key in self.graphs:
            self.graphs.replay(key)
            return
        if self.warm.get(key) or (self.plan.jacobi.block == "model" and not self.plan.jacobi.graph):
            r.run_pass()  # nothing to compile or capture
            return
        t0 = synced(self.device)
        if self.plan.jacobi.graph:
            self.graphs.capture(key, r.run_pass, state=r)
        else:
            saved = snapshot(r)
            r.run_pass()
            restore(r, saved)
            r.run_pass()
        self.compile_seconds += elapsed(t0, self.device)
        self.warm[key] = True

    def _decode_jacobi(self, r, B):
        """Passes until every image has its tokens: as many as the fewest possible (every draft accepted), then
        again for what the slowest image still lacks; one host sync per round, none per pass."""
        r.start()
        todo, self.batch_passes = -(-(r.num_tokens - 1) // r.window), 0
        while todo > 0:
            for _ in range(todo):
                self._run_pass(r)
            self.batch_passes += todo
            todo = -(-(r.num_tokens - int(r.n[:B].min())) // r.window)
        self.passes, self.passes_tokens = r.passes[:B].clone(), r.num_tokens - 1

    def continuous(self, batch, num_tokens, prefix_len, num_controls, cfg):
        """A server's batch of `batch` image slots whose rows sit at their own positions (continuous.py), wired as its
        plan's own_positions entry says. It takes the model's caches: the engine's runner, if any, is dropped."""
        self.runner, self.graphs, self.conditions = None, Graphs(), None
        self.model.clear_caches()
        s = replace(self.situation(batch, cfg, 1.0, True, prefix_len + num_tokens), own_positions=True)
        p = self.plan = plans.make(s)
        r = ContinuousRunner(self.model, p, num_tokens, prefix_len, num_controls)
        own = p.own_positions
        r.ctx = Context(ops=eager_ops(own.ops), block=self.compiled_block() if own.block == "compiled" else None,
                        attention=None if own.attention == "decode" else window_attention(own))
        r.fused_rows, r.prefetch_rows = own.fused_rows, own.prefetch_rows
        # the plain steps' L2 prefetcher up to prefetch_rows: paced by the fused block's projections up to the fused
        # rows, by the compiled block's decode attention (and down kernel) above; a schedule per step size
        prefetched = [R for R in (b * r.halves for b in own.buckets) if R <= own.prefetch_rows]
        for compiled in {R > own.fused_rows for R in prefetched}:
            r.prefetchers[compiled] = prefetch_triton.Prefetcher(self.model, compiled=compiled)
        for R in prefetched:
            r.prefetcher_at(R).prepare(R, r.input_pos, down=R in own.down_rows)  # down_rows are past the fused
        progress = lambda R: r.prefetcher_at(R).progress if own.fused_rows < R <= own.prefetch_rows else None
        if own.attention == "decode":  # the plain steps' decode attention in the form of each step size's rows,
            # launched as the fused block's projections around it (the GEMVs under PDL, as the plain steps')
            pdl = lambda R: plans.pass_rows(R, own.pdl, own.gemv_pdl).projection("qkv").pdl if R <= own.fused_rows else 0
            r.step_attention = lambda R: decode_attention_at(R, pdl(R), progress(R))
        r.inputs_fn = inputs_triton.window_inputs if own.inputs == "triton" else None
        if own.fused_rows:  # steps at up to these rows on the fused block's kernels (server_block=fused)
            rows = lambda R: plans.pass_rows(R, own.pdl, own.gemv_pdl)
            r.fused_block = lambda R: functools.partial(fused_block, rows=rows(R), prefetcher=r.prefetcher_at(R))
        if own.down_rows:  # inductor's block with w2 + residual as block_triton's down kernel, as the plain steps'
            r.down_rows = own.down_rows
            r.down_block = lambda R: functools.partial(self.compiled_block(), down=True, down_pdl=own.down_pdl,
                                                       progress=progress(R))
        if own.head == "compiled":
            r.head = self.compiled_head()
        else:
            r.head = functools.partial(self.model.logits, ops=eager_ops(own.ops))
        # the prefill as fast_engine.py's: the same cache length read, so a request's first token is the same
        r.prefill_ctx = Context(ops=eager_ops(p.prefill_ops), kv_len=min(-(-prefix_len // 8) * 8, self.model.max_seq))
        return r

    # ---- generation ----------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, cond, max_new_tokens, emb_masks=None, cfg_scale=1.0, cfg_interval=-1, condition=None,
                 control_strength=1.0, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True, forced=None):
        """Tokens (B, N). `forced` (B, N): feed these tokens instead of the sampled ones (teacher
        forcing, for tests); the logits of every step are then returned too."""
        if condition is None:
            raise ValueError("ControlAR needs a control image (condition) for every sample")
        if self.drafts.window and (cfg_interval > -1 or forced is not None):
            raise ValueError("speculative decoding runs with guidance at every token (cfg_interval -1), not forced")
        B = cond.shape[0]
        marks = Marks(self.device)
        compile_before = self.compile_seconds
        p = self._prepare(cond, condition, emb_masks, cfg_scale, control_strength)
        marks.mark("condition", self.compile_seconds - compile_before)

        t0 = time.perf_counter()  # a new shape: caches and compile set-up (imports dynamo the first time)
        cfg = cfg_scale > 1.0
        T, num_controls = p.prefix.shape[1], p.controls.shape[2]
        r = self._runner_for(B, max_new_tokens, T, num_controls, cfg, top_k, top_p, sample_logits, forced is not None)
        self.compile_seconds += time.perf_counter() - t0
        p = pad_rows(p, B, r.batch, cfg)
        r.key_valid.copy_(p.key_valid(self.model.max_seq))
        r.controls.copy_(p.controls)
        r.cfg_scale.fill_(float(cfg_scale))
        r.temperature.fill_(max(float(temperature), 1e-5))
        if r.draw_fn is not None:  # from torch's generator: torch.manual_seed fixes the images
            r.seed.copy_(torch.randint(0, 2**62, (), device=self.device))

        marks.mark(None)  # the new shape's set-up above is compile time
        compile_before = self.compile_seconds
        self._run_prefill(r, p.prefix)
        marks.mark("prefill", self.compile_seconds - compile_before)
        logits = [r.logits.clone()] if forced is not None else None
        compile_before = self.compile_seconds
        self.passes = None
        passes = r.plan.jacobi is not None  # else plain steps: the plan's plain_instead (the pass measured a loss)
        for i in range(max_new_tokens - 1 if not passes else 0):
            if forced is not None:
                r.token[:B].copy_(forced[:, i : i + 1])
            guided = cfg and not (-1 < cfg_interval < i)
            self._run_step(r, (guided, r.window(i)))
            if forced is not None:
                logits.append(r.logits[: (2 * r.batch if guided else r.batch)].clone())
        if passes:
            self._decode_jacobi(r, B)
        tokens = r.out[:B].clone()
        marks.mark("decode", self.compile_seconds - compile_before)
        self.marks = marks
        if forced is not None:
            return tokens, [unpad_logits(l, B, r.batch) for l in logits]
        return tokens


def grid_width(num_tokens):
    """The token grid's width of a square image of num_tokens tokens (None for another shape)."""
    w = math.isqrt(num_tokens)
    return w if w * w == num_tokens else None


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
