"""The decode plan: which implementation runs each operation of a step and of the prefill.

This module is the ONE place that chooses. `make` takes the situation (backend and its settings, the device and
what builds on it, the model's shapes and dtype, int8, top-p, the rows the steps run at) and returns a `Plan` that
names, for each operation, one implementation of kernels/ (or torch's op, or inductor's compiled code), with the
launch settings (PDL) that go with it. The engine only executes a plan; the kernels consult no globals and no
environment. `explain` prints a plan (`fast_engine.py --explain`); `table` is docs/decode_plan.md's backend x rows
table.

Overrides (A/Bs, and what the FAST_* switches once did) are plan fields set by name: `--plan KEY=VALUE` on the
command lines, or CONTROLAR_PLAN="KEY=VALUE,KEY=VALUE" in the environment (OVERRIDES lists them; a value the
situation cannot run is refused with the valid ones). Each rule below keeps its measured reason in one line;
the measurements are in docs/PERF_NOTES.md.
"""
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from fast_inference.kernels import (attention_cuda, attention_triton, block_cuda, block_triton, draw_cuda,
                                    eager_ops_cuda)
from fast_inference.kernels.pdl import EARLY, FIRST, LATE
from fast_inference.speculative import DEFAULT_COUPLING, DEFAULT_INIT, DEFAULT_WINDOW

ENV = "CONTROLAR_PLAN"
BACKENDS = ("inductor", "cudagraph", "eager")
COMPILE_SCOPES = ("step", "block")

NONE = 0  # a kernel without PDL; kernels/pdl.py's EARLY, LATE and FIRST say when the next kernel may launch

# ---- the rules' constants, each with its reason (docs/PERF_NOTES.md has the runs) --------------------------------
FUSED_ROWS = 16  # the fused block up to here; the compiled block from 17 rows (faster there from 32: #14)
GEMV_ROWS = 4  # the fused block's projections as GEMVs (rows in registers) up to here, tensor-core dots above (#7-#14)
DOT_ALWAYS = ("output",)  # float head weights take the dot path at any row count (n = 1 0.970 -> 0.966 ms/step, #64)
DOWN_ROWS = 64  # the compiled block's w2 + residual as the dot path's kernel up to here (n = 32 3.09 -> 3.05, #41)
DOWN_PDL = True  # ... launched under PDL's late trigger (n = 32 2.775 -> 2.756 ms/step, #47)
GEMV_PDL = FIRST  # GEMVs let the next kernel launch before their wait (n = 1 0.966 -> 0.948 ms/step, #65)
GEMV_PDL_INT8 = EARLY  # ... but int8 GEMVs after it (FIRST lost: 0.913 -> 0.930 ms/step, #65)
MERGE_PDL = True  # the split attention's merge under PDL's late trigger on the dot path (n = 8 1.515 -> 1.507, #46)
CUDA_PROJECTIONS = ("gate_up",)  # block_cuda's GEMVs beside Triton's: gate/up gains (n = 1 0.940 -> 0.916), the
# others lost next to Triton's FIRST launch (qkv 1.113, wo 1.016, w2 1.017 ms/step; #67)
CUDA_FIRST_ROWS = 2  # with no Triton, block_cuda's kernels launch FIRST up to here (n = 1 1.358 -> 1.294, #70), else
# EARLY (FIRST lost at 4 rows: 1.879 -> 1.930, and beside Triton's kernels: n = 1 1.137 -> 1.184 ms/step, #67)
WHOLE_ROWS = range(64, 97)  # the attention's one-program-per-(row, head) form (n = 32 2.729 -> 2.647-2.675; lost at
# 32 rows, 2.132 -> 2.410, and from 112: #48, #54)
CUDA_LOOP_ROWS = 4  # attention_cuda stages whole slices up to here, loops over them above (#76-#78)
CACHE_WINDOWS = 8  # SDPA without a decode attention kernel reads one of 8 static windows of the cache (ebb74cb)
WINDOW_KERNELS = True  # rows at their own positions (a pass, a server's step): a pass beat SDPA's at n = 1-32 (#75)
PASS_FUSED_ROWS = 32  # window_block=fused up to here (the dot path's rows in registers, built for sm_90 unspilled)
# the window attention's splits folded into one launch (attention_triton.window_attention, fold): a row of one split
# writes its output, of several its last split merges them; the same key bytes as a split per tile + the merge kernel,
# one launch fewer: a pass 2.16 -> 2.06 ms at n = 1, 3.22 -> 2.82 at n = 8 on an H100 (PERF_NOTES, "folded")
WINDOW_FOLD = True
VERIFY_KERNELS = True  # a pass's verify in verify_triton's kernels: faster than speculative.py's ops at n = 1, 8 (#75)
# --speculative jacobi's tok/s over plain steps as measured on an H200 (GPT-XL 512 px, 3 nats, L = 16, left drafts,
# gumbel coupling; tools/pass_ab.py), by (the window kernels on, images); a batch takes the largest measured n at or
# below its own.
# Where it is under 1 the pass loses and the plan runs plain steps instead (the `jacobi=on` override runs it anyway).
PASS_GAINS = {(False, 1): 1.20, (False, 8): 0.96, (True, 1): 1.43, (True, 8): 1.43}
# --draft-tree's tok/s over plain steps on an H100 (GPT-XL 512 px, 3 nats, pathwise, 4x3+2x3 at 48; n = 1 with
# tree_ops=triton and verify=triton, bench.py over whole images, a pass 2.31 plain steps; n = 8 before both, 7.15), by
# images as PASS_GAINS; where it is under 1 the plan runs the chain of the same window instead (`draft_tree=on` keeps
# the tree)
TREE_GAINS = {1: 2.20, 8: 0.62}


@dataclass(frozen=True)
class Drafts:
    """A speculative pass's drafts: the window (positions per pass), the redraws' coupling (speculative.COUPLINGS)
    and the draft tree (draft_tree.parse_tree's tuple; (): a chain)."""
    window: int
    coupling: str
    tree: tuple
    auto: bool = False  # the draft flags were all left out: make() picks MEASURED_TREE or this chain (choose_drafts)


# --speculative jacobi's drafts with the draft flags left out (choose_drafts): MEASURED_TREE, the configuration
# TREE_GAINS measured (--draft-window 48 --draft-coupling pathwise --draft-tree 4x3+2x3), where it beats the chain's
# PASS_GAINS at the batch and runs as measured; else CHAIN, the chain PASS_GAINS measured (and the earlier default)
CHAIN = Drafts(DEFAULT_WINDOW, DEFAULT_COUPLING, ())
MEASURED_TREE = Drafts(48, "pathwise", (4, 3, 2, 3))

# Where one operation keeps two kernels, and why (the cudagraph backend is the mission's backend without Triton):
#   attention  Triton (split-KV, whole) | CUDA C++ without Triton (n = 1 1.46 -> 1.34 ms/step over SDPA, #69, #77)
#   block      Triton | CUDA C++: gate/up beside Triton's (n = 1 0.940 -> 0.916, #67), all four without Triton (#74)
#   draw       Triton | CUDA C++ without Triton (sampling.py's ~20 kernels a step, #69); torch's for top-p and the CPU
#   inputs     Triton | CUDA C++ without Triton (the model's ~13 kernels a step); the model's ops on the CPU
#   eager ops  Triton | CUDA C++ without Triton (the eager prefill's ~850 small kernels, #61); torch's in compiled code
#   VQ norms   Triton | torch's without Triton (4.5 of a 512 px decode's 9.4 ms, #40)
#   own rows   the window kernels (attention, inputs; a pass's and a server's rows) beside the plain steps' one-position
#              kernels: the window forms at L = 1 are not yet timed against those in one run (tools/server_step.py:
#              a server's step against the plain step at n = 1, 8, 32, owed to a GPU), so the plain steps keep theirs


