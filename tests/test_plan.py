"""The decode plan (fast_inference/plan.py): the one place that chooses a kernel.

- It chooses what the engine's selection code chose before it (tools/record_old_plan.py ran that code, commit
  e853843, for every situation below and wrote tests/data/old_plan_choices.json): backend x rows 1-128 (with and
  without CFG) x dtype x compute capability (and whether NVRTC builds) x top-p x int8 x --compile-prefill.
- The decode plan page's backend x rows table (docs/decode_plan.md) is the plan's (plan.table()).
- Overrides are checked, and the kernels and the model consult no switch of their own.
"""
import ast
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from fast_inference import plan
from fast_inference.model import ModelArgs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD = os.path.join(ROOT, "tests", "data", "old_plan_choices.json")
GPT_XL = ModelArgs.from_name("GPT-XL", block_size=1024)
DEVICES = dict(cpu=("cpu", None, True), sm75=("cuda", (7, 5), True), sm80=("cuda", (8, 0), True),
               sm90=("cuda", (9, 0), True), sm100=("cuda", (10, 0), True))
DTYPES = dict(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)


def situation(key, batch):
    """plan.Situation of a key of old_plan_choices.json and a batch size (GPT-XL t2i, 1,024 tokens)."""
    backend, device, dtype, int8, top_p, prefill, cfg = key.split("|")
    builds = not device.endswith("-nobuild")
    device_type, capability, _ = DEVICES[device.split("-")[0]]
    return plan.Situation(
        backend=backend.split("-")[0], compile_scope="step" if backend == "inductor-step" else "block",
        fused_block=backend != "inductor-block-nofuse", compile_prefill=prefill.endswith("=1"), device=device_type,
        capability=capability, dtype=DTYPES[dtype], int8=int8.endswith("=1"), top_p=float(top_p.split("=")[1]),
        cfg=cfg.endswith("=1"), batch=batch, dim=GPT_XL.dim, n_head=GPT_XL.n_head, ffn_hidden=GPT_XL.ffn_hidden,
        vocab_size=GPT_XL.vocab_size, max_seq=GPT_XL.prefix_len + 1024, builds=lambda *k: builds)


def old_words(p):
    """A plan in the words tools/record_old_plan.py wrote the old code's choices in."""
    s = p.situation
    c = dict(step=p.step, inputs=p.inputs, block=p.block, prefetch=p.prefetch, windows=p.windows, head=p.head,
             draw=p.draw, head_noise=p.head_noise, text_sums=p.text_sums, prefill=p.prefill,
             vq_norm=p.vq_norm, draw_pdl=int(p.draw_pdl), inputs_pdl=int(p.inputs_pdl))
    ops = lambda o: dict(rms_norm=o.rms_norm, silu_mul=o.silu_mul, rope=o.rope)
    c["prefill_ops"] = ops(p.prefill_ops)
    if p.step_ops is not None:
        c["step_ops"] = ops(p.step_ops)
    for kind, r in (("guided", p.guided), ("unguided", p.unguided)) if s.cfg else (("steps", p.guided),):
        projections = {name: "inductor" if q.impl == "inductor" else f"{q.impl}/pdl{q.pdl}" for name, q in r.projections}
        attention = r.attention
        if attention.startswith("triton"):
            merge = "-" if r.merge_pdl is None else r.merge_pdl
            attention += f"{r.attention_config}/pdl{r.attention_pdl}/merge_pdl{merge}" + ("/progress" if r.progress
                                                                                           else "")
        c[kind] = dict(projections=projections, attention=attention)
        if p.prefetch != "none":
            c[kind]["prefetch_down"] = r.prefetch_down
    return c


