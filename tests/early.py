"""Scripts that take a minute or more each (Triton's interpreter, sm_90 builds), run beside the other tests.

A test module names them in EARLY: test name -> script (with the module's ENV) or (script, env). conftest.py
queues those of the selected tests once collection is done, in collection order, and each test waits for its
own with `result`. At most SLOTS run at a time beside the test process, so that the tests in it keep a share
of the CPU. Their output goes to files, not pipes, so that a script never blocks on a full pipe before its
test reads it."""
import os
import queue
import subprocess
import sys
import tempfile
import threading

SLOTS = max(1, os.cpu_count() or 1)
_jobs = {}  # script -> _Job
_queue = queue.Queue()
_workers = []
_lock = threading.Lock()  # a job starts or is cancelled, not both


class _Job:
    def __init__(self, script, env):
        self.script, self.env = script, env
        self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.process, self.cancelled = None, False
        self.done = threading.Event()


def _work():
    while True:
        job = _queue.get()
        with _lock:
            if not job.cancelled:
                job.process = subprocess.Popen([sys.executable, "-c", job.script], env=job.env, stdout=job.out,
                                               stderr=job.err, text=True)
        if job.process is not None:
            job.process.wait()
        job.done.set()


def start(script, env):
    """Queue script (once); a worker runs it when a slot is free."""
    job = _jobs.get(script)
    if job is None:
        job = _jobs[script] = _Job(script, env)
        if len(_workers) < SLOTS:
            _workers.append(threading.Thread(target=_work, daemon=True))
            _workers[-1].start()
        _queue.put(job)
    return job


def result(script, env, timeout=900):
    """The finished script as subprocess.run's result (queued now if it was not queued early); timeout counts
    its wait in the queue too."""
    job = start(script, env)
    if not job.done.wait(timeout):
        _cancel(job)
        raise subprocess.TimeoutExpired([sys.executable, "-c", "<early script>"], timeout)
    if job.process is None:
        raise RuntimeError("early script cancelled before it ran")
    job.out.seek(0)
    job.err.seek(0)
    return subprocess.CompletedProcess(job.process.args, job.process.returncode, job.out.read(), job.err.read())


def _cancel(job):
    with _lock:
        job.cancelled = True
        if job.process is not None and job.process.poll() is None:
            job.process.kill()


def stop():
    """Cancel what is queued and kill what runs (the session's end, also where tests were deselected)."""
    for job in list(_jobs.values()):
        _cancel(job)
