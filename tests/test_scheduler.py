"""The server's scheduler (scheduler.py): fair turns between shapes, first come first served within one, a bounded
queue, and a job that runs out of memory failing alone while the worker serves the next (CPU, tiny model)."""
from types import SimpleNamespace

import pytest
import torch

from fast_inference.continuous import Request
from fast_inference.engine import Engine
from fast_inference.scheduler import Job, QueueFull, Scheduler
from test_reference import tiny_inputs, tiny_model


def job(side=64, images=1, cfg=4.0):
    control = torch.zeros(3, side, side)
    return Job(Request(cond=torch.zeros(1, 8, 32), mask=None, control=control, num_images=images, cfg_scale=cfg))


def worker(scheduler, shape=None, free=0, busy=False):
    """A stand-in worker: its batch's shape and free slots, busy or not."""
    batch = None if shape is None else SimpleNamespace(shape=shape, fits=lambda r: r.shape == shape
                                                       and r.num_images <= free)
    w = SimpleNamespace(batch=batch, busy=busy, index=len(scheduler.workers), capacity=4)
    scheduler.workers.append(w)
    return w


def queue(scheduler, *jobs):
    for j in jobs:
        scheduler.submit(j)
    return jobs


def test_shapes_take_turns_and_a_shape_is_first_come_first_served():
    s = Scheduler(max_queue=10)
    a = worker(s, shape=(64, 64, True), free=2, busy=True)
    j1, k1, j2 = queue(s, job(), job(side=32), job())
    assert s._take(a) is j1  # its shape, room for it
    assert s._take(a) is None  # k1 (another shape) is older than j2: a's batch drains, k1 goes next
    b = worker(s)  # an idle worker: it takes k1, so a may go on taking its shape
    assert s._take(a) is j2 and s._take(b) is k1
    assert [j.status for j in (j1, k1, j2)] == ["running"] * 3 and (j1.engine, k1.engine) == (0, 1)
    big, small = queue(s, job(images=3), job())
    assert s._take(a) is None  # the 3-image job waits for room; the 1-image job behind it does not jump it
    s.workers.remove(b)
    idle = worker(s, shape=(64, 64, True), free=4)
    assert s._take(idle) is big and s._take(idle) is small


def test_the_queue_is_bounded_and_a_queued_job_cancels_at_once():
    s = Scheduler(max_queue=2)
    first, second = queue(s, job(), job())
    with pytest.raises(QueueFull):
        s.submit(job())
    assert len(s.pending) == 2 and s.active == 2  # nothing accepted past the bound
    s.cancel(first)
    assert first.status == "cancelled" and s.active == 1 and list(s.pending) == [second]
    s.submit(job())
    s.accepting = False
    with pytest.raises(QueueFull, match="shutting down"):
        s.submit(job())


def test_a_drain_waits_for_jobs_to_end_and_be_collected_then_cancels():
    """drain: nothing new is accepted; it waits while a job accepted before runs and until its client collects it;
    past the grace (or when hurried) it cancels what is left, saying why."""
    import threading
    import time

    s = Scheduler(max_queue=4)
    (ran,) = queue(s, job())

    def run_and_collect():
        time.sleep(0.1)
        with s.cond:
            s.pending.remove(ran)
            s._finished(ran, "done", images=[])
        time.sleep(0.3)
        ran.collected = True

    threading.Thread(target=run_and_collect).start()
    t0 = time.monotonic()
    assert s.drain(grace=10) == [] and ran.status == "done"
    assert 0.35 < time.monotonic() - t0 < 5  # it waited for the images to be fetched, not for the grace
    with pytest.raises(QueueFull, match="shutting down"):
        s.submit(job())

    s, hurry = Scheduler(max_queue=4), threading.Event()
    (left,) = queue(s, job())
    threading.Timer(0.1, hurry.set).start()
    t0 = time.monotonic()
    assert s.drain(grace=10, hurry=hurry) == [left] and time.monotonic() - t0 < 5
    assert left.status == "cancelled" and "shut down" in left.error and s.active == 0


