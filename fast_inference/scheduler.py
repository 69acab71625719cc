"""The server's scheduler: one bounded FIFO of jobs, and a worker thread per engine that turns them into one running
batch (continuous.py's Batch) at a time.

A worker admits, at each step boundary, the oldest jobs of its batch's shape while their images fit its free slots;
a job leaves when its tokens are done (decoded by the VQ, its images kept as arrays) or when it is cancelled. Shapes
(image size, CFG on or off) take turns fairly: a job of another shape at the head of the queue stops younger jobs from
joining a busy batch (unless a worker is idle to take it), so that batch drains and the oldest job's shape goes next.
Nothing here knows HTTP (serve.py); every error is the job's, the workers live on.
"""
import collections
import contextlib
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from fast_inference.continuous import Batch, Request
from fast_inference.images import to_uint8

log = logging.getLogger("fast_inference")
FINAL = ("done", "failed", "cancelled")


class DeviceWork:
    """The process's GPU work from its threads (workers, decoders): a CUDA graph's capture excludes all the rest, as a
    capture fails when another thread allocates or synchronises meanwhile; everything else is shared. (Readers and a
    writer, the writer first: no new shared work starts while a capture waits.)"""

    def __init__(self):
        self.cond = threading.Condition()
        self.shared_count, self.capturing = 0, False

    @contextlib.contextmanager
    def shared(self):
        with self.cond:
            while self.capturing:
                self.cond.wait()
            self.shared_count += 1
        try:
            yield
        finally:
            with self.cond:
                self.shared_count -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self.cond:
            while self.capturing:
                self.cond.wait()
            self.capturing = True
            while self.shared_count:
                self.cond.wait()
        try:
            yield
        finally:
            with self.cond:
                self.capturing = False
                self.cond.notify_all()


class QueueFull(Exception):
    """No room in the queue (or the server is stopping): nothing was accepted."""


@dataclass(eq=False)
class Job:
    """A request and what became of it; the worker writes it, the server reads it (notify wakes its watchers)."""
    request: Request
    preview_every: int = 0  # a preview of the rows done every this many grid rows (0: none)
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])
    status: str = "queued"  # queued | running | done | failed | cancelled
    tokens_done: int = 0
    images: Optional[list] = None  # uint8 (H, W, 3) arrays, when done
    preview: Optional[object] = None  # uint8 (h, n x W, 3): the rows done so far of its n images, side by side
    error: Optional[str] = None
    engine: Optional[int] = None
    cancel_requested: bool = False
    cancel_reason: Optional[str] = None  # its error once cancelled
    collected: bool = False  # a client has its outcome (a done job's images; a failed or cancelled job's status)
    fetched: set = field(default_factory=set)  # the images downloaded
    created: float = field(default_factory=time.monotonic)
    started: Optional[float] = None  # admitted into a batch
    issued: Optional[float] = None  # its last step issued (the GPU may run behind)
    decoding: Optional[float] = None  # the decoder thread took it
    finished: Optional[float] = None
    watchers: list = field(default_factory=list)

    @property
    def tokens_total(self):
        return self.request.num_tokens

    def notify(self):
        for watcher in list(self.watchers):
            try:
                watcher()
            except RuntimeError:  # its event loop has closed (the server stopping): nobody listens there
                pass

    def finish(self, status, error=None, images=None):
        self.status, self.error, self.images, self.finished = status, error, images, time.monotonic()
        self.notify()


