"""tools/step_timeline.py on the CPU: its per-name summary on made-up kernel events (the profile itself needs a
GPU), and its --setting checked before anything runs."""
import io
import os
import subprocess
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import step_timeline  # noqa: E402


def test_by_name_counts_and_sums_each_kernel_name_largest_first():
    step = [dict(name="_partial_kernel", dur=50.0), dict(name="nvjet_sm90_tst_64x16", dur=5.0),
            dict(name="_partial_kernel", dur=52.5), dict(name="triton_poi_fused_add_" + "x" * 80, dur=2.0),
            dict(name="triton_poi_fused_add_" + "x" * 90, dur=1.0), dict(name="nvjet_sm90_tst_64x16", dur=4.0)]
    rows = step_timeline.by_name(step, width=30)
    assert rows == [("_partial_kernel", 2, 102.5), ("nvjet_sm90_tst_64x16", 2, 9.0),
                    (("triton_poi_fused_add_" + "x" * 80)[:30], 2, 3.0)]
    assert step_timeline.by_name([]) == []


def test_write_by_name_summarises_the_second_of_three_runs():
    runs = [[dict(name="_qkv_kernel", dur=10.0 * r), dict(name="_draw_kernel", dur=1.0 * r),
             dict(name="_qkv_kernel", dur=30.0 * r)] for r in (1, 2, 3)]
    out = io.StringIO()
    step_timeline.write_by_name([e for run in runs for e in run], 3, "step", out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "step: 3 kernels, 82.0 us of kernel time"
    assert lines[1].split() == ["2", "x", "80.0", "us", "97.6%", "_qkv_kernel"]
    assert lines[2].split() == ["1", "x", "2.0", "us", "2.4%", "_draw_kernel"] and len(lines) == 3


def test_a_setting_that_is_not_python_is_a_usage_error():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "step_timeline.py"), "--setting", "plan.X ="],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "setting 'plan.X =' is not Python" in out.stderr.splitlines()[-1]