@dataclass(frozen=True)
class Situation:
    """What the plan is made from."""
    backend: str = "inductor"  # BACKENDS
    compile_scope: str = "block"  # COMPILE_SCOPES (inductor)
    fused_block: bool = True  # inductor, block scope: the fused kernels up to FUSED_ROWS rows
    compile_prefill: bool = False
    device: str = "cpu"  # cpu | cuda
    capability: Optional[tuple] = None  # (major, minor) of a CUDA device
    triton: bool = True  # Triton importable
    interpret: bool = False  # Triton's CPU interpreter (TRITON_INTERPRET=1)
    dtype: torch.dtype = torch.float32  # the model's activations
    int8: bool = False  # quantize.py's weights
    top_p: float = 1.0
    sample: bool = True  # sample_logits (greedy argmax if False)
    cfg: bool = True
    batch: int = 1  # images; the steps run at 2 x batch rows under CFG, at batch after cfg_interval
    dim: int = 1280
    n_head: int = 20
    ffn_hidden: int = 3584
    vocab_size: int = 16384
    max_seq: int = 1144  # prefix + image tokens
    text_prefix: bool = True  # the prefix's RoPE rows are zero (the decode attention takes the text as one partial)
    builds: Callable = field(default=lambda kernel, *key: True, compare=False)  # (CUDA C++ kernel, key) built?
    overrides: tuple = ()  # ((key, value), ...): OVERRIDES
    draft_window: int = 0  # speculative Jacobi passes over this many positions (speculative.py); 0: plain steps
    draft_tree: tuple = ()  # (width, depth[, side, side depth]): each pass a draft tree (draft_tree.py); (): a chain
    draft_coupling: str = DEFAULT_COUPLING  # the redraws' noise (speculative.COUPLINGS)
    draft_init: str = DEFAULT_INIT  # the initial drafts (speculative.DRAFT_INITS)
    auto_drafts: bool = False  # the draft flags were left out: the plan picks the drafts (choose_drafts)
    own_positions: bool = False  # each row at its own position: a server's batch (continuous.py)

    @property
    def head_dim(self):
        return self.dim // self.n_head

    @property
    def rows(self):
        return 2 * self.batch if self.cfg else self.batch

    @property
    def cuda(self):
        return self.device == "cuda"

    @property
    def pdl(self):
        """PDL exists: sm_90+, not in the interpreter."""
        return self.cuda and not self.interpret and self.capability[0] >= 9

    @property
    def nvrtc(self):
        """kernels/*_cuda.py may run: sm_90+ (bulk copies, PDL); whether NVRTC builds them is `builds`."""
        return self.pdl


@dataclass(frozen=True)
class Projection:
    impl: str  # cuda | triton_gemv | triton_dot | triton_dot_down (compiled block's w2) | inductor
    pdl: int = NONE


@dataclass(frozen=True)
class Rows:
    """What steps over `rows` rows run: the fused block's projections, the attention's form and launch."""
    rows: int
    projections: tuple = ()  # ((name, Projection), ...)
    attention: str = "sdpa"  # sdpa | sdpa_windows | triton_split | triton_whole | cuda | cuda_loop
    attention_config: tuple = ()  # the Triton form's (BLOCK, warps, merge warps) or (BLOCK, warps, stages)
    attention_pdl: int = NONE
    merge_pdl: Optional[int] = None  # None: as the partial kernel
    progress: bool = False  # the attention counts for the compiled block's prefetcher
    prefetch_down: bool = False  # the compiled block's w2 counts too
    head: Optional[Projection] = None  # the fused head's tiling and launch

    def projection(self, name):
        return dict(self.projections)[name]


@dataclass(frozen=True)
class EagerOps:
    """The eager model's element-wise ops: torch's, or one kernel each (kernels/eager_ops_*)."""
    rms_norm: str = "torch"  # torch | cuda
    silu_mul: str = "torch"  # torch | triton | cuda
    rope: str = "torch"  # torch | triton | cuda | attention (the decode attention kernel rotates and writes the cache)


@dataclass(frozen=True)
class JacobiPass:
    """How a speculative pass runs (speculative.py): 2 x images x window query rows at their own positions, so the
    one-query decode kernels (fused block, decode attention, inputs, draw) do not serve it; SDPA with the mask does, or
    the window kernels (attention and inputs, each row's L queries at their own positions) where the plan takes them."""
    window: int  # L: the last accepted token and L - 1 drafts per image
    nodes: int  # query rows per image: L, or a draft tree's nodes (draft_tree.py), which take as many spare cache slots
    block: str  # compiled (inductor's block, the compiled steps' own) | model (eager blocks) | fused (the fused
    # block's Triton kernels at the pass's rows, each query's RoPE and cache write in QKV: `rows`)
    head: str  # compiled | model
    ops: EagerOps  # the eager blocks' element-wise kernels (RoPE: torch's, per row)
    graph: bool  # the whole pass one CUDA graph, captured by hand
    attention: str = "sdpa"  # sdpa (each row's mask over the cache) | triton (attention_triton.window_attention)
    inputs: str = "model"  # model (the embedding; RoPE and control rows gathered by the model) | triton (window_inputs)
    rows: Optional[Rows] = None  # the fused block's projections at the pass's rows (block fused)
    splits: str = "fold"  # attention triton: fold (one launch, window_tiles' splits) | merge (a split per tile + merge)
    verify: str = "torch"  # torch (speculative.py's ops over (images, L, V)) | triton (kernels/verify_triton.py)
    tree: tuple = ()  # the draft tree the passes walk (Situation.draft_tree, unless the plan runs the chain instead)
    tree_ops: str = "torch"  # a tree's compact and window noise: torch (draft_tree's ops) | triton (tree_triton)
    prefetch: bool = False  # the L2 prefetcher beside the pass, paced by the window attention (choose_pass_prefetch)


@dataclass(frozen=True)
class OwnPositions:
    """How a server's steps run (continuous.py): each image's rows at their own position, as requests join a running batch
    and leave it. The one-query decode kernels (fused block, decode attention, inputs, draw) take one position for all
    rows, so these steps run SDPA with each row's mask (or the window kernels), as a speculative pass does. The draw:
    keyed where the plan draws with Triton (draw_triton.draw_images in the step's graph, each request's Philox key made
    by its generator once), else out of the graph from each request's own generator; either way a request's images are
    fast_engine.py's with the same seed."""
    block: str  # compiled (inductor's block) | model (eager blocks)
    head: str  # compiled | model
    ops: EagerOps  # the eager blocks' element-wise kernels (RoPE: torch's, per row)
    graph: bool  # each bucket's step (blocks and head) one CUDA graph, captured by hand
    buckets: tuple  # the image counts steps run at: the smallest that holds every occupied slot
    attention: str = "sdpa"  # as JacobiPass's, at a window of one query per row; or decode (server_attention)
    inputs: str = "model"
    splits: str = "fold"  # as JacobiPass's
    fused_rows: int = 0  # steps at up to this many rows run the fused block's kernels (pass_rows), inductor's above
    pdl: int = NONE  # their dot projections' PDL mode (pass_pdl: the override window_block_pdl)
    gemv_pdl: bool = False  # their GEMV projections under PDL (pass_gemv_pdl)
    down_rows: range = range(0)  # steps at these rows on inductor's block: w2 + residual in block_triton's down
    down_pdl: int = NONE  # its launch, as the plain steps' (serves_down)
    draw: str = "generator"  # generator (sampling.py's ops, each request's Exp(1) noise) | keyed (draw_images)
    prefetch_rows: int = 0  # steps at up to this many rows run the plain steps' L2 prefetcher beside them


@dataclass(frozen=True)
class Plan:
    situation: Situation
    step: str  # hand_graph | compiled_step | eager
    inputs: str  # model | triton | cuda
    inputs_pdl: bool
    block: str  # model | layer (eager blocks without the residual folding) | compiled | fused
    cuda_block: bool  # the fused block with block_cuda's kernels alone (no Triton)
    head: str  # model | fused | compiled | compiled_finish (with the draw: no draw kernel)
    draw: str  # torch | triton | cuda
    draw_pdl: bool
    head_noise: bool  # the fused head makes the draw's race noise
    prefetch: str  # none | fused | compiled
    text_sums: str  # none | triton | torch
    windows: int
    prefill: str  # eager | eager_graph (captured from a shape's second image) | compiled_block | compiled_whole
    eager: EagerOps  # the backend's eager ops (the model's head where it runs eagerly)
    prefill_ops: EagerOps
    step_ops: Optional[EagerOps]  # where the steps run the model's (or a layer's) eager ops
    vq_norm: str  # torch | triton
    guided: Rows  # the steps' rows (both CFG halves)
    unguided: Optional[Rows]  # after cfg_interval: the conditional half (None without CFG)
    jacobi: Optional[JacobiPass] = None  # speculative passes instead of the steps (draft_window > 0)
    plain_instead: str = ""  # why plain steps run where --speculative jacobi was asked (the pass measured a loss)
    chain_instead: str = ""  # why the chain runs where --draft-tree was asked (the tree's pass measured a loss)
    drafts_chosen: str = ""  # which drafts the plan picked, and why, where the draft flags were left out
    own_positions: Optional[OwnPositions] = None  # a server's steps, rows at their own positions

    def rows(self, r):
        return self.guided if r == self.guided.rows else self.unguided


