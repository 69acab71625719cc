"""tools/step_timeline.py on the CPU: its per-name summary on made-up kernel events (the profile itself needs a
GPU), and its --setting checked before anything runs."""
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


def test_a_setting_that_is_not_python_is_a_usage_error():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "step_timeline.py"), "--setting", "plan.X ="],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "setting 'plan.X =' is not Python" in out.stderr.splitlines()[-1]