def test_a_capture_excludes_every_other_threads_gpu_work():
    """DeviceWork: a capture waits for the shared work under way and no shared work starts during it (a CUDA graph's
    capture fails if another thread allocates or synchronises meanwhile)."""
    import threading
    import time

    from fast_inference.scheduler import DeviceWork

    work, events = DeviceWork(), []

    def shared(name, hold):
        with work.shared():
            events.append(f"{name}+")
            time.sleep(hold)
            events.append(f"{name}-")

    def capture():
        with work.exclusive():
            events.append("capture+")
            time.sleep(0.1)
            events.append("capture-")

    first = threading.Thread(target=shared, args=("a", 0.2))
    first.start()
    time.sleep(0.05)
    c = threading.Thread(target=capture)
    c.start()
    time.sleep(0.05)
    late = threading.Thread(target=shared, args=("b", 0))
    late.start()
    for t in (first, c, late):
        t.join()
    assert events == ["a+", "a-", "capture+", "capture-", "b+", "b-"]


class NoDecoder:
    """The VQ's interface, decoding to zeros (the real decoder is the server tests')."""
    quantize = SimpleNamespace(embedding=SimpleNamespace(weight=torch.zeros(1, 8)))

    @staticmethod
    def decode_code(tokens, shape):
        return torch.zeros(shape[0], 3, shape[2] * 16, shape[3] * 16)


def test_out_of_memory_fails_that_job_and_the_worker_serves_on():
    """A new shape whose batch does not fit the device's memory fails its job with a message saying what to change;
    the worker then serves the next job, and a failing step fails its batch's jobs only."""
    model = tiny_model()
    engine = Engine(model, backend="eager")
    build = engine.continuous

    def continuous(batch, num_tokens, *rest):
        if num_tokens == 16:  # 64x64
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return build(batch, num_tokens, *rest)

    engine.continuous = continuous
    s = Scheduler(max_queue=8)
    s.add_worker(engine, NoDecoder(), capacity=2)
    cond, mask, condition = tiny_inputs(model, B=1)
    make = lambda side: Job(Request(cond=cond, mask=mask, control=condition[0, :, :side, :side]))
    s.start()
    try:
        too_big, fine = make(64), make(32)
        s.submit(too_big)
        s.submit(fine)
        for j in (too_big, fine):
            wait(j)
        assert too_big.status == "failed" and "out of memory" in too_big.error and "64x64" in too_big.error
        assert fine.status == "done" and fine.images[0].shape == (32, 32, 3) and fine.tokens_done == 4
        w = s.workers[0]
        w.batch.step = lambda: 1 / 0  # a step that fails
        broken = make(32)
        s.submit(broken)
        wait(broken)
        assert broken.status == "failed" and "ZeroDivisionError" in broken.error
        after = make(32)
        s.submit(after)
        wait(after)
        assert after.status == "done" and s.active == 0
    finally:
        s.close(grace=0)
    assert not s.workers[0].thread.is_alive()


def test_a_join_that_captures_excludes_the_other_threads(monkeypatch):
    """A worker captures a join's graph (its key's second admission; CUDA's, stand-in graphs on the CPU) under
    DeviceWork.exclusive, no other thread's GPU work beside it; the jobs get the engine's tokens alone."""
    from fast_inference import engine as engine_module
    from test_continuous import alone, is_join, stand_in_graphs

    stand_in_graphs(monkeypatch)
    capture, held = engine_module.Graphs.capture, []
    monkeypatch.setattr(engine_module.Graphs, "capture", lambda self, key, fn, state=None: (
        held.append((key, s.gpu.capturing)), capture(self, key, fn, state)))
    model = tiny_model(seed=5)
    cond, mask, condition = tiny_inputs(model, B=2)
    requests = [Request(cond=cond[i % 2 : i % 2 + 1], mask=mask[i % 2 : i % 2 + 1], control=condition[i % 2], seed=i)
                for i in range(3)]
    want = [alone(model, r) for r in requests]
    s, vq = Scheduler(max_queue=4), Recorder()
    jobs = run_jobs(s, model, requests, vq, one_at_a_time=True)
    assert all(j.status == "done" for j in jobs)
    joins = [exclusive for key, exclusive in held if is_join(key)]
    assert joins and all(joins)
    assert all(torch.equal(got, w) for got, w in zip(vq.tokens, want))


