"""serve.py as users use it: a real server process on the CPU with the demo model (two engines on one device), its
JSON API, its page in a headless Chromium, a small load test, bad requests, cancellation and a clean SIGTERM.

Outside CI a missing optional package (Starlette/uvicorn, Playwright) or browser skips with the reason; in CI
(CI=true, .ci/run installs them) it fails.
"""
import base64
import http.client
import importlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from conftest import ROOT
from fast_inference.conditions import draw_example

CHROMIUM = "/usr/bin/chromium"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def need(module):
    """Import an optional package, or skip (outside CI) / fail (in CI) naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError:
        message = f"{module} is not installed: pip install -r requirements-serve.txt playwright"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def server():
    """The demo server: two engines on the CPU, batches of 4 images, a queue of 12 jobs, 1 MiB bodies."""
    need("starlette"), need("uvicorn")
    cmd = [sys.executable, os.path.join(ROOT, "fast_inference", "serve.py"), "--port", "0", "--device", "cpu",
           "--engines-per-device", "2", "--batch", "4", "--max-queue", "12", "--max-body-mb", "1", "--max-side", "512",
           "--shutdown-grace", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
        if m:
            break
    else:
        pytest.fail("the server did not start:\n" + "".join(lines))
    log = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    yield type("Server", (), dict(url=m.group(1), proc=proc, log=log))
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def call(url, method="GET", body=None, raw=None, timeout=120):
    """-> (status, headers, parsed JSON or bytes). An answer the server gives before the whole body is sent (a 413)
    is read all the same, as browsers and curl do."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    host, port, path = re.match(r"http://([\d.]+):(\d+)(.*)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        try:
            conn.request(method, path or "/", data, {"Content-Type": "application/json"})
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed early: its answer is still there to read
        r = conn.getresponse()
        status, headers, content = r.status, r.headers, r.read()
    finally:
        conn.close()
    kind = headers.get("Content-Type", "")
    return status, headers, json.loads(content) if kind.startswith("application/json") else content


def pixels(png):
    return np.array(Image.open(io.BytesIO(png)).convert("RGB"))


