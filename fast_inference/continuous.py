"""A server's batch: one shape's rows at their own positions, so that requests join at any step boundary and leave
when their tokens are done (continuous batching, as vLLM serves LlamaGen).

A slot is one image: its CFG rows side by side (row 2i the conditional, 2i + 1 the unconditional; row i without
CFG), so the first b slots are the first rows and a step over them is a step at b images. A request takes
consecutive slots. Joining runs its prefill into its rows of the running batch's caches (the model's Context.rows)
and draws its first token; a step runs the blocks and the head over the first `bucket` slots, each row at its own
position (the model's per-row positions, as a speculative pass), then the draw. Everything a slot's tokens depend on
is its own: its prefix, control rows, text mask, positions, settings (cfg scale, temperature, top-k, top-p, one per
slot, as sampling.py takes them) and its request's random stream, drawn as fast_engine.py draws its images for the
request's seed: where the plan takes the Triton draw (`keyed`), draw_triton's race keyed by a Philox key the request's
generator makes once, at the counter of the image's place in its request (draw_triton.draw_images, inside the step's
graph); else, and for top-p < 1 (which fast_engine.py draws with sampling.py's ops), the Exp(1) noise its own
generator makes, (n, V) per token. The same seed gives fast_engine.py's images, whatever shares the batch.

A join (prepare(), the prefill, the first token's draw) reads its slot from a buffer and draws in staging slots past the
batch's, so where the plan captures steps it is captured too: per number of images and what prepare() bakes in, as
it comes the first time, captured the second, replayed after (as the plain engine's prefill).
"""
from dataclasses import dataclass, replace
from typing import Optional

import torch

from fast_inference.generate import prepare
from fast_inference.graphs import Graphs
from fast_inference.kernels import draw_triton
from fast_inference.kernels.prefetch_triton import run_beside
from fast_inference.runner import ShapeRunner
from fast_inference.sampling import cfg_merge, sample