class Recorder(NoDecoder):
    """NoDecoder that keeps the tokens it was given."""

    def __init__(self):
        self.tokens = []

    def decode_code(self, tokens, shape):
        self.tokens.append(tokens.clone())
        return NoDecoder.decode_code(tokens, shape)


def test_a_one_token_job_is_done_after_its_prefill():
    """A 16x16 job (one token) reports 1 of 1 tokens done and decodes the engine's token for its seed, the one
    fast_engine.py draws (not a second draw over it)."""
    from test_continuous import alone

    model = tiny_model(seed=4)
    cond, mask, condition = tiny_inputs(model, B=1)
    request = Request(cond=cond, mask=mask, control=condition[0, :, :16, :16], seed=9)
    want = alone(model, request)
    vq = Recorder()
    [one] = run_jobs(Scheduler(max_queue=4), model, [request], vq)
    assert one.status == "done" and (one.tokens_done, one.tokens_total) == (1, 1)
    assert len(vq.tokens) == 1 and torch.equal(vq.tokens[0], want)


def test_a_workers_job_times_add_up_to_each_jobs_life():
    """/v1/info's job_seconds: each decoded job's time from its creation to its images, split into queued, tokens,
    decode_queue and decode, summed over the jobs the worker decoded; the stages in order, none negative."""
    model = tiny_model(seed=4)
    cond, mask, condition = tiny_inputs(model, B=1)
    requests = [Request(cond=cond, mask=mask, control=condition[0, :, :32, :32], seed=seed) for seed in (1, 2, 3)]
    s = Scheduler(max_queue=4)
    jobs = run_jobs(s, model, requests, Recorder())  # three jobs for two slots: the third waits in the queue
    w = s.workers[0]
    assert [j.status for j in jobs] == ["done"] * 3 and w.jobs_done == 3
    for j in jobs:
        assert j.created <= j.started <= j.issued <= j.decoding <= j.finished
    assert set(w.job_seconds) == {"queued", "tokens", "decode_queue", "decode"}
    assert sum(w.job_seconds.values()) == pytest.approx(sum(j.finished - j.created for j in jobs), abs=0.05)
    assert w.job_seconds["queued"] == pytest.approx(sum(j.started - j.created for j in jobs))
    assert w.job_seconds["tokens"] == pytest.approx(sum(j.issued - j.started for j in jobs))


@pytest.mark.parametrize("decoders", [1, 2])
def test_decoders_take_the_jobs_that_finish_together(decoders):
    """--decoders N: N threads decode a worker's finished jobs, each job at its own batch with its own tokens. A VQ
    whose decode waits for a second one beside it finishes both jobs with two threads and fails them with one (the
    second job's decode queues behind the first)."""
    import threading

    from test_continuous import alone

    class Pair(Recorder):
        def __init__(self):
            super().__init__()
            self.both = threading.Barrier(2, timeout=3)

        def decode_code(self, tokens, shape):
            self.both.wait()
            return super().decode_code(tokens, shape)

    model = tiny_model(seed=4)
    cond, mask, condition = tiny_inputs(model, B=1)
    requests = [Request(cond=cond, mask=mask, control=condition[0, :, :32, :32], seed=seed) for seed in (1, 2)]
    s, vq = Scheduler(max_queue=4, decoders=decoders), Pair()
    jobs = run_jobs(s, model, requests, vq)
    w = s.workers[0]
    if decoders == 1:
        assert [j.status for j in jobs] == ["failed"] * 2 and w.jobs_done == 0
        return
    assert [j.status for j in jobs] == ["done"] * 2 and w.jobs_done == 2
    assert len(vq.tokens) == 2 and all(any(torch.equal(t, alone(model, r)) for t in vq.tokens) for r in requests)
    assert sum(w.job_seconds.values()) == pytest.approx(sum(j.finished - j.created for j in jobs), abs=0.05)


