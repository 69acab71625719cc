"""The sampling settings of one call, checked once: their ranges, the speculative companions, the user's error type.

The command lines, the server and the Pipeline share these: a flag and a keyword argument of the same name accept the
same values and refuse the others with the same one line (the flag's name, `--top-k`, or the keyword's, `top_k`).
"""
import math
from dataclasses import dataclass, fields
from typing import Callable, Optional, get_args

from fast_inference.plan import given_drafts
from fast_inference.speculative import COUPLINGS, DEFAULT_COUPLING, DEFAULT_INIT, DEFAULT_WINDOW, DRAFT_INITS

SPECULATIVE = ("none", "jacobi")  # = engine.SPECULATIVE (no engine import here: the server's checks need no kernels)


class UserError(Exception):
    """A mistake the user can fix; printed as one line without a traceback."""


# Accepted ranges of the numeric settings (inclusive; None: unbounded), checked before any work and quoted by --help;
# the note says what the edge values mean. Guidance and control strength are bounded where float32 logits and
# fp16 activations could overflow into NaN (tokens of all zeros), far above any useful value (the models use 4 and 1).
RANGES = dict(
    cfg_scale=(0, 1000, "guidance runs only above 1, as officially (1 = none)"),
    cfg_interval=(-1, None, "-1 = guidance at every token"),
    top_k=(0, None, "0 = no top-k filter"),
    top_p=(0, 1, "1 = no top-p filter, 0 = the most likely token only"),
    temperature=(0, None, "0 = greedy (the official code divides the logits by max(temperature, 1e-5))"),
    control_strength=(0, 100, "0 = no control; it acts only with guidance on, as officially"),
    seed=(0, 2**32 - 1, None),  # fast_eval.py seeds a batch with seed * 2**32 + its first position
    image_size=(16, None, "a multiple of 16"), image_H=(16, None, "a multiple of 16"),
    image_W=(16, None, "a multiple of 16"),
    codebook_size=(1, None, None), codebook_embed_dim=(1, None, None), cls_token_num=(1, None, None),
    num_classes=(1, None, None), condition_token_nums=(0, None, None), num_images=(1, None, None),
    warmup=(0, None, None), t5_feature_max_len=(1, None, None), t5_feature_dim=(1, None, None),
    draft_window=(2, 256, "the last accepted token and window - 1 drafts"),
)


def flag_name(name: str) -> str:
    """A setting's command-line spelling: top_k -> --top-k."""
    return f"--{name.replace('_', '-')}"


def span(name: str, ranges: dict = RANGES) -> str:
    low, high, _ = ranges[name]
    return f"{low}..{high}" if high is not None else f">= {low}"


def check_ranges(settings, ranges: dict = RANGES, spell: Callable[[str], str] = flag_name) -> None:
    """Every numeric setting `settings` has: a finite number within its range, else one line saying which values
    work, the setting named by `spell` (the flag by default)."""
    for name, (low, high, note) in ranges.items():
        value = getattr(settings, name, None)
        if value is None:
            continue
        finite = isinstance(value, int) or math.isfinite(value)
        if not finite or value < low or (high is not None and value > high):
            kind = "a whole number" if isinstance(value, int) else "a number"
            raise UserError(f"{spell(name)} {value} is out of range; use {kind} {span(name, ranges)}"
                            + (f" ({note})" if note else ""))


