"""tools/engine_ab.py's settings on the CPU: each starts from the modules as they were, may set plan overrides, and a
setting that is not Python is a one-line usage error."""
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import engine_ab  # noqa: E402
from fast_inference import plan  # noqa: E402
from fast_inference.kernels import block_triton  # noqa: E402


def test_each_setting_starts_from_the_code_as_it_stands():
    saved = engine_ab.snapshot()
    table, rows = dict(block_triton.DOT_CONFIG), plan.FUSED_ROWS
    first, second, plain = engine_ab.compile_settings([
        "block_triton.DOT_CONFIG['w2'] = (1, 2, 3, 4, 5)\nplan.FUSED_ROWS = 8\nblock_triton.NEW = 1",
        "block_triton.DOT_CONFIG.update(wo=(0, 0, 0, 0, 0))\noverrides = 'draw=torch'", ""])
    try:
        assert engine_ab.apply(saved, first) == ""
        assert block_triton.DOT_CONFIG["w2"] == (1, 2, 3, 4, 5) and plan.FUSED_ROWS == 8
        assert engine_ab.apply(saved, second) == "draw=torch"  # the first setting's changes are gone
        assert block_triton.DOT_CONFIG == dict(table, wo=(0, 0, 0, 0, 0))
        assert plan.FUSED_ROWS == rows and not hasattr(block_triton, "NEW")
        engine_ab.apply(saved, plain)
        assert block_triton.DOT_CONFIG == table
    finally:
        engine_ab.restore(saved)
    assert block_triton.DOT_CONFIG == table and plan.FUSED_ROWS == rows


def test_a_setting_that_is_not_python_is_a_usage_error():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "engine_ab.py"), "", "plan.X ="],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "setting 'plan.X =' is not Python" in out.stderr.splitlines()[-1]


def test_process_per_setting_runs_each_setting_alone_twice(monkeypatch):
    """--process-per-setting: one child per setting, the settings alternating twice, each child one round of its
    own setting on the parent's backend (a setting that starts with "-" stays a setting); a child that fails ends the run with a message."""
    runs = []
    monkeypatch.setattr(engine_ab.torch.cuda, "is_available", lambda: True)  # the parent runs nothing on it
    monkeypatch.setattr(engine_ab.subprocess, "run", lambda cmd: runs.append(cmd) or subprocess.CompletedProcess(cmd, 0))
    engine_ab.main(["--batch-sizes", "1,32", "--backend", "cudagraph", "--process-per-setting", "",
                    "-1 or plan.X"])
    assert [cmd[-1] for cmd in runs] == ["", "-1 or plan.X"] * 2
    assert all(cmd[2:-1] == ["--batch-sizes", "1,32", "--backend", "cudagraph", "--once", "--"] for cmd in runs)
    monkeypatch.setattr(engine_ab.subprocess, "run", lambda cmd: subprocess.CompletedProcess(cmd, 1))
    try:
        engine_ab.main(["--process-per-setting", ""])
    except SystemExit as e:
        assert "the process for setting '' failed" in str(e)
    else:
        raise AssertionError("a failed child must end the run")


def test_a_line_says_whether_the_tokens_match_only_where_it_can():
    """In one process a run is compared with the first setting's tokens; a child of --process-per-setting runs one
    setting, so its line gives the hash alone (which the other processes' lines compare with)."""
    tokens, other = engine_ab.torch.arange(6).view(1, 6), engine_ab.torch.arange(1, 7).view(1, 6)
    alone = engine_ab.line(32, "", 2.5, tokens, None)
    assert alone.startswith("n = 32, as it stands: decode 2.500 ms/step (12,800 tok/s), (hash ")
    assert "first setting" not in alone
    assert "tokens as the first setting's: True" in engine_ab.line(8, "x = 1", 1.0, tokens, tokens.clone())
    differs = engine_ab.line(8, "x = 1", 1.0, tokens, other)
    assert "tokens as the first setting's: False" in differs
    digest = lambda text: text.split("(hash ")[1]
    assert digest(alone) == digest(differs) != digest(engine_ab.line(8, "", 1.0, other, None))