def b64png(array):
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def events(url, job):
    """The job's Server-Sent Events, (kind, data) until the final one."""
    host, port = re.match(r"http://([\d.]+):(\d+)", url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    conn.request("GET", f"/v1/jobs/{job}/events")
    r = conn.getresponse()
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    kind = None
    for line in r:
        line = line.decode().strip()
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, json.loads(line[6:])
            if kind in ("done", "failed", "cancelled"):
                conn.close()
                return


def wait_final(url, job, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, _, s = call(f"{url}/v1/jobs/{job}")
        if s["status"] in ("done", "failed", "cancelled"):
            return s
        time.sleep(0.05)
    raise AssertionError(f"job {job} not finished in {timeout}s")


def cli_samples(tmp_path, name, flags):
    """fast_engine.py's samples for the demo with flags, started now -> a function returning their pixels."""
    out = tmp_path / name
    cmd = [sys.executable, os.path.join(ROOT, "fast_inference", "fast_engine.py"), "--device", "cpu", "--image-H",
           "64", "--image-W", "64", "--save-samples", str(out), "--out", str(out / "grid.png"), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)

    def result(n):
        text = proc.communicate(timeout=300)[0]
        assert proc.returncode == 0, text
        return [np.array(Image.open(out / f"{k}.png")) for k in range(n)]

    return result


def test_same_seed_same_images_as_fast_engine(server, tmp_path):
    """Requests sharing the running batches (three at once, other settings and condition types) get fast_engine.py's
    images for the same seed and settings, pixel for pixel."""
    a = dict(width=64, height=64, num_images=2, seed=0)
    b = dict(width=64, height=64, seed=0, condition_type="seg", control={"example": "seg"}, top_p=0.9,
             temperature=0.8, cfg_scale=2.5, control_strength=0.5, top_k=100)
    cli_a = cli_samples(tmp_path, "a", ["--num-images", "2"])
    cli_b = cli_samples(tmp_path, "b", ["--condition-type", "seg", "--top-p", "0.9", "--temperature", "0.8",
                                        "--cfg-scale", "2.5", "--control-strength", "0.5", "--top-k", "100"])
    jobs = [call(f"{server.url}/v1/jobs", "POST", body)[2]["id"] for body in (a, dict(a, seed=5), b)]
    done = [wait_final(server.url, job) for job in jobs]
    assert [d["status"] for d in done] == ["done"] * 3
    got = {k: [pixels(call(server.url + url)[2]) for url in done[i]["images"]] for k, i in (("a", 0), ("b", 2))}
    for name, want in (("a", cli_a(2)), ("b", cli_b(1))):
        assert len(got[name]) == len(want)
        for g, w in zip(got[name], want):
            assert g.shape == w.shape == (64, 64, 3) and np.array_equal(g, w), name
    other = [pixels(call(server.url + url)[2]) for url in done[1]["images"]]
    assert not np.array_equal(other[0], got["a"][0])  # another seed, another image


def test_progress_events_preview_and_downloads(server):
    """A job's events: the tokens done grow row by row, previews of the rows done, then `done` with the images'
    URLs, which serve PNGs of the asked size; /v1/generate answers the same request with base64 PNGs."""
    status, _, job = call(f"{server.url}/v1/jobs", "POST", dict(width=64, height=128, preview_every=2, seed=3))
    assert status == 202 and job["status"] in ("queued", "running") and job["tokens_total"] == 32
    seen = list(events(server.url, job["id"]))
    kinds = [k for k, _ in seen]
    assert kinds[-1] == "done" and set(kinds[:-1]) <= {"progress"}
    done = [d["tokens_done"] for _, d in seen]
    assert done == sorted(done) and done[-1] == 32 and len(set(done)) >= 3
    assert any(d["preview"] for _, d in seen[:-1])
    final = seen[-1][1]
    image = pixels(call(server.url + final["images"][0])[2])
    assert image.shape == (128, 64, 3) and image.std() > 0
    preview = pixels(call(server.url + final["preview"])[2])
    assert preview.shape[1] == 64 and preview.shape[0] % 32 == 0 and preview.shape[0] < 128
    status, _, out = call(f"{server.url}/v1/generate", "POST", dict(width=64, height=128, seed=3))
    assert status == 200 and np.array_equal(pixels(base64.b64decode(out["images"][0])), image)


def test_upload_and_the_extracted_map(server):
    """An uploaded control image: the map the server extracts (canny, OpenCV) or takes as is (is_map), at the
    image's size rounded up to 16; a job from the upload runs."""
    seg = draw_example("seg", 60, 70)
    status, headers, png = call(f"{server.url}/v1/control", "POST", dict(control={"image": b64png(seg), "is_map": True},
                                                                         condition_type="seg"))
    assert status == 200 and headers["Content-Type"] == "image/png" and pixels(png).shape == (64, 80, 3)
    photo = draw_example("seg", 64, 64)
    status, _, png = call(f"{server.url}/v1/control", "POST", dict(control={"image": b64png(photo)},
                                                                   condition_type="canny"))
    edges = pixels(png)
    assert status == 200 and set(np.unique(edges)) <= {0, 255} and 0 < (edges == 255).mean() < 0.5
    status, _, out = call(f"{server.url}/v1/generate", "POST", dict(control={"image": b64png(photo)},
                                                                    condition_type="canny"))
    assert status == 200 and len(out["images"]) == 1
    status, _, png = call(f"{server.url}/v1/examples/depth.png")
    size = call(f"{server.url}/v1/info")[2]["image_size"]
    assert status == 200 and pixels(png).shape == (size, size, 3)


def test_every_bad_request_is_a_4xx_naming_its_field(server):
    """Missing or wrong fields, an image that is not one, too large a body or image, a size not a multiple of 16, an
    unknown condition type, a prompt without a text encoder, a pickle: each a 4xx JSON error naming the field, and
    the server keeps serving."""
    big = draw_example("seg", 600, 600)
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    cases = [
        (dict(num_images=0), 400, "num_images"), (dict(num_images=5), 400, "num_images"),
        (dict(top_p=2), 400, "top_p"), (dict(seed="x"), 400, "seed"), (dict(seed=1.5), 400, "seed"),
        (dict(width=50, height=64), 400, "width"), (dict(width=4096, height=4096), 400, "width"),
        (dict(condition_type="sketch"), 400, "condition_type"), (dict(prompt="a cat"), 400, "prompt"),
        (dict(class_label=3), 400, "class_label"), (dict(colour="red"), 400, "colour"),
        (dict(control={"image": base64.b64encode(b"not an image").decode()}), 400, "control"),
        (dict(control={"image": "%%%"}), 400, "control.image"), (dict(control={"path": "/etc/passwd"}), 400, "control"),
        (dict(control={"image": b64png(big), "is_map": True}), 413, "control"),
        (dict(caption_emb=base64.b64encode(pickled.getvalue()).decode()), 400, "caption_emb"),
        (dict(control={"image": b64png(draw_example("hed", 64, 64))}, condition_type="hed"), 400, "condition_type"),
        ([1, 2], 400, "body"),
    ]
    for body, code, field in cases:
        status, _, out = call(f"{server.url}/v1/jobs", "POST", body)
        assert (status, out.get("field")) == (code, field), (body if len(str(body)) < 200 else field, out)
        assert out["error"]
    status, _, out = call(f"{server.url}/v1/jobs", "POST", raw=b"{not json")
    assert (status, out["field"]) == (400, "body")
    status, _, out = call(f"{server.url}/v1/jobs", "POST", raw=b" " * (2**20 + 1))
    assert (status, out["field"]) == (413, "body")
    status, _, out = call(f"{server.url}/v1/jobs/nosuchjob")
    assert (status, out["field"]) == (404, "id")
    status, _, out = call(f"{server.url}/v1/generate", "POST", dict(width=64, height=64))
    assert status == 200 and len(out["images"]) == 1  # still serving


def test_an_oversized_body_is_read_before_its_413(server):
    """A client that sends its whole body before reading (as urllib does) gets the 413, not a broken pipe: the server
    reads and drops what it refuses instead of closing while the client still sends."""
    host, port = re.match(r"http://([\d.]+):(\d+)", server.url).groups()
    body = b" " * (8 * 2**20)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body))
        sock.sendall(body)  # today's servers close after the headers: this write then fails with EPIPE
        answer = sock.makefile("rb").read()
    head, _, content = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(content)["field"] == "body"