def test_plan_chooses_what_the_old_code_chose():
    with open(OLD) as f:
        old = json.load(f)
    checked, differ = 0, []
    for key, ranges in old["situations"].items():
        for first, last, index in ranges:
            want = old["choices"][index]
            for batch in range(first, last + 1):
                if "error" in want:
                    with pytest.raises(plan.PlanError) as e:
                        plan.make(situation(key, batch))
                    assert str(e.value) == want["error"]
                    continue
                got = old_words(plan.make(situation(key, batch)))
                checked += 1
                if got != want and len(differ) < 5:
                    differ.append((key, batch, {k: (got.get(k), want.get(k)) for k in set(got) | set(want)
                                                if got.get(k) != want.get(k)}))
    assert not differ, differ
    assert checked > 100_000  # every situation of the file but the refused ones


def test_a_planted_mistake_fails_the_comparison(monkeypatch):
    """The comparison sees a rule moved by one row: the fused block up to 15 rows instead of 16."""
    monkeypatch.setattr(plan, "FUSED_ROWS", 15)
    got = old_words(plan.make(situation("inductor-block|sm90|bf16|int8=0|top_p=1.0|compile_prefill=0|cfg=0", 16)))
    assert got["block"] == "compiled"
    with open(OLD) as f:
        old = json.load(f)
    ranges = old["situations"]["inductor-block|sm90|bf16|int8=0|top_p=1.0|compile_prefill=0|cfg=0"]
    want = next(old["choices"][i] for first, last, i in ranges if first <= 16 <= last)
    assert want["block"] == "fused" and got != want


def test_readme_table_is_the_plans():
    """The decode plan's page (docs/decode_plan.md, linked from the README) shows plan.table()."""
    with open(os.path.join(ROOT, "docs", "decode_plan.md")) as f:
        page = f.read()
    assert plan.table() in page


@pytest.mark.parametrize("text, error", [
    ("draw=cuda", None),
    ("draw=fast", "draw=fast: use one of torch, triton, cuda"),
    ("speed=11", "unknown plan override 'speed=11'"),
    ("attention", "unknown plan override 'attention'"),
])
def test_overrides_are_checked(text, error):
    if error is None:
        assert plan.parse_overrides(text) == (("draw", "cuda"),)
    else:
        with pytest.raises(plan.PlanError, match=re.escape(error)):
            plan.parse_overrides(text)


def test_an_override_the_situation_cannot_run_names_what_it_can():
    s = situation("eager|cpu|fp32|int8=0|top_p=1.0|compile_prefill=0|cfg=1", 1)
    with pytest.raises(plan.PlanError, match="draw=triton cannot run here.*draws with torch"):
        plan.make(plan.Situation(**{**s.__dict__, "overrides": (("draw", "triton"),)}))
    hopper = situation("cudagraph|sm90|bf16|int8=0|top_p=1.0|compile_prefill=0|cfg=1", 1)
    p = plan.make(plan.Situation(**{**hopper.__dict__, "overrides": (("attention", "sdpa"), ("draw", "torch"))}))
    assert (p.guided.attention, p.draw, p.windows) == ("sdpa_windows", "torch", plan.CACHE_WINDOWS)


def test_explain_names_every_operation():
    p = plan.make(situation("inductor-block|sm90|bf16|int8=0|top_p=1.0|compile_prefill=0|cfg=1", 1))
    text = plan.explain(p)
    for word in ("steps", "inputs", "block", "qkv", "gate_up", "attention", "head", "draw", "prefetch", "prefill",
                 "VQ norms", "cuda, PDL early", "triton_gemv, PDL first"):
        assert word in text, word


SWITCHES = re.compile(r"os\.environ|getenv|^[A-Z_]*ENABLED\s*=", re.M)