class Scheduler:
    """The queue (at most max_queue jobs accepted and not finished), the finished jobs (the last `keep`), and the
    workers; thread-safe."""

    def __init__(self, max_queue=64, keep=256, steps_ahead=0, decoders=1):
        self.max_queue, self.keep, self.steps_ahead, self.decoders = max_queue, keep, steps_ahead, decoders
        self.cond = threading.Condition()
        self.pending = collections.deque()
        self.jobs = collections.OrderedDict()  # id -> Job, finished ones dropped oldest first past `keep`
        self.active = 0  # accepted, not finished
        self.workers = []
        self.accepting, self.stopping = True, False
        self.gpu = DeviceWork()

    def add_worker(self, engine, vq, capacity):
        worker = Worker(self, len(self.workers), engine, vq, capacity)
        self.workers.append(worker)
        return worker

    def start(self):
        for w in self.workers:
            w.thread.start()

    @property
    def capacity(self):
        """The most images one job may ask for: the smallest batch of any worker."""
        return min(w.capacity for w in self.workers)

    def submit(self, job):
        """Queue a job, or raise QueueFull (nothing accepted)."""
        with self.cond:
            if not self.accepting:
                raise QueueFull("the server is shutting down")
            if self.active >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} jobs)")
            self.active += 1
            self.pending.append(job)
            self.jobs[job.id] = job
            self.cond.notify_all()

    def get(self, job_id):
        with self.cond:
            return self.jobs.get(job_id)

    def cancel(self, job, reason=None):
        """A queued job is cancelled at once, a running one at its worker's next step boundary; reason becomes its
        error."""
        with self.cond:
            if job.status in FINAL:
                return
            if job in self.pending:
                self.pending.remove(job)
                self._finished(job, "cancelled", reason)
            else:
                job.cancel_requested, job.cancel_reason = True, reason
        job.notify()

    def finished(self, job, status, error=None, images=None):
        with self.cond:
            self._finished(job, status, error, images)

    def _finished(self, job, status, error=None, images=None):
        job.finish(status, error, images)
        self.active -= 1
        done = [k for k, j in self.jobs.items() if j.status in FINAL]
        for k in done[: max(0, len(done) - self.keep)]:
            del self.jobs[k]
        self.cond.notify_all()

    def next_job(self, worker, block):
        """The next job worker should admit (None: none now). Blocks while block and there is none, until stopping."""
        with self.cond:
            while True:
                job = self._take(worker)
                if job is not None or not block or self.stopping:
                    return job
                self.cond.wait(timeout=0.5)

    def _take(self, worker):
        batch = worker.batch
        idle = not worker.busy
        for job in self.pending:
            same = batch is not None and job.request.shape == batch.shape
            if same and batch.fits(job.request):
                break
            if same:
                return None  # first come first served within a shape: it waits for room
            if idle:
                break  # the oldest job of a new shape
            if not any(w.batch is None or not w.busy for w in self.workers if w is not worker):
                return None  # another shape waits at the head: this batch drains, it goes next
        else:
            return None
        self.pending.remove(job)
        job.status, job.started, job.engine = "running", time.monotonic(), worker.index
        return job

    def drain(self, grace, hurry=None, settle=10.0):
        """Stop accepting; wait up to `grace` seconds (or until hurry, a threading.Event, is set) for the jobs accepted
        so far to end and their clients to collect them; cancel the ones still queued or running, and wait up to
        `settle` seconds for their workers to let them go. -> the jobs cancelled (a job already decoding ends done)."""
        deadline = time.monotonic() + grace
        with self.cond:
            self.accepting = False
            owed = [j for j in self.jobs.values() if j.status not in FINAL]
            while (time.monotonic() < deadline and not (hurry and hurry.is_set())
                   and not all(j.status in FINAL and j.collected for j in owed)):
                self.cond.wait(timeout=0.1)
            left = [j for j in self.jobs.values() if j.status not in FINAL]
        for job in left:
            self.cancel(job, f"the server shut down before the job finished (--shutdown-grace {grace:g} s)")
        deadline = time.monotonic() + settle
        with self.cond:
            while self.active and time.monotonic() < deadline:
                self.cond.wait(timeout=0.1)
        return [j for j in left if j.status == "cancelled"]

    def close(self, grace):
        """drain(grace), then stop the workers."""
        self.drain(grace)
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        for w in self.workers:
            w.thread.join(timeout=60)


