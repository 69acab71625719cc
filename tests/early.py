"""Scripts that take a minute or more each (Triton's interpreter, sm_90 builds), run beside the other tests.

A test module names them in EARLY: test name -> (script, env). conftest.py starts those of the selected tests once collection is done, and each test waits for its own with `result`.
They run at a lower priority (nice), so that the tests in this process keep their core while the scripts take
what is left. Their output goes to files, not pipes, so that a script never blocks on a full pipe before its
test reads it."""
import os
import subprocess
import sys
import tempfile

NICE = 10
_running = {}  # script -> (process, stdout file, stderr file)


def _lower_priority():
    os.nice(NICE)


def start(script, env):
    if script not in _running:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        # One thread each: several scripts and this process share the cores, and more threads than cores spin idle
        env = dict(env, OMP_NUM_THREADS="1")
        _running[script] = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=out, stderr=err, text=True,
                                            preexec_fn=_lower_priority if hasattr(os, "nice") else None), out, err
    return _running[script]


def result(script, env, timeout=900):
    """The finished script as subprocess.run's result (started now if it was not started early)."""
    p, out, err = start(script, env)
    try:
        p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(p.args, p.returncode, out.read(), err.read())


def stop():
    """Kill what is still running (an interrupted or deselecting session)."""
    for p, _, _ in _running.values():
        if p.poll() is None:
            p.kill()