class PlanError(ValueError):
    """An override the situation cannot run; the message names the valid values."""


# ---- overrides ----------------------------------------------------------------------------------------------------

OVERRIDES = dict(
    attention=("sdpa", "triton", "cuda"),  # the decode attention (FAST_SMEM_ATTENTION=0 was attention=sdpa)
    cuda_projections=("none", "gate_up", "all"),  # which fused-block projections run block_cuda's kernels
    draw=("torch", "triton", "cuda"),  # FAST_CUDA_DRAW=0 was draw=torch on the cudagraph backend
    inputs=("model", "triton", "cuda"),  # FAST_CUDA_INPUTS=0 was inputs=model
    eager_ops=("torch", "triton", "cuda"),  # FAST_CUDA_OPS=0 was eager_ops=torch on the cudagraph backend
    prefetch=("on", "off"),
    vq_norm=("torch", "triton"),
    down_pdl=("on", "off"),
    merge_pdl=("on", "off"),
    window_attention=("sdpa", "triton"),  # a pass's and a server step's attention (WINDOW_KERNELS)
    window_inputs=("model", "triton"),  # ... and their inputs
    window_splits=("fold", "merge"),  # the window attention in one launch, or a split per tile + merge (WINDOW_FOLD)
    window_block=("compiled", "fused"),  # a pass's block: inductor's, or the fused kernels at its rows (with the above)
    window_block_pdl=("gemv", "off", "late", "first"),  # the fused block at own positions (a pass, a server step):
    # its GEMVs under PDL (gemv), nothing under it (off), or its dots too (late, first)
    server_block=("compiled", "fused"),  # a server step's block up to FUSED_ROWS rows: inductor's, or the fused kernels
    server_attention=("decode", "window"),  # a server step's attention: the plain steps' decode attention at a
    # position per row (split-KV, or a program per (row, head) at WHOLE_ROWS; SERVER_DECODE), or the window kernel
    server_down=("on", "off"),  # a server step's w2 + residual past FUSED_ROWS rows: the down kernel, or inductor's
    server_prefetch=("auto", "off", "on"),  # the plain steps' L2 prefetcher beside a server's steps: auto, the fused
    # block's steps only (SERVER_PREFETCH); on, every step size; off, none
    verify=("torch", "triton"),  # a pass's verify: speculative.py's ops, or verify_triton's kernels (VERIFY_KERNELS)
    jacobi=("auto", "on"),  # --speculative jacobi: plain steps where the pass measured a loss (PASS_GAINS), or always
    draft_tree=("auto", "on"),  # --draft-tree: the chain where the tree's pass measured a loss (TREE_GAINS), or always
    tree_ops=("torch", "triton"),  # a tree pass's compact and window noise: torch's ops, or tree_triton's two kernels
    pass_prefetch=("off", "on"),  # the plain steps' L2 prefetcher beside a pass on inductor's block (PASS_PREFETCH)
)


def parse_overrides(text):
    """"key=value,key=value" (or a list of "key=value") -> ((key, value), ...), checked against OVERRIDES."""
    items = text if isinstance(text, (list, tuple)) else [t for t in (text or "").split(",") if t.strip()]
    out = []
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in OVERRIDES:
            raise PlanError(f"unknown plan override {item!r}; use KEY=VALUE with KEY one of {', '.join(OVERRIDES)}")
        if value not in OVERRIDES[key]:
            raise PlanError(f"plan override {key}={value}: use one of {', '.join(OVERRIDES[key])}")
        out.append((key, value))
    return tuple(out)


def environment_overrides():
    """CONTROLAR_PLAN's overrides (the one environment variable the plan reads)."""
    return parse_overrides(os.environ.get(ENV, ""))