def test_only_the_plan_reads_the_environment_or_keeps_switches():
    """No os.environ read and no module-level enable flag outside plan.py: the kernels and the engine take what the
    plan says. (fast_eval.py reads torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
    TORCHELASTIC_RUN_ID; the engine writes inductor's settings.)"""
    offenders = []
    for folder, _, files in os.walk(os.path.join(ROOT, "fast_inference")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or name == "plan.py":
                continue
            with open(path) as f:
                for i, line in enumerate(f, 1):
                    reads = SWITCHES.search(line) and not re.search(r"os\.environ\[[^\]]+\]\s*=[^=]", line)
                    torchrun = re.search(r"RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_RUN_ID", line)
                    if reads and not (name == "fast_eval.py" and torchrun):
                        offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
    assert not offenders, offenders


def imported_modules(path):
    """The fast_inference modules `path` imports, at any depth of its code."""
    with open(path) as f:
        tree = ast.parse(f.read())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fast_inference"):
            out |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("fast_inference")}
    return out


@pytest.mark.parametrize("name", ["model.py", "generate.py", "sampling.py", "vq.py", "dinov2.py", "vit.py"])
def test_the_reference_path_imports_no_kernel(name):
    assert not {m for m in imported_modules(os.path.join(ROOT, "fast_inference", name)) if "kernels" in m}


def test_importing_the_reference_loads_no_kernel_module():
    code = ("import sys; import fast_inference.generate, fast_inference.model, fast_inference.vq; "
            "print(sorted(m for m in sys.modules if m.startswith('fast_inference.kernels') or m == 'triton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


# ---- the draft flags' defaults (issue 78): the plan picks the drafts from its measured tables ---------------------

def auto_drafts(**kw):
    """A Situation of --speculative jacobi with the draft flags left out (GPT-XL at 512 px on an H100 by default)."""
    d = plan.given_drafts()
    base = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, dim=GPT_XL.dim, n_head=GPT_XL.n_head,
                ffn_hidden=GPT_XL.ffn_hidden, vocab_size=GPT_XL.vocab_size, max_seq=GPT_XL.prefix_len + 1024,
                draft_window=d.window, draft_coupling=d.coupling, draft_tree=d.tree, auto_drafts=d.auto)
    return plan.Situation(**{**base, **kw})


def drafts_of(p):
    s = p.situation
    return (s.draft_window, s.draft_coupling, s.draft_tree)


def drafts_line(p):
    return next(line for line in plan.explain(p).splitlines() if line.startswith("  drafts "))


def test_the_draft_flags_left_out_give_the_chain_until_the_plan_picks():
    """plan.given_drafts, every entry point's rule: all three left out is the plan's choice (the chain until make()
    picks); any given pins them, the others the chain's, a tree's coupling pathwise."""
    assert plan.CHAIN == plan.Drafts(16, "gumbel", ()) and plan.MEASURED_TREE == plan.Drafts(48, "pathwise", (4, 3, 2, 3))
    assert plan.given_drafts() == plan.Drafts(16, "gumbel", (), auto=True)
    assert plan.given_drafts(tree=(4, 3)) == plan.Drafts(16, "pathwise", (4, 3))
    assert plan.given_drafts(coupling="gumbel") == plan.Drafts(16, "gumbel", ())
    assert plan.given_drafts(window=32) == plan.Drafts(32, "gumbel", ())
    assert plan.given_drafts(tree=()) == plan.Drafts(16, "gumbel", ())  # --draft-tree none pins the chain
    assert plan.given_drafts(window=48, coupling="pathwise") == plan.Drafts(48, "pathwise", ())
    assert plan.given_drafts(tree=(4, 3), coupling="gumbel").coupling == "gumbel"  # kept: settings.py refuses it
    assert plan.widest_window(plan.given_drafts()) == 48 and plan.widest_window(plan.given_drafts(window=8)) == 8