def test_cancel_disconnect_and_a_full_queue(server):
    """DELETE cancels a job; closing its events stream or /v1/generate's connection cancels it too (its rows freed:
    the queue empties); past --max-queue a request gets 503 with Retry-After and nothing is accepted; every accepted
    job ends exactly once."""
    size = call(f"{server.url}/v1/info")[2]["image_size"]
    long = dict(width=size, height=size, num_images=4)  # the model's whole grid, a batch of 4: a second on the CPU
    job = call(f"{server.url}/v1/jobs", "POST", long)[2]["id"]
    status, _, out = call(f"{server.url}/v1/jobs/{job}", "DELETE")
    assert status == 200 and wait_final(server.url, job)["status"] == "cancelled"

    job = call(f"{server.url}/v1/jobs", "POST", long)[2]["id"]
    stream = events(server.url, job)
    next(stream)
    stream.close()  # the client goes away
    assert wait_final(server.url, job)["status"] == "cancelled"

    host, port = re.match(r"http://([\d.]+):(\d+)", server.url).groups()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/generate", json.dumps(long), {"Content-Type": "application/json"})
    time.sleep(1.0)
    conn.close()
    deadline = time.time() + 60
    while call(f"{server.url}/v1/info")[2]["queue"]["active"] and time.time() < deadline:
        time.sleep(0.1)
    info = call(f"{server.url}/v1/info")[2]
    assert info["queue"]["active"] == 0 and not any(e["busy"] for e in info["engines"])

    accepted, refused = [], []
    for _ in range(14):
        status, headers, out = call(f"{server.url}/v1/jobs", "POST", long)
        if status == 202:
            accepted.append(out["id"])
        else:
            assert (status, out["field"]) == (503, "queue") and int(headers["Retry-After"]) >= 1
            refused.append(out)
    assert len(accepted) == 12 and len(refused) == 2
    for job in accepted:
        call(f"{server.url}/v1/jobs/{job}", "DELETE")
    assert {wait_final(server.url, job)["status"] for job in accepted} <= {"cancelled", "done"}
    assert call(f"{server.url}/v1/info")[2]["queue"]["active"] == 0