def interpreting():
    """Triton's CPU interpreter is on (tests): no PDL, no bulk prefetch."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def inductor_cache_dir(default):
    """The compile cache folder: TORCHINDUCTOR_CACHE_DIR where set, else ours."""
    return os.environ.get("TORCHINDUCTOR_CACHE_DIR", default)


def inductor_pdl(device_pdl):
    """Whether inductor's kernels launch with PDL: on Hopper+ (n = 32 3.58 -> 3.38 ms/step, #18) unless
    TORCHINDUCTOR_ENABLE_PDL=0."""
    return device_pdl and os.environ.get("TORCHINDUCTOR_ENABLE_PDL", "1") == "1"


# ---- the plan -----------------------------------------------------------------------------------------------------

def make(s: Situation) -> Plan:
    """The plan of situation s. Raises PlanError for an override s cannot run."""
    want = dict(s.overrides)
    if s.backend not in BACKENDS:
        raise PlanError(f"unknown backend {s.backend!r}; use one of {', '.join(BACKENDS)}")
    if s.backend == "cudagraph" and not s.cuda:
        raise PlanError("--backend cudagraph needs a CUDA device; use --backend eager or inductor on CPU")
    if s.int8 and s.backend == "inductor" and s.compile_scope == "step":
        raise PlanError("int8 weights run with compile_scope 'block'")
    block_scope = s.backend == "inductor" and s.compile_scope == "block"
    hand_capture = s.cuda and (s.backend == "cudagraph" or block_scope)
    # Triton's kernels where the inductor backend runs on CUDA (the cudagraph backend promises no Triton)
    triton_ok = s.backend == "inductor" and s.triton and s.cuda
    if want.get("attention") == "triton" and not triton_ok:
        raise PlanError("plan override attention=triton needs the inductor backend on a CUDA device with Triton")
    block, cuda_block = "model", False
    attention = "triton" if triton_ok and want.get("attention") != "sdpa" else "sdpa"
    fused = (block_scope and s.fused_block and triton_ok and s.rows <= FUSED_ROWS
             and block_triton.fits(s.head_dim, dot=s.rows > GEMV_ROWS))
    if fused:
        block = "fused"  # up to 16 rows the fused kernels beat the compiled block, and need no compiler
    elif block_scope and s.int8:
        block = "layer"  # inductor turns int8 projections into slow kernels: eager blocks past the fused rows
    elif block_scope:
        block = "compiled"
    elif s.backend == "cudagraph" and cuda_projections(s, want):
        block, cuda_block = "fused", True  # no Triton: all four projections in CUDA C++
    if s.backend == "cudagraph":
        attention = "cuda" if cuda_attention(s, want) else "sdpa"
    if want.get("attention") == "cuda" and attention != "cuda":
        raise PlanError("plan override attention=cuda needs the cudagraph backend on sm_90+ with NVRTC, bf16 weights "
                        "and a head dim of 64, 128 or 256")
    prefetch = "none"
    if want.get("prefetch") != "off" and s.triton and s.pdl:  # bulk L2 prefetch: sm_90+ (#34, #35)
        prefetch = "fused" if block == "fused" and not cuda_block else "compiled" if (
            block == "compiled" and attention == "triton") else "none"
    draw = choose_draw(s, want, triton_ok)
    windows = CACHE_WINDOWS if s.backend in ("cudagraph", "eager") and attention == "sdpa" else 1
    inputs = choose_inputs(s, want, block_scope and triton_ok)
    compiled_steps = block == "compiled"
    prefill_block = block_scope and not s.int8 and (compiled_steps or s.compile_prefill)
    prefill = ("compiled_block" if prefill_block else
               "compiled_whole" if s.backend == "inductor" and s.compile_prefill else
               "eager_graph" if hand_capture else "eager")
    if block == "fused" and not cuda_block:
        head = "fused"  # the final norm fused into the output projection
    elif compiled_steps:
        head = "compiled" if draw != "torch" else "compiled_finish"
    else:
        head = "model"
    eager = choose_eager_ops(s, want)
    prefill_ops = (EagerOps() if prefill == "compiled_whole" else
                   EagerOps(rope=eager.rope) if prefill == "compiled_block" else eager)
    step_ops = None
    rotates = "attention" if attention != "sdpa" else None
    if s.backend == "inductor" and s.compile_scope == "step" or block == "compiled":
        step_ops = EagerOps(rope=rotates or "torch")  # traced: inductor fuses them itself
    elif block in ("model", "layer"):
        step_ops = dataclasses.replace(eager, rope=rotates or eager.rope)
    text = attention != "sdpa" and s.text_prefix  # the text's zero keys as one partial (#45)
    text_sums = "none" if not text else "triton" if attention == "triton" else "torch"
    guided = step_rows(s, want, s.rows, s.rows, block, cuda_block, attention, prefetch, draw)
    unguided = step_rows(s, want, s.batch, s.rows, block, cuda_block, attention, prefetch, draw) if s.cfg else None
    drafts_chosen = ""
    if s.auto_drafts and s.draft_window:
        s, drafts_chosen = choose_drafts(s, want)
    window = window_kernels(s, want) if s.draft_window or s.own_positions else None
    chain_instead = tree_loses(s, want)
    if chain_instead:  # the pass as the same window's chain
        s = dataclasses.replace(s, draft_tree=())
        window = window_kernels(s, want)
    jacobi = jacobi_pass(s, block_scope, hand_capture, eager, window, want) if s.draft_window else None
    plain_instead = pass_loses(s, want, jacobi)
    if plain_instead:
        jacobi = None
    if s.own_positions:  # a server's steps replace the plain ones; its prefills write rows inside the batch
        own = own_positions(s, eager, window, want, draw)
        prefill, prefill_ops, text_sums, windows, prefetch = "eager", dataclasses.replace(eager, rope="torch"), \
            "none", 1, "none"
    return Plan(own_positions=own if s.own_positions else None, jacobi=jacobi, plain_instead=plain_instead,
                chain_instead=chain_instead, drafts_chosen=drafts_chosen,
                situation=s, step="hand_graph" if hand_capture else "compiled_step" if s.backend == "inductor"
                and not block_scope else "eager", inputs=inputs, inputs_pdl=inputs == "triton" and s.pdl,
                block=block, cuda_block=cuda_block, head=head, draw=draw, draw_pdl=draw == "triton" and s.pdl,
                head_noise=head == "fused" and draw == "triton" and s.sample, prefetch=prefetch,
                text_sums=text_sums, windows=windows, prefill=prefill, eager=eager, prefill_ops=prefill_ops,
                step_ops=step_ops,
                vq_norm=vq_norm(s.backend, s.cuda, s.triton, want), guided=guided, unguided=unguided)


def window_kernels(s, want):
    """(attention, inputs, a pass's block) of rows at their own positions, L queries each (a pass, a server's step):
    the window kernels where Triton runs on CUDA (not the cudagraph backend) and they fit, off by default
    (WINDOW_KERNELS) and taken by the overrides window_attention=triton, window_inputs=triton (window_block=fused:
    jacobi_pass); else SDPA with each row's mask and the model's inputs."""
    ok = s.triton and s.cuda and s.backend != "cudagraph"
    fits = ok and attention_triton.window_fits(s.head_dim, max(pass_nodes(s), 1))
    attention = want.get("window_attention", "triton" if WINDOW_KERNELS and fits else "sdpa")
    inputs = want.get("window_inputs", "triton" if WINDOW_KERNELS and ok else "model")
    if attention == "triton" and not fits:
        raise PlanError("plan override window_attention=triton needs Triton on a CUDA device (not the cudagraph "
                        f"backend), a power-of-two head dim of at least 16 and a window of at most "
                        f"{attention_triton.MAX_WINDOW}; use window_attention=sdpa")
    if inputs == "triton" and not ok:
        raise PlanError("plan override window_inputs=triton needs Triton on a CUDA device (not the cudagraph backend); "
                        "use window_inputs=model")
    splits = want.get("window_splits", "fold" if WINDOW_FOLD else "merge")
    return attention, inputs, want.get("window_block", "compiled"), splits


def jacobi_pass(s, block_scope, hand_capture, eager, window, want):
    """The speculative pass: through inductor's compiled block and head in one captured graph on the inductor
    backend (block scope), eager on the eager backend; the cudagraph backend (CUDA C++ one-query kernels) has none."""
    if s.backend == "cudagraph" or (s.backend == "inductor" and not block_scope):
        raise PlanError("--speculative jacobi runs on --backend inductor (compile scope block) or --backend eager")
    if s.draft_window < 2:
        raise PlanError(f"--draft-window {s.draft_window}: a pass needs at least 2 positions")
    compiled = block_scope and not s.int8  # inductor turns int8 projections into slow kernels (as the steps)
    nodes = pass_nodes(s)
    if s.draft_tree:
        width, depth, side, side_depth = (s.draft_tree + (0, 0))[:4]
        if not (width >= 1 and 1 <= depth < s.draft_window):
            raise PlanError(f"--draft-tree {width}x{depth}: a width of at least 1 and a depth of 1 to --draft-window - 1")
        words = tree_words(s.draft_tree)
        if len(s.draft_tree) > 2 and not (side >= 1 and side_depth >= 1 and side + side_depth < s.draft_window):
            raise PlanError(f"--draft-tree {words}: side branches SxE need S and E of at least 1 and S + E below "
                            f"--draft-window")
        if nodes > 63:
            raise PlanError(f"--draft-tree {words} with --draft-window {s.draft_window}: {nodes} rows per image, the "
                            f"window's mask holds 63; use a smaller window or tree")
    block, rows = "compiled" if compiled else "model", None
    if window[2] == "fused":
        if not (compiled and window[0] == "triton" and block_triton.fits(s.head_dim, dot=True)):
            raise PlanError("plan override window_block=fused needs the inductor backend's block scope on a CUDA "
                            "device with Triton, float weights, a head dim the fused block takes and "
                            "window_attention=triton")
        # up to the rows where a chain measured it faster (a tree's nodes alike, each key at its node's slot): a
        # tree's 126 rows at n = 1 took 4.29 ms against inductor's 2.40 (PERF_NOTES, "Twelfth session")
        if s.rows * nodes <= PASS_FUSED_ROWS:
            block, rows = "fused", pass_rows(s.rows * nodes, pass_pdl(s, want), pass_gemv_pdl(s, want))
    return JacobiPass(window=s.draft_window, nodes=nodes, block=block, head="compiled" if compiled else "model",
                      ops=EagerOps() if compiled else dataclasses.replace(eager, rope="torch"), graph=hand_capture,
                      attention=window[0], inputs=window[1], rows=rows, splits=window[3],
                      verify=choose_verify(s, want), tree=tuple(s.draft_tree), tree_ops=choose_tree_ops(s, want),
                      prefetch=choose_pass_prefetch(s, want, block, window[0]))


# The plain steps' L2 prefetcher beside a pass on inductor's block: each layer's wo, gate/up, w2 and the next layer's
# qkv pulled into L2 while its window attention runs (16 us a layer at n = 1 with the bus at 13%, PERF_NOTES
# "Fourteenth session"), for cuBLAS's GEMMs at the pass's rows; off until a GPU A/B measures it
PASS_PREFETCH = False


def choose_pass_prefetch(s, want, block, attention):
    """Whether the prefetcher runs beside a pass: PASS_PREFETCH, or the override pass_prefetch=on|off; it paces itself
    by the Triton window attention's count of each layer, beside inductor's block on sm_90+ (bulk L2 prefetch)."""
    can = block == "compiled" and attention == "triton" and s.pdl
    chosen = want.get("pass_prefetch", "on" if PASS_PREFETCH and can else "off") == "on"
    if chosen and not can:
        raise PlanError("plan override pass_prefetch=on needs inductor's block and the Triton window attention on a "
                        "CUDA GPU of sm_90 or later; use pass_prefetch=off")
    return chosen


def choose_tree_ops(s, want):
    """A tree pass's compact and window noise: tree_triton's two kernels where Triton runs on CUDA (one launch for what
    took 144 at GPT-XL's 36 layers, and one for about 50; not timed on a GPU yet), else draft_tree.py's ops; the
    override tree_ops=torch|triton for an A/B."""
    ok = s.triton and s.cuda
    chosen = want.get("tree_ops", "triton" if ok and s.draft_tree else "torch")
    if chosen == "triton" and not ok:
        raise PlanError("plan override tree_ops=triton needs Triton on a CUDA device; use tree_ops=torch")
    return chosen


def choose_verify(s, want):
    """A pass's verify: verify_triton's kernels where Triton runs on CUDA (VERIFY_KERNELS), chains and draft trees
    alike (a tree's pass at n = 1: 2.357 ms against 2.504 with torch's ops, PERF_NOTES "Eleventh session"), or the
    override verify=torch; top-p (a sorted cumulative sum) keeps speculative.py's ops."""
    ok = s.triton and s.cuda and s.top_p >= 1.0
    chosen = want.get("verify", "triton" if VERIFY_KERNELS and ok else "torch")
    if chosen == "triton" and not ok:
        raise PlanError("plan override verify=triton needs Triton on a CUDA device and top-p 1; use verify=torch")
    return chosen


def pass_gain(s, window_kernels):
    """PASS_GAINS' measured gain for s's images (the largest measured n at or below it), or None (none measured)."""
    measured = sorted(n for on, n in PASS_GAINS if on == window_kernels and n <= s.batch)
    return PASS_GAINS[(window_kernels, measured[-1])] if measured else None


def pass_loses(s, want, jacobi):
    """Why plain steps replace the pass ("" where it runs): on a CUDA device (the GPU measured it; the CPU has no
    table) where PASS_GAINS says the pass lost, unless the override jacobi=on asks for it."""
    if jacobi is None or want.get("jacobi", "auto") == "on" or not s.cuda or s.interpret:
        return ""
    kernels = jacobi.attention == "triton"
    gain = pass_gain(s, kernels)
    if gain is None or gain >= 1.0:
        return ""
    return (f"plain steps: --speculative jacobi measured {gain:.2f}x the plain engine's tok/s at this batch with the "
            f"window kernels {'on' if kernels else 'off'} (PASS_GAINS; --plan jacobi=on runs the passes anyway)")


def given_drafts(window=None, coupling=None, tree=None):
    """The drafts of --draft-window, --draft-coupling and --draft-tree (None: left out; every entry point's one rule).
    All three left out: the plan's choice (auto; CHAIN until make() runs choose_drafts). Otherwise those given are
    kept and the others are CHAIN's, except that a tree's coupling is pathwise (the one exact coupling for a tree)."""
    if window is None and coupling is None and tree is None:
        return dataclasses.replace(CHAIN, auto=True)
    tree = CHAIN.tree if tree is None else tuple(tree)
    coupling = coupling or ("pathwise" if tree else CHAIN.coupling)
    return Drafts(CHAIN.window if window is None else window, coupling, tree)


def widest_window(drafts):
    """The most positions a pass of these drafts may verify (memory checks, before the batch's plan)."""
    return max(drafts.window, MEASURED_TREE.window) if drafts.auto else drafts.window


def measured_gain(gains, batch):
    """A gain table's entry for the largest measured n at or below batch (None: none measured)."""
    measured = [n for n in gains if n <= batch]
    return gains[max(measured)] if measured else None


def choose_drafts(s, want):
    """(situation, why) where the draft flags were left out (s holds CHAIN): MEASURED_TREE where it runs as measured
    (on a CUDA device with its Triton tree ops and the window kernels, left drafts) and its TREE_GAINS beats the
    chain's PASS_GAINS at this batch (both tables hold n = 1); else the chain."""
    tree = dataclasses.replace(s, draft_window=MEASURED_TREE.window, draft_tree=MEASURED_TREE.tree,
                               draft_coupling=MEASURED_TREE.coupling)
    chain_text = f"the chain of {s.draft_window}, {s.draft_coupling} coupling"
    tree_text = (f"the measured tree {tree_words(MEASURED_TREE.tree)} at {MEASURED_TREE.window}, "
                 f"{MEASURED_TREE.coupling} coupling")
    if (not s.cuda or s.interpret or choose_tree_ops(tree, want) != "triton"
            or window_kernels(tree, want)[0] != "triton"):
        return s, f"{chain_text}: {tree_text} was measured with its Triton tree ops and the window kernels on CUDA"
    if s.draft_init != DEFAULT_INIT:
        return s, f"{chain_text}: {tree_text} was measured with {DEFAULT_INIT} drafts, not {s.draft_init}"
    kernels = window_kernels(s, want)[0] == "triton"
    chain_gain, tree_gain = pass_gain(s, kernels), measured_gain(TREE_GAINS, s.batch)
    gains = (f"the tree measured {tree_gain:.2f}x the plain engine's tok/s at this batch, the chain {chain_gain:.2f}x "
             f"(TREE_GAINS; PASS_GAINS, window kernels {'on' if kernels else 'off'}); draft flags pin the drafts")
    return (tree, f"{tree_text}: {gains}") if tree_gain > chain_gain else (s, f"{chain_text}: {gains}")


def tree_loses(s, want):
    """Why the chain replaces the asked draft tree ("" where the tree runs): on a CUDA device where TREE_GAINS (the
    largest measured n at or below the batch) says the tree's passes lost to plain steps, unless draft_tree=on."""
    if not s.draft_tree or not s.cuda or s.interpret or want.get("draft_tree", "auto") == "on":
        return ""
    gain = measured_gain(TREE_GAINS, s.batch)
    if gain is None or gain >= 1.0:
        return ""
    return (f"the chain: --draft-tree {tree_words(s.draft_tree)} measured {gain:.2f}x the plain engine's tok/s at this "
            f"batch (TREE_GAINS; --plan draft_tree=on runs the tree anyway)")


def pass_nodes(s):
    """A pass's query rows per image: the window, and a draft tree's branches (draft_tree.tree_size; the plan imports
    no runner)."""
    width, depth, side, side_depth = (tuple(s.draft_tree) + (0, 0))[:4] if s.draft_tree else (1, 0, 0, 0)
    return s.draft_window + (width - 1) * depth + side * side_depth


def tree_words(tree):
    """A draft tree as --draft-tree writes it: (4, 3, 11, 2) -> 4x3+11x2 (draft_tree.format_tree)."""
    return "+".join(f"{a}x{b}" for a, b in zip(tree[::2], tree[1::2]))


def pass_rows(rows, pdl=NONE, gemv_pdl=False):
    """The fused block's projections at a pass's rows (or a server step's): Triton's (block_cuda's QKV takes one
    position for every row), GEMV or dot by GEMV_ROWS; the dot path in mode pdl (pass_pdl; NONE: the window attention
    between them launches without it), the GEMV path under PDL in its own mode (GEMV_PDL: weights before the wait)
    where gemv_pdl or pdl says so."""
    impl = "triton_gemv" if rows <= GEMV_ROWS else "triton_dot"
    if impl == "triton_gemv":
        pdl = GEMV_PDL if gemv_pdl or pdl else NONE
    return Rows(rows=rows, projections=tuple((name, Projection(impl, pdl)) for name in PROJECTIONS), attention="triton")


def pass_pdl(s, want):
    """The PDL mode of the fused block's dot projections at rows of their own positions (a pass's, a server step's):
    none, or by the override window_block_pdl=late|first (a pass at n = 1 on an H100: 1.983 -> 1.945 ms, one run; a
    server step at n = 8: 2.153 -> 2.360 ms under first, so not by default: docs/PERF_NOTES.md, "Seventh session")."""
    mode = dict(gemv=NONE, off=NONE, late=LATE, first=FIRST)[want.get("window_block_pdl", "gemv")]
    if "window_block_pdl" in want and want["window_block_pdl"] != "off" and not s.pdl:
        raise PlanError("plan override window_block_pdl=gemv|late|first needs PDL (a CUDA GPU of sm_90 or later); use "
                        "window_block_pdl=off")
    return mode


def pass_gemv_pdl(s, want):
    """Whether the fused block's GEMV projections at their own positions launch under PDL: on sm_90+ unless the
    override window_block_pdl=off (a server step at n = 1 on an H100: 1.539 -> 1.397 ms, "Seventh session")."""
    return s.pdl and want.get("window_block_pdl", "gemv") != "off"


# A server's steps of up to FUSED_ROWS rows on the fused block's kernels: H100, tools/server_step.py, ms/step against
# inductor's block at n = 1 / 8: 1.445 / 1.686 against 1.710 / 1.965 (docs/PERF_NOTES.md, "Sixth session")
SERVER_FUSED = True
# the plain steps' L2 prefetcher beside the fused block's steps (server_prefetch=auto): a step at n = 1 1.106 -> 1.063
# ms, n = 8 1.956 -> 1.818 on an H100; beside inductor's block's at n = 32 3.667 -> 5.722, so not there (PERF_NOTES,
# "Twelfth session")
SERVER_PREFETCH = True
# A server's attention: the plain steps' decode kernels at a position per row, not the window kernel at a query a row
# (H100, ms/step at n = 1 / 8 / 32: 1.111 / 1.978 / 3.748 against 1.397 / 2.153 / 4.486; PERF_NOTES, "Ninth session")
SERVER_DECODE = True
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # a server's step sizes: graphs captured at a few, idle slots computed up to the next


def own_positions(s, eager, window, want, draw):
    """A server's steps: inductor's compiled block and head where it compiles (its steps' own), else the eager blocks
    with the backend's ops and torch's per-row RoPE; one CUDA graph per bucket where the backend captures steps. The
    steps of up to FUSED_ROWS rows run on the fused block's kernels where the window kernels run (SERVER_FUSED; the
    override server_block=compiled keeps inductor's block there). Draws keyed where the plan draws with Triton (a
    request's top-p < 1 keeps its generator, as fast_engine.py's torch draw)."""
    if s.draft_window:
        raise PlanError("a server decodes one token per step; speculative passes run from fast_engine.py")
    compiled = s.backend == "inductor" and not s.int8  # inductor turns int8 projections into slow kernels
    buckets = tuple(b for b in BUCKETS if b < s.batch) + (s.batch,)
    fusable = compiled and window[0] == "triton" and window[1] == "triton" and block_triton.fits(s.head_dim, True)
    fused_rows = 0
    if want.get("server_block", "fused" if SERVER_FUSED and fusable else "compiled") == "fused":
        if not fusable:
            raise PlanError("plan override server_block=fused needs the inductor backend on a CUDA device with Triton, "
                            "float weights, a head dim the fused block takes, window_attention=triton and "
                            "window_inputs=triton; use server_block=compiled")
        fused_rows = FUSED_ROWS
    pdl = pass_pdl(s, want) if fused_rows else NONE
    gemv_pdl = bool(fused_rows) and pass_gemv_pdl(s, want)
    attention = window[0]
    if want.get("server_attention", "decode" if SERVER_DECODE and attention == "triton" else "window") == "decode":
        if attention != "triton":
            raise PlanError("plan override server_attention=decode needs Triton's kernels on a CUDA device "
                            "(window_attention=triton); use server_attention=window")
        attention = "decode"
    down = compiled and serves_down(s, DOWN_ROWS) and want.get("server_down", "on") == "on"
    down_rows = range(FUSED_ROWS + 1, DOWN_ROWS + 1) if down else range(0)
    down_pdl = block_pdl(s, DOWN_ROWS) if down_rows and DOWN_PDL and want.get("down_pdl", "on") == "on" else NONE
    # the prefetcher paces itself by counts: the fused block's projections, or the decode attention's (and the down
    # kernel's) past the fused rows; the window kernel does not count
    prefetch = want.get("server_prefetch", "auto")
    can = attention == "decode" and compiled and s.pdl
    if prefetch == "on" and not can:
        raise PlanError("plan override server_prefetch=on needs the decode attention (server_attention=decode) and "
                        "inductor's block on a CUDA GPU of sm_90 or later with Triton; use server_prefetch=off")
    prefetch_rows = (0 if not can or prefetch == "off" else 2 * max(buckets) if prefetch == "on" else
                     fused_rows if SERVER_PREFETCH else 0)
    return OwnPositions(block="compiled" if compiled else "model", head="compiled" if compiled else "model",
                        ops=EagerOps() if compiled else dataclasses.replace(eager, rope="torch"),
                        graph=s.cuda and s.backend != "eager", buckets=buckets, attention=attention,
                        inputs=window[1], splits=window[3], fused_rows=fused_rows, pdl=pdl, gemv_pdl=gemv_pdl,
                        down_rows=down_rows, down_pdl=down_pdl, draw="keyed" if draw == "triton" else "generator",
                        prefetch_rows=prefetch_rows)


def block_pdl(s, rows):
    """How the fused block's Triton kernels launch at `rows` rows: GEMV_PDL (GEMV_PDL_INT8) on the GEMV path, whose
    weights load before the wait; LATE on the dot path (right after the wait its programs slowed this one, #26)."""
    if not s.pdl:
        return NONE
    if rows > GEMV_ROWS:
        return LATE
    return GEMV_PDL_INT8 if s.int8 else GEMV_PDL


def attention_pdl(s, rows):
    """The Triton attention between the fused block's kernels: with PDL as the GEMV path; without it on the dot path,
    where its PDL data path cost more than the overlap saved (n = 8 1.845 -> 1.794 ms/step, #26)."""
    pdl = block_pdl(s, rows)
    return pdl if pdl in (EARLY, FIRST) else NONE


def merge_pdl(s, rows, want):
    pdl = attention_pdl(s, rows)
    return block_pdl(s, rows) if want.get("merge_pdl", "on") == "on" and MERGE_PDL and not pdl else pdl


def decode_form(rows):
    """The Triton decode attention's (form, config) at `rows` rows: one program per (row, head) in WHOLE_ROWS, else
    split-KV with the merge kernel."""
    if rows in WHOLE_ROWS:
        return "triton_whole", attention_triton.WHOLE
    return "triton_split", attention_triton.config_for(rows)


def step_rows(s, want, rows, guided_rows, block, cuda_block, attention, prefetch, draw):
    """The Rows of steps at `rows` rows. The attention's launch is the guided steps' (one kernel argument for both)."""
    projections, head = (), None
    if block == "fused":
        projections = tuple((name, fused_projection(s, want, name, rows, cuda_block)) for name in
                            ("qkv", "wo", "gate_up", "w2"))
        if not cuda_block:
            gemv = rows <= GEMV_ROWS and ("output" not in DOT_ALWAYS or s.int8)
            head = Projection("triton_gemv" if gemv else "triton_dot", block_pdl(s, rows))
    elif block == "compiled":
        down = serves_down(s, rows)
        w2 = Projection("triton_dot_down", block_pdl(s, rows) if DOWN_PDL and want.get("down_pdl", "on") == "on"
                        else NONE) if down else Projection("inductor")
        projections = (("w2", w2),)
    config, form = (), attention
    if attention == "triton":
        form, config = decode_form(rows)
    elif attention == "cuda":
        form = "cuda_loop" if rows > CUDA_LOOP_ROWS else "cuda"
    elif s.backend in ("cudagraph", "eager"):
        form = "sdpa_windows"
    apdl = mpdl = None
    if attention == "triton" and block == "fused":
        apdl, mpdl = attention_pdl(s, guided_rows), merge_pdl(s, guided_rows, want)
    return Rows(rows=rows, projections=projections, attention=form, attention_config=config,
                attention_pdl=apdl or NONE, merge_pdl=mpdl, progress=prefetch == "compiled",
                prefetch_down=prefetch == "compiled" and serves_down(s, rows), head=head)


def serves_down(s, rows):
    """The compiled block's w2 and residual add as block_triton's dot kernel (`down`): past the fused rows, up to
    DOWN_ROWS, float weights, on CUDA."""
    return s.triton and s.cuda and FUSED_ROWS < rows <= DOWN_ROWS and not s.int8


def fused_projection(s, want, name, rows, cuda_block):
    """The fused block's projection `name` at `rows` rows: block_cuda's kernel where the plan takes it and it fits and
    builds, else Triton's (GEMV or dot)."""
    pdl = block_pdl(s, rows)
    if cuda_block or name in cuda_names(want):
        mode = (FIRST if cuda_block and rows <= CUDA_FIRST_ROWS else EARLY) if pdl else NONE
        adds = (False, True) if name == "w2" else (False,)  # w2 with the control rows too, before blocks L, 2L
        if cuda_projection_fits(s, name, rows) and all(
                s.builds("block_cuda", block_cuda.entry(name, cuda_k(s, name), rows, mode, add)) for add in adds):
            return Projection("cuda", mode)
    gemv = rows <= GEMV_ROWS and (name not in DOT_ALWAYS or s.int8)
    return Projection("triton_gemv" if gemv else "triton_dot", pdl)


PROJECTIONS = ("qkv", "wo", "gate_up", "w2")


def cuda_names(want):
    """The projections of the Triton fused block that block_cuda runs where it can."""
    chosen = want.get("cuda_projections")
    return CUDA_PROJECTIONS if chosen is None else dict(none=(), gate_up=("gate_up",), all=PROJECTIONS)[chosen]


def cuda_k(s, name):
    return s.ffn_hidden if name == "w2" else s.dim


def cuda_projection_fits(s, name, rows):
    """block_cuda runs projection `name` at `rows` rows: sm_90+, bf16 float weights, its tiling fits."""
    cols = dict(qkv=3 * s.dim, wo=s.dim, gate_up=s.ffn_hidden, w2=s.dim)[name]
    fits = block_cuda.fits(name, rows, cuda_k(s, name), cols)
    if name == "qkv":
        fits = fits and block_cuda.fits_heads(s.head_dim)
    return s.nvrtc and not s.int8 and s.dtype == torch.bfloat16 and fits


def cuda_projections(s, want):
    """The cudagraph backend's fused block: every projection in block_cuda at every step row count, each built now,
    before a step is captured (a refusal leaves the eager block whole, not a step half made of these kernels)."""
    if want.get("cuda_projections", "all") != "all":
        return False
    step = sorted({s.rows, s.batch})
    return all(cuda_projection_fits(s, name, r) for name in PROJECTIONS for r in step) and all(
        fused_projection(s, want, name, r, True).impl == "cuda" for name in PROJECTIONS for r in step)


def cuda_attention(s, want):
    """attention_cuda on the cudagraph backend: sm_90+, bf16 weights, its head dims and shared memory, its forms
    built."""
    if want.get("attention") == "sdpa" or not s.nvrtc or s.dtype != torch.bfloat16 or s.int8:
        return False
    step = {s.rows, s.batch}
    if not attention_cuda.fits(s.head_dim, s.n_head, max(step), s.max_seq):
        return False
    return all(s.builds("attention_cuda", s.head_dim, loop) for loop in sorted({r > CUDA_LOOP_ROWS for r in step}))


def choose_draw(s, want, triton_ok):
    """The draw: Triton's where the inductor backend runs Triton, CUDA C++'s on the cudagraph backend; top-p's sorted
    sums stay in sampling.py's ops."""
    asked = want.get("draw")
    if asked == "torch" or s.top_p < 1.0:
        return _granted(asked, "torch", "top-p < 1 draws with sampling.py's ops")
    if triton_ok:
        return _granted(asked, "triton", "")
    if s.backend == "cudagraph" and s.nvrtc and not s.int8 and s.dtype in (torch.bfloat16, torch.float32) \
            and draw_cuda.fits(s.vocab_size) and s.builds("draw_cuda", s.vocab_size, s.dtype):
        return _granted(asked, "cuda", "")
    return _granted(asked, "torch", "")


def _granted(asked, chosen, why):
    if asked is not None and asked != chosen:
        raise PlanError(f"plan override draw={asked} cannot run here ({why or 'the backend or device lacks it'}); "
                        f"this situation draws with {chosen}")
    return chosen


def choose_inputs(s, want, triton_block_scope):
    """The step's inputs (embeddings, RoPE row, control rows) in one kernel where the ops around the blocks run
    eagerly: Triton's in inductor's block scope, CUDA C++'s on the cudagraph backend."""
    asked = want.get("inputs")
    chosen = "model"
    if asked != "model":
        if triton_block_scope:
            chosen = "triton"
        elif s.backend == "cudagraph" and s.nvrtc and s.dtype in (torch.bfloat16, torch.float32) \
                and s.builds("inputs_cuda", s.dtype):
            chosen = "cuda"
    if asked not in (None, chosen):
        raise PlanError(f"plan override inputs={asked} cannot run here; this situation takes inputs={chosen}")
    return chosen


def choose_eager_ops(s, want):
    """The eager model's RoPE + cache write, SiLU x up and RMSNorm: Triton's kernels where Triton may run (not on the
    cudagraph backend, which promises none), else CUDA C++'s where they build (sm_90+, bf16 or float32), else torch's.
    RMSNorm is one kernel in CUDA C++ only: inductor fuses it where it compiles, and torch's fused kernel is close."""
    asked = want.get("eager_ops")
    triton_ok = s.backend != "cudagraph" and s.triton and s.cuda
    cuda_ok = (s.cuda and s.nvrtc and s.dtype in (torch.bfloat16, torch.float32) and not triton_ok
               and s.builds("eager_ops_cuda", s.dtype))
    if asked == "torch" or not (triton_ok or cuda_ok):
        if asked not in (None, "torch"):
            raise PlanError(f"plan override eager_ops={asked} cannot run here; use eager_ops=torch")
        return EagerOps()
    if asked not in (None, "triton" if triton_ok else "cuda"):
        raise PlanError(f"plan override eager_ops={asked} cannot run here; use eager_ops="
                        f"{'triton' if triton_ok else 'cuda'} or torch")
    if triton_ok:
        return EagerOps(rms_norm="torch", silu_mul="triton", rope="triton")
    norm = "cuda" if s.dim <= eager_ops_cuda.MAX_D else "torch"
    return EagerOps(rms_norm=norm, silu_mul="cuda", rope="cuda")


def vq_norm(backend, cuda, triton, want=None):
    """The VQ decoder's GroupNorm, residual adds and upsampling: Triton's kernels on CUDA where Triton may run."""
    asked = (want or {}).get("vq_norm")
    chosen = "triton" if backend != "cudagraph" and triton and cuda else "torch"
    if asked == "torch":
        return "torch"
    if asked not in (None, chosen):
        raise PlanError("plan override vq_norm=triton needs Triton on a CUDA device, not the cudagraph backend")
    return chosen


# ---- explaining ---------------------------------------------------------------------------------------------------

PDL_NAMES = {NONE: "no PDL", EARLY: "PDL early", LATE: "PDL late", FIRST: "PDL first"}


def describe_rows(p, r):
    """{column: text} of the steps at Rows r, in docs/decode_plan.md's table's words."""
    if p.block == "fused":
        kinds = sorted({proj.impl for _, proj in r.projections})
        cuda = [name for name, proj in r.projections if proj.impl == "cuda"]
        if p.cuda_block:
            block = "fused, CUDA C++"
        else:
            block = "fused, Triton " + "/".join(k.split("_")[1] for k in kinds if k.startswith("triton"))
            block += f" + {'/'.join(cuda)} CUDA C++" if cuda else ""
    elif p.block == "compiled":
        block = "compiled" + (" + Triton w2" if r.projection("w2").impl == "triton_dot_down" else "")
    else:
        block = {"model": "eager", "layer": "eager (int8)"}[p.block]
    attention = {"triton_split": "Triton split-KV", "triton_whole": "Triton whole", "cuda": "CUDA C++",
                 "cuda_loop": "CUDA C++ loop", "sdpa": "SDPA", "sdpa_windows": "SDPA, windows"}[r.attention]
    return dict(block=block, attention=attention)


def explain(p):
    """The plan in lines of text (fast_engine.py --explain)."""
    s = p.situation
    cap = f"sm_{s.capability[0]}{s.capability[1]}" if s.cuda else "CPU"
    scope = f", compile scope {s.compile_scope}" if s.backend == "inductor" else ""
    lines = [f"decode plan: backend {s.backend}{scope}; {s.batch} image(s){' under CFG' if s.cfg else ''}, "
             f"{str(s.dtype).replace('torch.', '')}{' int8 weights' if s.int8 else ''} on {cap}"
             + (f", top-p {s.top_p}" if s.top_p < 1 else "")]
    row = lambda name, text: lines.append(f"  {name:<14}{text}")
    row("steps", {"hand_graph": "one CUDA graph per step kind, captured by hand",
                  "compiled_step": "torch.compile of the whole step", "eager": "eager, op by op"}[p.step])
    row("inputs", {"model": "the model's ops", "triton": "one Triton kernel (inputs_triton)",
                   "cuda": "one CUDA C++ kernel (inputs_cuda)"}[p.inputs])
    for label, r in (("guided", p.guided), ("after cfg_interval", p.unguided)):
        if r is None:
            continue
        d = describe_rows(p, r)
        lines.append(f"  {label} steps, {r.rows} rows:")
        row("  block", d["block"])
        for name, proj in r.projections:
            row(f"    {name}", f"{proj.impl}, {PDL_NAMES[proj.pdl]}")
        config = f" {r.attention_config}" if r.attention_config else ""
        launch = f", {PDL_NAMES[r.attention_pdl]}" + (f", merge {PDL_NAMES[r.merge_pdl]}" if r.merge_pdl is not None
                                                        else "") if r.attention.startswith("triton") else ""
        row("  attention", d["attention"] + config + launch + (", counted for the prefetcher" if r.progress else ""))
        if r.head is not None:
            row("  head", f"fused norm + output, {r.head.impl}, {PDL_NAMES[r.head.pdl]}")
    row("head", {"model": "the model's norm and output", "fused": "fused (above)", "compiled": "compiled (inductor)",
                 "compiled_finish": "compiled with the draw (inductor)"}[p.head])
    row("draw", {"torch": "sampling.py's ops", "triton": "two Triton kernels (draw_triton)",
                 "cuda": "one CUDA C++ kernel (draw_cuda)"}[p.draw] + (", noise made by the head" if p.head_noise
                                                                        else ""))
    row("prefetch", {"none": "none", "fused": "L2 prefetch paced by the projections",
                     "compiled": "L2 prefetch paced by the attention"}[p.prefetch])
    row("text partial", p.text_sums)
    if p.windows > 1:
        row("cache windows", str(p.windows))
    ops = describe_ops
    row("prefill", {"eager": "eager", "eager_graph": "eager, a CUDA graph from the shape's second image",
                    "compiled_block": "the compiled block", "compiled_whole": "torch.compile of the whole prefill"}
        [p.prefill] + f"; {ops(p.prefill_ops)}")
    if p.step_ops is not None:
        row("step ops", ops(p.step_ops))
    if p.own_positions is not None:
        row("rows apart", describe_own_positions(p.own_positions))
    if p.jacobi is not None:
        j = p.jacobi
        qkv = j.rows.projection("qkv") if j.block == "fused" else None
        blocks = (f"fused (Triton {qkv.impl.split('_')[1]}{', ' + PDL_NAMES[qkv.pdl] if qkv.pdl else ''})" if qkv else
                  "compiled" if j.block == "compiled" else "eager")
        tree = f" in a {tree_words(s.draft_tree)} draft tree of {j.nodes} nodes" if s.draft_tree else ""
        row("speculative", f"Jacobi passes of {j.window} positions{tree}: {s.rows * j.nodes} rows through the "
            f"{blocks} blocks and {window_words(j)}, inputs "
            f"{INPUT_WORDS[j.inputs]}, {'one CUDA graph' if j.graph else 'op by op'}; {describe_ops(j.ops)}")
        row("verify", VERIFY_WORDS["tree" if j.verify == "triton" and j.tree else j.verify])
        if j.tree:
            row("tree ops", TREE_OPS_WORDS[j.tree_ops])
        if j.prefetch:
            row("pass prefetch", "the L2 prefetcher beside each pass, paced by the window attention's count a layer")
    if p.drafts_chosen:
        row("drafts", p.drafts_chosen)
    if p.plain_instead:
        row("speculative", p.plain_instead)
    if p.chain_instead:
        row("draft tree", p.chain_instead)
    row("VQ norms", p.vq_norm)
    return "\n".join(lines)


WINDOW_WORDS = dict(sdpa="SDPA with each row's mask", triton="the Triton window attention (each row's keys once)",
                    decode="the plain steps' Triton decode attention, a position per row (split-KV, or a program "
                    "per (row, head) at 64-96 rows)")
SPLIT_WORDS = dict(fold="in one launch, its splits merged by each row's last",
                   merge="a split per tile and a merge kernel")


def window_words(p):
    """A pass's or a server step's attention for explain: WINDOW_WORDS, and the Triton form's splits."""
    return WINDOW_WORDS[p.attention] + (f", {SPLIT_WORDS[p.splits]}" if p.attention == "triton" else "")


INPUT_WORDS = dict(model="by the model's ops", triton="in one Triton kernel (window_inputs)")
VERIFY_WORDS = dict(torch="speculative.py's ops over (images, L, V) tensors (CFG, top-k/top-p, softmax, races)",
                    triton="three Triton kernels (verify_triton: CFG, top-k, softmax's sums, the accept test's p, "
                           "the residual race, the redraws and the next window's q; no (images, L, V) temporaries)",
                    tree="one Triton kernel (verify_triton.tree: each node's CFG, top-k, softmax and draw)")


TREE_OPS_WORDS = dict(torch="draft_tree.py's ops (a layer's keys and values moved apart, the noise's hash op by op)",
                      triton="two Triton kernels (tree_triton: every layer's kept keys and values in one launch, the "
                             "noise's uniforms)")


def describe_ops(o):
    return f"RMSNorm {o.rms_norm}, SiLU x up {o.silu_mul}, RoPE + cache {o.rope}"


DRAW_WORDS = {"generator": "each request's draws from its own generator",
              "keyed": "each request's draws keyed by its seed (draw_triton's kernels, in the step)"}


def describe_own_positions(o):
    """The server step's line of explain."""
    blocks = "compiled" if o.block == "compiled" else "eager"
    if o.fused_rows:
        pdl = f", {PDL_NAMES[o.pdl]}" if o.pdl else ", GEMVs under PDL" if o.gemv_pdl else ""
        blocks = f"fused (Triton, up to {o.fused_rows} rows{pdl}) or {blocks}"
    if o.down_rows:
        blocks += f" (w2 and the residual add in Triton's down kernel at {o.down_rows[0]}-{o.down_rows[-1]} rows)"
    runs = "a CUDA graph per step size" if o.graph else "op by op"
    if o.prefetch_rows:
        runs += f" with the L2 prefetcher beside it up to {o.prefetch_rows} rows"
    return (f"each row at its own position (a server's batch): the {blocks} blocks and {window_words(o)}, "
            f"inputs {INPUT_WORDS[o.inputs]}, {runs} ({'/'.join(map(str, o.buckets))} images); {DRAW_WORDS[o.draw]}; "
            f"{describe_ops(o.ops)}")


def explain_server(s):
    """The server's steps (serve.py) in the situation of s, as explain's line: what `--explain` adds for them."""
    o = make(dataclasses.replace(s, own_positions=True, draft_window=0)).own_positions
    return f"  {'server steps':<14}{describe_own_positions(o)}"


# docs/decode_plan.md's table: one model (GPT-XL t2i 512 px) under CFG, each backend on each device class, by images.
TABLE_DEVICES = (("Hopper (sm_90), bf16", dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16)),
                 ("Ampere (sm_80), bf16", dict(device="cuda", capability=(8, 0), dtype=torch.bfloat16)),
                 ("CPU, fp32", dict(device="cpu", dtype=torch.float32)))