class ContinuousRunner(ShapeRunner):
    """A shape's static buffers for `batch` image slots whose rows sit at their own positions; join, step, leave and
    move run on the device without a host sync. The Engine wires its Context, head and graphs (Engine.continuous)."""

    STATE = ("logits",)  # what a step's capture warm-up changes besides the caches (it rewrites the same keys)
    KEYED_STATE = ("logits", "token", "input_pos", "out", "slot_token", "slot_pos")  # and where the draw is inside
    # what a request's slots hold besides its rows (move and join copy them)
    SLOT_BUFFERS = ("out", "cfg_scale", "temperature", "slot_top_k", "slot_top_p", "slot_seed", "slot_image",
                    "slot_images", "slot_k")
    JOIN_KEYS = 16  # join keys kept (with their graphs), the least recently used dropped: a key per control strength

    def __init__(self, model, plan, num_tokens, prefix_len, num_controls):
        super().__init__(model, plan, num_tokens, prefix_len, num_controls, top_k=0, keep_logits=False)
        B, V, device = self.batch, model.args.vocab_size, self.out.device
        self.halves = 2 if self.cfg else 1
        R = B * self.halves
        S = 2 * B  # the slots' buffers: B slots, then B staging slots, where a joining request draws its first token
        buf = lambda name, t: self.register_buffer(name, t, persistent=False)
        buf("token", torch.zeros(R, 1, dtype=torch.long, device=device))  # each row's last token
        buf("input_pos", torch.full((R, 1), prefix_len, dtype=torch.long, device=device))  # and its position
        buf("live", torch.zeros(R, 1, dtype=torch.long, device=device))  # 1 where the row's request decodes
        buf("out", torch.zeros(S, num_tokens, dtype=torch.long, device=device))
        buf("cfg_scale", torch.ones(S, 1, device=device))
        buf("temperature", torch.ones(S, 1, device=device))
        buf("slot_top_k", torch.zeros(S, 1, dtype=torch.long, device=device))
        buf("slot_top_p", torch.ones(S, 1, device=device))
        buf("noise", torch.ones(S, V, device=device))  # each slot's Exp(1) draws, made by its request's generator
        buf("one_query", torch.ones(1, dtype=torch.long, device=device))  # the window kernel's mask: its own key
        # keyed draws (draw_triton.draw_images): each slot's Philox key, its image's place in its request, its k
        self.keyed = plan.own_positions.draw == "keyed"
        buf("slot_seed", torch.zeros(S, dtype=torch.long, device=device))
        buf("slot_image", torch.zeros(S, dtype=torch.int32, device=device))
        buf("slot_images", torch.ones(S, dtype=torch.int32, device=device))
        buf("slot_k", torch.full((S,), V, dtype=torch.int32, device=device))
        buf("slot_token", torch.zeros(S, 1, dtype=torch.long, device=device))  # the draw's tokens, one per slot
        buf("slot_pos", torch.zeros(S, dtype=torch.long, device=device))  # the position each slot's draw is at
        # a join's: its first slot (a graph's input), the images' places, the prefix's positions
        buf("join_slot", torch.zeros(1, dtype=torch.long, device=device))
        buf("image_index", torch.arange(B, device=device))
        buf("prefix_pos", torch.arange(prefix_len, device=device))
        if self.keyed:
            self.STATE = self.KEYED_STATE
        self.settings = [None] * B  # per slot on the host: (top_k, top_p), to take the filters' scalar paths
        self.ctx = self.head = None  # the steps' Context and head (Engine.continuous); inputs_fn: window_inputs
        self.fused_rows, self.fused_block = 0, None  # steps at up to fused_rows rows: fused_block(rows) as the block
        self.down_rows, self.down_block = range(0), None  # steps at down_rows rows: down_block(rows), inductor's + down
        self.prefetchers = {}  # the L2 prefetchers beside the steps (server_prefetch), by whether the rows compile
        self.prefetch_rows = 0  # steps at up to this many rows run beside one
        self.step_attention = None  # rows -> the decode attention at a position per row, where it replaces ctx's
        self.graphs = Graphs() if plan.own_positions.graph else None
        self.buckets = plan.own_positions.buckets
        self.inputs = {}  # the requests' inputs' static buffers, by their shapes
        self.joined = {}  # join keys run (captured the second time), the least recently used first

    def rows_of(self, slot, n):
        """The cache rows of slots slot..slot+n-1 in prepare()'s order: the conditional rows, then the unconditional.
        slot: a number, or a tensor of one (join_slot)."""
        first = (self.image_index[:n] + slot) * self.halves
        return first if self.halves == 1 else torch.cat([first, first + 1])

    def prefetcher_at(self, rows):
        """The prefetcher of steps at `rows` rows (None: none): the compiled block's past the fused rows, else the fused
        block's. Its key ranges stop at row 0's position, not each row's own: where its budget per row is under
        prefix_len keys (GPT-XL at 32 rows and at 48-64) every range ends inside the prompt's keys anyway; elsewhere
        a row's keys past its filled length are fetched for nothing, or some of its filled ones are not fetched (the
        prefetcher writes nothing the step reads: only the time differs)."""
        return self.prefetchers.get(rows > self.fused_rows) if rows <= self.prefetch_rows else None

    def captures(self, bucket):
        """Whether a step at `bucket` captures its graph now (its first, where the plan captures steps)."""
        return self.graphs is not None and bucket not in self.graphs

    def bucket(self, slots):
        """The step size holding the first `slots` slots."""
        return next(b for b in self.buckets if b >= slots)

    # ---- a request in and out -------------------------------------------------------------------------------------

    def join(self, slot, n, inputs, prepare, key, settings, seed=None):
        """Request into slots slot..slot+n-1: inputs, its tensors (cond, mask or None, control), copied into static
        buffers; prepare(*inputs) -> its generate.Prepared (2n rows under CFG); key: its graph's (join_key); settings
        (cfg_scale, temperature, top_k, top_p), written to the staging slots; its draws: seed (a 0-d int64 tensor) its
        Philox key (keyed), else its first token's Exp(1) draws already in join_noise(n). Runs join_fn, from its graph
        where the plan captures steps (run_join)."""
        static = self.static_inputs(inputs)
        self.stage(slot, n, settings, seed)
        make = lambda: self.join_fn(n, seed is not None, lambda: prepare(*static))
        if self.graphs is None:
            make()()
        else:
            self.run_join(key, make)

    def stage(self, slot, n, settings, seed):
        """A join's inputs besides its tensors: its first slot, its settings in the staging slots (the Philox key and
        k where keyed), and on the host its slots' settings (the steps' filters' number paths)."""
        B = self.batch
        self.join_slot.fill_(slot)
        cfg_scale, temperature, top_k, top_p = settings
        self.cfg_scale[B : B + n] = float(cfg_scale)
        self.temperature[B : B + n] = max(float(temperature), 1e-5)
        self.slot_top_k[B : B + n] = int(top_k)
        self.slot_top_p[B : B + n] = float(top_p)
        if seed is not None:
            self.slot_seed[B : B + n] = seed
            self.slot_k[B : B + n] = draw_triton.image_k(int(top_k), self.noise.shape[1])
        self.settings[slot : slot + n] = [(int(top_k), float(top_p))] * n

    def run_join(self, key, make):
        """The join make() makes, of key: as it comes at the key's first join (a one-request process pays no capture),
        captured at its second, replayed after; the JOIN_KEYS keys last used keep their graphs."""
        if key in self.graphs:
            self.graphs.replay(key)
        elif key in self.joined:
            self.graphs.capture(key, make(), state=self)
        else:
            make()()
        self.joined.pop(key, None)
        self.joined[key] = None
        while len(self.joined) > self.JOIN_KEYS:  # the least recently used key forgotten, its graph dropped
            old = next(iter(self.joined))
            del self.joined[old]
            self.graphs.drop(old)

    @staticmethod
    def join_key(n, keyed, inputs, baked):
        """A join's graph key: its images, whether its draw is keyed, its inputs' shapes and what prepare() bakes in."""
        return ("join", n, keyed, shapes(inputs), *baked)

    def join_captures(self, key):
        """Whether a join of key captures its graph now (its second)."""
        return self.graphs is not None and key in self.joined and key not in self.graphs

    def static_inputs(self, inputs):
        """A request's tensors in the static buffers of their shapes, copied without a host sync (from pinned
        memory: a pageable copy waits for the steps queued before it)."""
        key = shapes(inputs)
        if key not in self.inputs:
            self.inputs[key] = [None if t is None else torch.empty(t.shape, dtype=t.dtype, device=self.out.device)
                                for t in inputs]
        static = self.inputs[key]
        for buffer, t in zip(static, inputs):
            if t is not None:
                pinned = buffer.is_cuda and t.device.type == "cpu"
                buffer.copy_(t.pin_memory() if pinned else t, non_blocking=pinned)
        return static

    def join_noise(self, n):
        """Where a joining request's first token's Exp(1) draws go (its staging slots' noise), (n, V)."""
        return self.noise[self.batch : self.batch + n]

    def join_fn(self, n, keyed, prepare):
        """What a join runs (and its graph holds): prepare() from the static inputs, the prefill into the rows of slots
        join_slot.. (their caches, text masks and control rows), the first token drawn in the staging slots (the
        settings there as tensors, the keyed draw's image places set), their buffers copied to the request's slots,
        its rows' token, position and flag set. Only join_slot's value says where: one graph serves every slot."""
        B, T = self.batch, self.prefix_len
        stage = slice(B, B + n)

        def join():
            p = prepare()
            slots, rows = self.join_slot + self.image_index[:n], self.rows_of(self.join_slot, n)
            key_valid = p.key_valid(self.model.max_seq)
            self.key_valid.index_copy_(0, rows, key_valid)
            self.controls.index_copy_(1, rows, p.controls)
            logits = self.model(p.prefix, self.prefix_pos, key_valid, p.controls, last_only=True,
                                ctx=replace(self.prefill_ctx, rows=rows))[:, -1]
            if keyed:  # as ShapeRunner.first_token: the position whose next token is drawn
                self.slot_image[stage] = self.image_index[:n]
                self.slot_images[stage] = n
                self.slot_pos[stage] = T - 1
                token = self.keyed_draw(logits.contiguous(), B, n)
            else:  # the staging slots have no host settings: the filters' tensor paths (the same bits)
                token = self.draw(logits, B, n, self.noise[stage])
                self.out[stage, 0] = token[:, 0]
            for name in self.SLOT_BUFFERS:
                t = getattr(self, name)
                t.index_copy_(0, slots, t[stage].clone())
            self.token.index_copy_(0, rows, token.repeat(self.halves, 1))
            self.input_pos.index_fill_(0, rows, T)  # token 0 goes in at the first image position
            self.live.index_fill_(0, rows, 1)

        return join

    def leave(self, slot, n):
        """Slots slot..slot+n-1 idle: they stop advancing, at a position every step can still compute."""
        rows = self.rows_of(slot, n)
        self.live[rows] = 0
        self.input_pos[rows] = self.prefix_len
        self.settings[slot : slot + n] = [None] * n

    def move(self, src, dst, n, upto):
        """A request's n slots from src down to dst (dst < src; the ranges may overlap): caches up to position upto,
        rows' and slots' buffers. The batch stays packed at its front, so steps run at the smallest bucket."""
        a, b = self.rows_of(src, n), self.rows_of(dst, n)
        for layer in self.model.layers:
            cache = layer.attention.kv_cache
            cache.k_cache[b, :, :upto] = cache.k_cache[a, :, :upto]
            cache.v_cache[b, :, :upto] = cache.v_cache[a, :, :upto]
        for t in (self.key_valid, self.token, self.input_pos, self.live):
            t[b] = t[a]
        self.controls[:, b] = self.controls[:, a]
        for name in self.SLOT_BUFFERS:
            t = getattr(self, name)
            t[dst : dst + n] = t[src : src + n].clone()
        self.settings[dst : dst + n] = self.settings[src : src + n]

    # ---- a step ---------------------------------------------------------------------------------------------------

    def forward_fn(self, bucket):
        """The blocks and the head over the first `bucket` slots, each row at its position: logits into `logits`. The
        part a CUDA graph captures (the draw reads each request's generator, outside it)."""
        R = bucket * self.halves
        steps_ctx = self.ctx
        if R <= self.fused_rows:  # the fused block's kernels, which add the next block's control rows themselves
            steps_ctx = replace(steps_ctx, block=self.fused_block(R), block_adds_control=True)
        elif R in self.down_rows:
            steps_ctx = replace(steps_ctx, block=self.down_block(R))
        if self.step_attention is not None:  # the plain steps' kernel, each row's position read from input_pos
            steps_ctx = replace(steps_ctx, attention=self.step_attention(R))
        windowed = self.step_attention is None and steps_ctx.attention is not None
        prefetcher = self.prefetcher_at(R)

        def blocks_and_head():
            ctx = steps_ctx
            if self.inputs_fn is None:
                x = self.model.tok_embeddings(self.token[:R])
            else:  # each row's embedding, RoPE row and control rows in one kernel (window_inputs)
                x, inputs = self.inputs_fn(self.model, self.token[:R], self.input_pos[:R], self.controls, False)
                ctx = replace(ctx, inputs=inputs)
            if windowed:  # the window kernel, one query per row: its position is its filled keys
                ctx = replace(ctx, window=(self.input_pos[:R].view(R), self.one_query.expand(R, 1)))
            h = self.model.blocks(x, self.input_pos[:R], self.key_valid[:R], self.controls[:, :R], last_only=True,
                                  ctx=ctx)
            self.logits[:R].copy_(self.head(h)[:, -1])

        # weights and keys into L2 ahead of the kernels that read them, beside the step: inside its graph only
        return lambda: run_beside(prefetcher, R, blocks_and_head)

    def step_fn(self, bucket):
        """What a step's graph holds: the forward, and where the draws are keyed the draw, the tokens written and
        the positions advanced too (no host call per request)."""
        forward = self.forward_fn(bucket)
        if not self.keyed:
            return forward

        def step():
            forward()
            R = bucket * self.halves
            self.slot_pos[:bucket].copy_(self.input_pos[: R : self.halves].view(bucket))
            token = self.keyed_draw(self.cfg_first(self.logits[:R]), 0, bucket)
            self.token[:R].copy_(token.repeat_interleave(self.halves, 0))
            self.input_pos[:R] += self.live[:R]

        return step

    def cfg_first(self, logits):
        """Logits of rows in slot order -> [conditional; unconditional], as prepare() orders them."""
        return torch.cat([logits[0::2], logits[1::2]]) if self.halves == 2 else logits

    def step(self, bucket):
        """One token for every live slot among the first `bucket` (their noise made first, in `noise`, unless keyed):
        the forward (replayed from its graph where the plan captures one), the draw, tokens written, positions
        advanced. Keyed: all of it in step_fn (its graph); a request drawing with its generator redraws then."""
        R = bucket * self.halves
        if self.graphs is None:
            self.step_fn(bucket)()
        elif bucket in self.graphs:
            self.graphs.replay(bucket)
        else:
            self.graphs.capture(bucket, self.step_fn(bucket), state=self)
        if self.keyed:
            return
        token = self.draw(self.cfg_first(self.logits[:R]), 0, bucket, self.noise[:bucket])
        at = (self.input_pos[: R : self.halves] - self.prefix_len + 1).clamp(0, self.num_tokens - 1)
        self.out[:bucket].scatter_(1, at, token)  # idle slots write their own rows only
        self.token[:R] = token.repeat_interleave(self.halves, 0)
        self.input_pos[:R] += self.live[:R]

    def keyed_draw(self, logits, slot, n):
        """Logits (2n or n rows, conditional first) of slots slot..slot+n-1 -> their tokens (n, 1), written to
        `slot_token` and to out at slot_pos: draw_triton's race, each slot keyed by its request (draw_images)."""
        token = self.slot_token[slot : slot + n]
        draw_triton.draw_images(logits, token, self.out[slot : slot + n], self.slot_pos[slot : slot + n],
                                self.slot_seed[slot : slot + n], self.slot_image[slot : slot + n],
                                self.slot_images[slot : slot + n], self.cfg_scale[slot : slot + n],
                                self.temperature[slot : slot + n], self.slot_k[slot : slot + n], self.prefix_len,
                                self.cfg, self.noise[slot : slot + n], self.draws)
        return token

    def redraw(self, slot, n, noise):
        """Keyed steps: slots slot..slot+n-1 of a request that draws with its generator (top-p < 1) take the token of
        this step's logits and noise (n, V), its Exp(1) draws, instead of the keyed draw's."""
        rows = self.rows_of(slot, n)  # conditional rows first
        token = self.draw(self.logits[rows], slot, n, noise)
        at = self.input_pos[rows[:n]] - self.prefix_len  # advanced past the position drawn at
        self.out[slot : slot + n].scatter_(1, at, token)
        self.token[rows] = token.repeat(self.halves, 1)

    def draw(self, logits, slot, n, noise):
        """Logits (rows, V) of slots slot..slot+n-1, conditional rows first -> their tokens (n, 1): the CFG merge and
        sampling.py's filters and race with each slot's settings and the given noise. Settings all slots share are
        passed as numbers (the filters' one-setting paths; the same bits)."""
        logits = logits.float()
        if self.cfg:
            logits = cfg_merge(logits, self.cfg_scale[slot : slot + n])
        live = {s for s in self.settings[slot : slot + n] if s is not None}
        top_k, top_p = live.pop() if len(live) == 1 else (self.slot_top_k[slot : slot + n],
                                                          self.slot_top_p[slot : slot + n])
        return sample(logits, self.temperature[slot : slot + n], top_k, top_p, race=True, noise=noise)