def test_steps_ahead_waits_for_all_but_the_last_steps_issued(monkeypatch):
    """--steps-ahead N: after each step a worker on CUDA records an event and waits for the one N steps back, oldest
    first, so the GPU is never more than N steps behind; 0 waits for none. (Events stood in for: a CPU engine.)"""
    import fast_inference.scheduler as scheduler_module

    log = []

    class Event:
        def __init__(self):
            self.n = len(log)
            log.append(("made", self.n))

        def record(self):
            pass

        def synchronize(self):
            log.append(("waited", self.n))

    monkeypatch.setattr(scheduler_module.torch.cuda, "Event", Event)
    for ahead, waited in ((2, [0, 1, 2]), (0, [])):
        log.clear()
        w = scheduler_module.Worker(Scheduler(steps_ahead=ahead), 0, SimpleNamespace(device=torch.device("cpu")),
                                    None, 2)
        w.cuda = True  # as on a GPU
        for _ in range(5):
            w.hold_back()
        assert [n for what, n in log if what == "waited"] == waited
        assert len(w.in_flight) == ahead
        w.decoder.shutdown()


def run_jobs(s, model, requests, vq, one_at_a_time=False):
    """requests through scheduler s with one eager engine of 2 slots decoding with vq (submitted together, or each
    after the one before is over), until each is over and s is closed -> their Jobs."""
    s.add_worker(Engine(model, backend="eager"), vq, capacity=2)
    s.start()
    try:
        jobs = [Job(r) for r in requests]
        for j in jobs:
            s.submit(j)
            if one_at_a_time:
                wait(j)
        for j in jobs:
            wait(j)
    finally:
        s.close(grace=0)
    return jobs


def wait(job, timeout=60):
    import time

    deadline = time.time() + timeout
    while job.status not in ("done", "failed", "cancelled"):
        assert time.time() < deadline, job.status
        time.sleep(0.01)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("decoders", [1, 2])
def test_finished_jobs_decode_on_the_decoders_stream_on_cuda(decoders):
    """On CUDA a finished job's VQ decode runs on its decoder thread's stream (beside the steps, not queued between
    them) and reads the job's tokens: those the engine draws for it alone."""
    from test_continuous import alone

    class StreamRecorder(Recorder):
        def decode_code(self, tokens, shape):
            self.streams = getattr(self, "streams", []) + [torch.cuda.current_stream()]
            return super().decode_code(tokens, shape)

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_model(seed=4).cuda()
    cond, mask, condition = tiny_inputs(model, B=1)
    requests = [Request(cond=cond.cuda(), mask=mask.cuda(), control=condition[0, :, :32, :32].cuda(), seed=seed,
                        top_k=1) for seed in (1, 2, 3)]  # greedy: the batch's and the lone engine's sums may round apart
    want = alone(model, requests[0])
    s, vq = Scheduler(max_queue=4, decoders=decoders), StreamRecorder()
    jobs = run_jobs(s, model, requests, vq)
    assert [j.status for j in jobs] == ["done"] * 3
    streams = s.workers[0].decode_streams
    assert len(streams) == decoders and set(vq.streams) <= set(streams) and torch.cuda.current_stream() not in streams
    assert len(vq.tokens) == 3 and all(torch.equal(t, want) for t in vq.tokens)