TABLE_IMAGES = ((1, 1), (2, 2), (3, 8), (9, 31), (32, 32), (33, 48), (49, 64))


def table():
    """docs/decode_plan.md's backend x rows table (a test holds the page to it): for n images under CFG (2n rows), the
    block and attention of the steps, the draw and the inputs; ranges of n that run the same are one line."""
    out = ["| backend | device | images (rows) | block | attention | draw | inputs |", "|---|---|---|---|---|---|---|"]
    for backend in BACKENDS:
        for label, kw in TABLE_DEVICES:
            if backend == "cudagraph" and kw["device"] == "cpu":
                continue
            lines = []  # [first, last, cells]
            for lo, hi in TABLE_IMAGES:
                cells = set()
                for n in range(lo, hi + 1):
                    p = make(Situation(backend=backend, batch=n, **kw))
                    d = describe_rows(p, p.guided)
                    cells.add((d["block"], d["attention"], p.draw, p.inputs))
                assert len(cells) == 1, (backend, label, lo, hi, cells)  # TABLE_IMAGES' ranges are uniform
                cell = cells.pop()
                if lines and lines[-1][2] == cell:
                    lines[-1][1] = hi
                else:
                    lines.append([lo, hi, cell])
            for lo, hi, cell in lines:
                n = f"{lo} ({2 * lo})" if lo == hi else f"{lo}-{hi} ({2 * lo}-{2 * hi})"
                out.append(f"| {backend} | {label} | {n} | " + " | ".join(cell) + " |")
    return "\n".join(out)