def test_the_plan_picks_the_measured_tree_where_it_beats_the_chain():
    """On a CUDA device with Triton: the measured tree at n = 1 (TREE_GAINS 2.20 > PASS_GAINS 1.43), the chain at
    n = 8 (0.62 < 1.43); --explain's drafts line says which and by what figures."""
    p = plan.make(auto_drafts(batch=1))
    assert drafts_of(p) == (48, "pathwise", (4, 3, 2, 3)) and p.jacobi.tree == (4, 3, 2, 3) and p.jacobi.nodes == 63
    assert p.jacobi.tree_ops == "triton" and p.jacobi.attention == "triton" and not p.chain_instead
    assert re.fullmatch(r"  drafts +the measured tree 4x3\+2x3 at 48, pathwise coupling: the tree measured 2\.20x .* "
                        r"the chain 1\.43x \(TREE_GAINS; PASS_GAINS, window kernels on\).*", drafts_line(p))
    p = plan.make(auto_drafts(batch=8))
    assert drafts_of(p) == (16, "gumbel", ()) and p.jacobi.tree == () and p.jacobi.window == 16
    assert re.fullmatch(r"  drafts +the chain of 16, gumbel coupling: the tree measured 0\.62x .* the chain 1\.43x .*",
                        drafts_line(p))
    assert drafts_of(plan.make(auto_drafts(batch=4))) == drafts_of(plan.make(auto_drafts(batch=1)))  # n = 1's entry
    given = plan.make(auto_drafts(auto_drafts=False))  # flags given: no choice, no line
    assert drafts_of(given) == (16, "gumbel", ()) and not given.drafts_chosen and " drafts " not in plan.explain(given)


@pytest.mark.parametrize("where, why", [
    (dict(device="cpu", capability=None, dtype=torch.float32), "measured with its Triton tree ops"),
    (dict(triton=False), "measured with its Triton tree ops"),
    (dict(overrides=(("tree_ops", "torch"),)), "measured with its Triton tree ops"),
    (dict(overrides=(("window_attention", "sdpa"),)), "and the window kernels"),
    (dict(draft_init="random"), "measured with left drafts, not random")])
def test_the_plan_keeps_the_chain_where_the_tree_would_not_run_as_measured(where, why):
    p = plan.make(auto_drafts(batch=1, **where))
    assert drafts_of(p) == (16, "gumbel", ()) and p.jacobi.tree == ()
    assert drafts_line(p).split(None, 1)[1].startswith("the chain of 16, gumbel coupling: ") and why in drafts_line(p)


def test_the_pass_prefetcher_is_an_override_until_measured():
    """pass_prefetch: off by default (PASS_PREFETCH, not measured yet); on beside inductor's block and the Triton window
    attention on sm_90+, named by --explain; refused with SDPA's attention or before sm_90."""
    p = plan.make(auto_drafts(batch=1))
    assert not p.jacobi.prefetch and "pass prefetch" not in plan.explain(p)
    on = plan.make(auto_drafts(batch=1, overrides=(("pass_prefetch", "on"),)))
    assert on.jacobi.prefetch and "  pass prefetch " in plan.explain(on)
    for where in (dict(overrides=(("pass_prefetch", "on"), ("window_attention", "sdpa"))),
                  dict(capability=(8, 0), overrides=(("pass_prefetch", "on"),))):
        with pytest.raises(plan.PlanError, match="pass_prefetch=on needs .*; use pass_prefetch=off"):
            plan.make(auto_drafts(batch=1, **where))


def test_the_choice_follows_the_measured_tables(monkeypatch):
    """The choice reads TREE_GAINS and PASS_GAINS: with other figures it picks otherwise."""
    monkeypatch.setattr(plan, "TREE_GAINS", {1: 1.0})
    assert drafts_of(plan.make(auto_drafts(batch=1))) == (16, "gumbel", ())
    monkeypatch.setattr(plan, "TREE_GAINS", {1: 1.92, 8: 2.0})
    assert drafts_of(plan.make(auto_drafts(batch=8))) == (48, "pathwise", (4, 3, 2, 3))
    monkeypatch.setattr(plan, "PASS_GAINS", {**plan.PASS_GAINS, (True, 8): 2.5})
    assert drafts_of(plan.make(auto_drafts(batch=8))) == (16, "gumbel", ())