def test_load_every_request_answered_once(server):
    """tools/load_serve.py, small: 8 clients, 24 requests against the running server: each answered exactly once,
    none lost, both engines used."""
    cmd = [sys.executable, os.path.join(ROOT, "tools", "load_serve.py"), "--url", server.url, "--clients", "8",
           "--requests", "24", "--warmup", "0", "--lone", "1", "--json", "/dev/stdout"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout[out.stdout.index("{"):])
    load = result["load"]
    assert load["answered_once"] and load["lost"] == 0 and load["ok"] == 24 and load["distinct_jobs"]
    assert load["images_per_s"] > 0 and load["p95_s"] >= load["p50_s"] > 0
    steps = [e["steps"] for e in call(f"{server.url}/v1/info")[2]["engines"]]
    assert len(steps) == 2 and min(steps) > 0, steps  # the scheduler spread the work over both engines


def test_the_page_in_a_browser(server, tmp_path):
    """Headless Chromium loads the page, picks an example, generates, and shows the result; the screenshot's pixels
    where the result is shown are the PNG the API serves for that job."""
    sync_api = need("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        message = f"no browser at {CHROMIUM}: apt-get install -y chromium"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:  # a fresh profile (--user-data-dir) in tmp_path
        browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, args=flags,
                                                       headless=True, viewport={"width": 1200, "height": 900},
                                                       device_scale_factor=1)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=30000)
            page.click("#examples button:text('seg')")
            page.wait_for_function("document.getElementById('map').naturalWidth > 0", timeout=30000)
            page.fill("#width", "64")
            page.fill("#height", "64")
            page.fill("#seed", "7")
            page.click("#generate")
            page.wait_for_selector("img.result", timeout=120000)
            page.wait_for_function("document.querySelector('img.result').complete && "
                                   "document.querySelector('img.result').naturalWidth === 64", timeout=30000)
            assert "Done" in page.inner_text("#status")
            box = page.evaluate("(() => { const r = document.querySelector('img.result').getBoundingClientRect(); "
                                "return {x: r.x + window.scrollX, y: r.y + window.scrollY}; })()")  # in the page
            src = page.get_attribute("img.result", "src")
            shot = pixels(page.screenshot(path=str(tmp_path / "page.png"), full_page=True))
        finally:
            browser.close()
    served = pixels(call(server.url + src)[2])
    assert served.shape == (64, 64, 3) and served.std() > 0
    # the image inside its 1 px border, wherever the layout's fractions put it: the best of the nearby offsets
    x, y = round(box["x"]), round(box["y"])
    diffs = [np.abs(shot[y + dy : y + dy + 64, x + dx : x + dx + 64].astype(int) - served).mean()
             for dy in range(0, 3) for dx in range(0, 3)]
    assert min(diffs) < 2.0, (min(diffs), box)


def test_sigterm_finishes_what_runs_and_exits_cleanly(server):
    """SIGTERM: the server stops accepting at once (a new request is refused), the running job finishes (its
    /v1/generate answered with its image), and the process exits 0. (Last: it stops the module's server.)"""
    result = {}
    size = call(f"{server.url}/v1/info")[2]["image_size"]

    def generate():
        result["answer"] = call(f"{server.url}/v1/generate", "POST", dict(width=size, height=size, num_images=4),
                                timeout=120)

    t = threading.Thread(target=generate)
    t.start()
    deadline = time.time() + 30
    while not call(f"{server.url}/v1/info")[2]["queue"]["active"] and time.time() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    try:
        status, _, out = call(f"{server.url}/v1/jobs", "POST", dict(width=64, height=64), timeout=10)
        assert status == 503, out  # accepted nothing (or the socket is closed already)
    except OSError:
        pass
    assert t.is_alive()  # the running job is still running
    t.join(timeout=120)
    status, _, out = result["answer"]
    assert status == 200 and out["status"] == "done" and len(out["images"]) == 4
    assert server.proc.wait(timeout=60) == 0
    time.sleep(0.2)
    assert "server stopped" in "".join(server.log)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.url}/v1/info", timeout=5)


def test_bad_command_lines_are_one_line():
    """Bad flags: one `error:` line naming the fix, exit 2, before any model is built."""
    need("starlette"), need("uvicorn")
    for flags, words in ((["--port", "70000"], "--port"), (["--speculative", "jacobi"], "--speculative"),
                         (["--batch", "0"], "--batch"), (["--device", "cuda:7"], "cuda"),
                         (["--gpt-ckpt", "missing.safetensors"], "not found")):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "fast_inference", "serve.py"), *flags],
                             capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], \
            (flags, out.stderr)