class Worker:
    """One engine's thread: admits jobs at step boundaries, steps its batch, finishes and cancels jobs."""

    def __init__(self, scheduler, index, engine, vq, capacity):
        self.scheduler, self.index, self.engine, self.vq, self.capacity = scheduler, index, engine, vq, capacity
        self.batch, self.entries = None, {}  # Entry -> Job
        self.steps, self.images_stepped = 0, 0  # steps, and their requests' images summed (the batch's mean occupancy)
        # wall seconds of the engine's thread waiting for work, admitting (prefills) and stepping (issuing the steps:
        # the GPU runs behind, by at most scheduler.steps_ahead steps where that is > 0), and of the decoder threads'
        # VQ decoding, summed: /v1/info's
        self.seconds = dict(idle=0.0, admit=0.0, step=0.0, decode=0.0)
        # where the jobs decoded went, summed over them: queued (created -> admitted), tokens (-> its last step
        # issued), decode_queue (-> a decoder thread takes it), decode (-> its images, the GPU's lag included)
        self.jobs_done, self.job_seconds = 0, dict(queued=0.0, tokens=0.0, decode_queue=0.0, decode=0.0)
        self.tally = threading.Lock()  # the sums above: the decoder threads add to them beside the engine's
        self.in_flight = collections.deque()  # CUDA events of the steps issued, steps_ahead at most
        self.thread = threading.Thread(target=self.run, name=f"engine-{index}", daemon=True)
        # finished jobs' VQ decoding beside the steps (on the CPU it takes longer than a small image's steps), a job
        # at a time per thread, each job at its own batch (fast_engine.py's images); several threads take the jobs
        # that finish in the same step together
        self.decoder = ThreadPoolExecutor(scheduler.decoders, thread_name_prefix=f"vq-{index}")
        self.cuda = engine.device.type == "cuda"
        # each decoder thread's own stream: its kernels run beside the steps, not queued between them on the engine's
        n = scheduler.decoders if self.cuda else 0
        self.decode_streams = tuple(torch.cuda.Stream(engine.device) for _ in range(n))
        self.free_streams, self.decoder_local = collections.deque(self.decode_streams), threading.local()

    def shared(self):
        """GPU work beside other threads' (DeviceWork); nothing to order on the CPU."""
        return self.scheduler.gpu.shared() if self.cuda else contextlib.nullcontext()

    @property
    def busy(self):
        return bool(self.entries)

    def run(self):
        with torch.no_grad():
            while True:
                job = self.timed("idle", self.scheduler.next_job, self, block=not self.busy)
                if job is not None:
                    self.timed("admit", self.admit, job)
                elif self.busy:
                    self.timed("step", self.step)
                elif self.scheduler.stopping:
                    self.decoder.shutdown(wait=True)
                    return

    def timed(self, what, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kw)
        finally:
            with self.tally:
                self.seconds[what] += time.perf_counter() - t0

    def warm(self, request):
        """Before serving (no other thread runs yet): the batch of request's shape made and warmed (Batch.warm), and
        one image decoded by the VQ."""
        with torch.no_grad():
            self.batch = Batch(self.engine, request.shape, self.capacity)
            self.batch.warm(request)
            self.decode(self.batch.runner.out[:1].clone(), request)

    def admit(self, job):
        """A job into the batch (a new batch if its shape is another): its prefill and first token. A join that
        captures its graph (Batch.admit_captures) excludes every other thread's GPU work, as a step's capture does."""
        request = job.request
        try:
            with self.shared():
                if self.batch is None or self.batch.shape != request.shape:
                    self.batch = None  # the old shape's caches and graphs go before the new ones are made
                    self.batch = Batch(self.engine, request.shape, self.capacity)
            with self.scheduler.gpu.exclusive() if self.batch.admit_captures(request) else self.shared():
                entry = self.batch.admit(request)
        except Exception as e:  # noqa: BLE001 (the job fails; the server serves the others)
            self.fail([job], e, request)
            if not self.entries:
                self.batch = None
            return
        self.entries[entry] = job
        self.progress(entry, job)
        if entry.finished:  # one token: done at its prefill, before any step
            with self.shared():
                self.leave_done(entry)

    def step(self):
        """Cancelled jobs out, one step, finished jobs out (decoded)."""
        for entry, job in list(self.entries.items()):
            if job.cancel_requested:
                self.remove(entry)
                self.scheduler.finished(job, "cancelled", job.cancel_reason)
        if not self.entries:
            return
        try:
            capture = self.cuda and self.batch.captures()
            with self.scheduler.gpu.exclusive() if capture else self.shared():
                used = self.batch.used
                finished = self.batch.step()
                self.steps += 1
                self.images_stepped += used
                for entry, job in self.entries.items():
                    self.progress(entry, job)
                for entry in finished:
                    self.leave_done(entry)
        except Exception as e:  # noqa: BLE001
            jobs = list(self.entries.values())
            self.entries, self.batch = {}, None
            self.fail(jobs, e, jobs[0].request)
            return
        self.hold_back()

    def hold_back(self):
        """On CUDA with steps_ahead > 0: wait (the GIL released) until the GPU has run all but the last steps_ahead
        steps issued, so that the decodes and joins queued beside them do not wait behind a deep queue of steps."""
        ahead = self.scheduler.steps_ahead
        if not (self.cuda and ahead):
            return
        event = torch.cuda.Event()
        event.record()
        self.in_flight.append(event)
        while len(self.in_flight) > ahead:
            self.in_flight.popleft().synchronize()

    def leave_done(self, entry):
        """A finished entry out of the batch, its tokens to the decoder thread."""
        job, tokens = self.entries[entry], self.batch.tokens(entry)
        job.issued = time.monotonic()
        ready = None
        if self.cuda:  # the decoder's stream waits for the tokens' copy on this thread's stream
            ready = torch.cuda.Event()
            ready.record()
        self.remove(entry)
        self.decoder.submit(self.timed, "decode", self.finish, job, tokens, ready)

    def remove(self, entry):
        self.batch.remove(entry)
        del self.entries[entry]

    def decode_stream(self):
        """This decoder thread's CUDA stream (one of decode_streams, taken at its first job)."""
        if not hasattr(self.decoder_local, "stream"):
            self.decoder_local.stream = self.free_streams.popleft()
        return self.decoder_local.stream

    def finish(self, job, tokens, ready=None):
        """A decoder thread's: a done job's images, or its failure. On CUDA on the thread's stream, after `ready`
        (the tokens' copy); the tokens' memory is not reused until that stream is past them."""
        mine = self.decode_stream() if ready is not None else None
        stream = torch.cuda.stream(mine) if mine is not None else contextlib.nullcontext()
        job.decoding = time.monotonic()
        try:
            with torch.no_grad(), self.shared(), stream:
                if mine is not None:
                    mine.wait_event(ready)
                    tokens.record_stream(mine)
                images = self.decode(tokens, job.request)
        except Exception as e:  # noqa: BLE001
            self.fail([job], e, job.request)
            return
        self.count(job, time.monotonic())  # before its client can hear of it
        self.scheduler.finished(job, "done", images=images)

    def count(self, job, end):
        """A decoded job's times into job_seconds (its decoder thread's)."""
        with self.tally:
            t = self.job_seconds
            t["queued"] += job.started - job.created
            t["tokens"] += job.issued - job.started
            t["decode_queue"] += job.decoding - job.issued
            t["decode"] += end - job.decoding
            self.jobs_done += 1

    def progress(self, entry, job):
        """Tokens done to the job; its watchers woken at each grid row done (and a preview every preview_every)."""
        job.tokens_done = entry.done
        width = job.request.control.shape[2] // 16
        if entry.done % width and entry.done != job.tokens_total:
            return
        rows = entry.done // width
        if job.preview_every and rows % job.preview_every == 0 and entry.done < job.tokens_total:
            tokens = self.batch.tokens(entry)[:, : rows * width]
            job.preview = np.concatenate(self.decode(tokens, job.request, rows), axis=1)  # the images side by side
        job.notify()

    def decode(self, tokens, request, rows=None):
        """Tokens (n, rows x width) -> uint8 images (n, 16 rows, W, 3), as fast_engine.py decodes and saves them."""
        H, W = request.control.shape[1:]
        rows = H // 16 if rows is None else rows
        shape = (tokens.shape[0], self.vq.quantize.embedding.weight.shape[1], rows, W // 16)
        return list(to_uint8(self.vq.decode_code(tokens, shape)))

    def fail(self, jobs, error, request):
        message = describe_error(error, request, self.engine.device, self.capacity)
        log.warning("engine %d: %s", self.index, message)
        if isinstance(error, torch.cuda.OutOfMemoryError):
            torch.cuda.empty_cache()
        for job in jobs:
            self.scheduler.finished(job, "failed", error=message)


def describe_error(error, request, device, capacity):
    """A failed job's message: out of memory in plain words (with what to change), else the error itself."""
    H, W = request.control.shape[1:]
    if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower():
        return (f"out of memory on {device} for a batch of {capacity} images of {W}x{H}; ask for a smaller image "
                f"(the server keeps serving others)")
    return f"{type(error).__name__}: {error}"