def check_speculative(s, spell: Callable[[str], str] = flag_name, engine: str = "fast", backend: Optional[str] = None,
                      compile_scope: str = "block") -> None:
    """The speculative settings' companions, before any model loads (the plan refuses the rest when the engine is
    made)."""
    if s.speculative not in SPECULATIVE:
        raise UserError(f"{spell('speculative')} {s.speculative!r}: use one of {', '.join(SPECULATIVE)}")
    if s.speculative == "none":
        return
    if engine == "reference":
        raise UserError(f"{spell('speculative')} jacobi runs on the fast engine; drop --engine reference")
    if s.cfg_interval > -1:
        raise UserError(f"{spell('speculative')} jacobi guides every token; use {spell('cfg_interval')} -1")
    if backend == "cudagraph" or (backend == "inductor" and compile_scope == "step"):
        raise UserError(f"{spell('speculative')} jacobi runs on --backend inductor with --compile-scope block, or on "
                        "--backend eager")
    if s.draft_init not in DRAFT_INITS or s.draft_coupling not in COUPLINGS + (None,):
        raise UserError(f"{spell('draft_init')} {s.draft_init!r}, {spell('draft_coupling')} {s.draft_coupling!r}: use "
                        f"one of {', '.join(DRAFT_INITS)} and one of {', '.join(COUPLINGS)}")
    if s.draft_tree and given_drafts(s.draft_window, s.draft_coupling, s.draft_tree).coupling != "pathwise":
        raise UserError(f"{spell('draft_tree')} is exact with {spell('draft_coupling')} pathwise only; add it, or "
                        f"{spell('draft_tree')} none")


def check_draft_grid(s, H: int, W: int, spell: Callable[[str], str] = flag_name) -> None:
    """Drafts from above read the token one grid row up: a square grid at least as wide as the window."""
    window = given_drafts(s.draft_window, s.draft_coupling, s.draft_tree).window  # above: the plan keeps the chain
    if s.speculative != "none" and s.draft_init == "above" and (H != W or W // 16 < window):
        raise UserError(f"{spell('draft_init')} above needs a square image at least {window * 16} pixels wide "
                        f"({spell('draft_window')} x 16), not {H}x{W}; use {spell('draft_init')} random or left")


@dataclass(frozen=True)
class SamplingParams:
    """How one call samples: the official sampling settings, the images per prompt, the seed and the speculative
    decoding settings. Checked once, when made (an out-of-range value is a UserError naming it)."""
    cfg_scale: float = 4.0
    cfg_interval: int = -1
    top_k: int = 2000
    top_p: float = 1.0
    temperature: float = 1.0
    control_strength: float = 1.0
    seed: int = 0
    num_images: int = 1
    speculative: str = "none"
    draft_window: Optional[int] = None  # these three None: the plan's choice (plan.given_drafts)
    draft_init: str = DEFAULT_INIT
    draft_coupling: Optional[str] = None
    draft_tree: Optional[tuple] = None
    spell: Callable[[str], str] = str  # how errors name a setting: the keyword (str) or the flag (flag_name)

    def __post_init__(self):
        for f in fields(self):
            value, kind = getattr(self, f.name), f.type
            if f.default is None:  # Optional: None leaves it to the plan (the draft settings)
                if value is None:
                    continue
                kind = get_args(kind)[0]
            if kind in ("float", float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UserError(f"{self.spell(f.name)} must be a number, got {value!r}")
            if kind in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise UserError(f"{self.spell(f.name)} must be a whole number, got {value!r}")
        check_ranges(self, {k: v for k, v in RANGES.items() if hasattr(self, k)}, self.spell)
        check_speculative(self, self.spell)

    @property
    def speculation(self) -> tuple:
        """The engine's speculative settings (one engine each): (speculative, window, init, coupling, tree)."""
        if self.speculative == "none":
            return ("none", DEFAULT_WINDOW, DEFAULT_INIT, DEFAULT_COUPLING, ())
        tree = None if self.draft_tree is None else tuple(self.draft_tree)
        return (self.speculative, self.draft_window, self.draft_init, self.draft_coupling, tree)

    @classmethod
    def from_args(cls, args) -> "SamplingParams":
        """The sampling flags of a command line (argparse names), its errors naming the flags."""
        names = [f.name for f in fields(cls) if f.name != "spell"]
        return cls(**{k: getattr(args, k) for k in names if getattr(args, k, None) is not None}, spell=flag_name)