def shapes(tensors):
    return tuple(None if t is None else (t.shape, t.dtype) for t in tensors)


@dataclass(eq=False)
class Request:
    """What a request's images depend on: its inputs and settings (serve.py checks them). cond: caption embeddings
    (1, T, C) with mask (1, T), or a class label (1,) with mask None; control (3, H, W) in [-1, 1]."""
    cond: torch.Tensor
    mask: Optional[torch.Tensor]
    control: torch.Tensor
    condition_type: str = "hed"
    num_images: int = 1
    seed: int = 0
    cfg_scale: float = 4.0
    temperature: float = 1.0
    top_k: int = 2000
    top_p: float = 1.0
    control_strength: float = 1.0

    @property
    def num_tokens(self):
        return (self.control.shape[1] // 16) * (self.control.shape[2] // 16)

    @property
    def shape(self):
        """What decides the batch it can join: the token grid and whether CFG doubles its rows."""
        return self.control.shape[1], self.control.shape[2], self.cfg_scale > 1.0


@dataclass(eq=False)
class Entry:
    """A request in a batch: its first slot, its tokens done (the first drawn at its prefill) and its generator (None
    where its draws are keyed: the step's own)."""
    request: Request
    slot: int
    done: int
    generator: Optional[torch.Generator]

    @property
    def finished(self):
        return self.done >= self.request.num_tokens


def inputs(request):
    return request.cond, request.mask, request.control


class Batch:
    """One engine's running batch of one shape: requests in consecutive slots packed at the front, each with its
    own random stream (a key or a generator); admit at a step boundary, step, remove (the ones after it move down)."""

    def __init__(self, engine, shape, capacity):
        H, W, cfg = shape
        tokens = (H // 16) * (W // 16)  # the control grid has as many tokens as the image
        self.engine, self.shape, self.capacity = engine, shape, capacity
        self.runner = engine.continuous(capacity, tokens, engine.model.args.prefix_len, tokens, cfg)
        self.entries = []  # in slot order
        self.used = 0

    def fits(self, request):
        return request.shape == self.shape and self.used + request.num_images <= self.capacity

    @torch.no_grad()
    def admit(self, request):
        """Prefill a request into the next free slots and draw its first token -> its Entry. A request of one token is
        finished here: take its tokens and remove it before the next step."""
        r, n, device = self.runner, request.num_images, self.runner.out.device
        generator = torch.Generator(device).manual_seed(request.seed)  # fast_engine.py's torch.manual_seed(seed)
        seed = None
        if self.keyed(request):  # the key Engine.generate draws first from torch's generator
            seed = torch.randint(0, 2**62, (), generator=generator, device=device)
            generator = None
        else:
            r.join_noise(n).exponential_(1, generator=generator)
        settings = (request.cfg_scale, request.temperature, request.top_k, request.top_p)
        r.join(self.used, n, inputs(request), self.preparer(request), self.join_key(request), settings, seed)
        entry = Entry(request, self.used, 1, generator)
        self.entries.append(entry)
        self.used += n
        return entry

    def keyed(self, request):
        """Whether a request's draws are keyed (else its generator's: top-p < 1, as fast_engine.py's torch draw)."""
        return self.runner.keyed and request.top_p >= 1.0

    def preparer(self, request):
        """prepare() of a request's inputs (cond, mask, control) for its n images, as fast_engine.py prepares them:
        each prompt num_images times. A graph keeps it: it holds only what join_key holds (and cfg_scale, which
        prepare() reads as > 1 only: the batch's)."""
        model, n, cfg_scale = self.engine.model, request.num_images, request.cfg_scale
        strength, kind = request.control_strength, request.condition_type

        def make(cond, mask, control):
            mask = None if mask is None else mask.repeat_interleave(n, 0)
            return prepare(model, cond.repeat_interleave(n, 0), control[None].expand(n, -1, -1, -1), mask, cfg_scale,
                           strength, kind)

        return make

    def join_key(self, request):
        """The graph key of a request's join; prepare() bakes in its condition type and control strength (cfg: the
        batch's)."""
        return self.runner.join_key(request.num_images, self.keyed(request), inputs(request),
                                    (request.condition_type, float(request.control_strength)))

    def admit_captures(self, request):
        """Whether admitting request now captures its join's CUDA graph."""
        return self.runner.join_captures(self.join_key(request))

    @torch.no_grad()
    def step(self):
        """One token for every request in the batch -> the entries whose tokens are all done (still in the batch)."""
        r = self.runner
        if any(e.finished for e in self.entries):  # a step would write its last token again, past its end
            raise RuntimeError("a finished request is still in the batch; remove it before the next step")
        drawn = [e for e in self.entries if e.generator is not None]  # each from its own generator
        if not r.keyed:
            for e in drawn:
                r.noise[e.slot : e.slot + e.request.num_images].exponential_(1, generator=e.generator)
        r.step(r.bucket(self.used))
        if r.keyed:  # top-p < 1: sampling.py's draw over its generator's noise, in place of the keyed draw's token
            for e in drawn:
                n = e.request.num_images
                r.redraw(e.slot, n, torch.empty(n, r.noise.shape[1], device=r.out.device).exponential_(
                    1, generator=e.generator))
        for e in self.entries:
            e.done += 1
        return [e for e in self.entries if e.finished]

    @torch.no_grad()
    def warm(self, request):
        """Every step size's compiles and CUDA graph, and request's join's, before the first real request (a server's
        start: met later under load, each stalls the batch): copies of request admitted one at a time up to the
        capacity, a step after each (at buckets 1, 2, 4, ... the capacity), then all removed, the last first. What
        joins later is as in a fresh batch: a join rewrites its rows, and a step reads the occupied slots' only."""
        while self.used + request.num_images <= self.capacity:
            self.admit(request)
            if any(e.finished for e in self.entries):  # a request this short has nothing to warm past here
                break
            self.step()
        for e in self.entries[::-1]:
            self.remove(e)

    def captures(self):
        """Whether the next step captures a CUDA graph (its bucket's first)."""
        return self.runner.captures(self.runner.bucket(self.used))

    def tokens(self, entry):
        """A request's tokens (n, N), a copy."""
        return self.runner.out[entry.slot : entry.slot + entry.request.num_images].clone()

    @torch.no_grad()
    def remove(self, entry):
        """A request out (done or cancelled), the batch packed again and its last n slots idle: the last request moves
        into its slots where it has as many images (one move of 2 x layers cache slices, not one per later request),
        else the requests after it move down."""
        r, n = self.runner, entry.request.num_images
        self.entries.remove(entry)
        later = [e for e in self.entries if e.slot > entry.slot]
        if later and later[-1].request.num_images == n:  # the last request fills the hole: one move
            moves = [(later[-1], entry.slot)]
        else:  # the requests after it move down
            moves = [(e, e.slot - n) for e in later]
        for e, dst in moves:
            r.move(e.slot, dst, e.request.num_images, r.prefix_len + e.done)  # the filled positions
            e.slot = dst
        self.entries.sort(key=lambda e: e.slot)
        self.used -= n
        r.leave(self.used, n)
