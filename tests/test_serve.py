"""serve.py as users use it: a real server process on the CPU with the demo model (two engines on one device), its
JSON API, its page in a headless Chromium, a small load test, bad requests, cancellation and a clean SIGTERM.

Outside CI a missing optional package (Starlette/uvicorn, Playwright) or browser skips with the reason; in CI
(CI=true, .ci/run installs them) it fails.
"""
import base64
import contextlib
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
    """The demo server: two engines on the CPU, batches of 4 images, a queue of 12 jobs, 1 MiB bodies, each engine's
    batch warmed at the model's size before serving (--warm on; the CPU's eager backend would skip it)."""
    need("starlette"), need("uvicorn")
    url, proc, log = start_server("--engines-per-device", "2", "--batch", "4", "--max-queue", "12", "--max-body-mb", "1",
                                  "--max-side", "512", "--shutdown-grace", "30", "--warm", "on")
    yield type("Server", (), dict(url=url, proc=proc, log=log))
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
    images for the same seed and settings, pixel for pixel; so does the first request, at the model's size, in a
    batch the server warmed at its start."""
    cli_first = cli_samples(tmp_path, "first", ["--image-H", "256", "--image-W", "256", "--seed", "6"])
    first = wait_final(server.url, call(f"{server.url}/v1/jobs", "POST", dict(seed=6))[2]["id"])
    assert first["status"] == "done" and first["tokens_total"] == 256
    got = pixels(call(server.url + first["images"][0])[2])
    assert got.shape == (256, 256, 3) and np.array_equal(got, cli_first(1)[0])
    a = dict(width=64, height=64, num_images=2, seed=0)
    b = dict(width=64, height=64, seed=0, condition_type="seg", control={"example": "seg"}, top_p=0.9,
             temperature=0.8, cfg_scale=2.5, control_strength=0.5, top_k=100)
    cli_a = cli_samples(tmp_path, "a", ["--num-images", "2"])
    cli_b = cli_samples(tmp_path, "b", ["--condition-type", "seg", "--top-p", "0.9", "--temperature", "0.8",
                                        "--cfg-scale", "2.5", "--control-strength", "0.5", "--top-k", "100"])
    one = dict(width=16, height=16, seed=4)  # one token: drawn at the prefill, no step
    cli_one = cli_samples(tmp_path, "one", ["--image-H", "16", "--image-W", "16", "--seed", "4"])
    jobs = [call(f"{server.url}/v1/jobs", "POST", body)[2]["id"] for body in (a, dict(a, seed=5), b, one)]
    done = [wait_final(server.url, job) for job in jobs]
    assert [d["status"] for d in done] == ["done"] * 4
    assert (done[3]["tokens_done"], done[3]["tokens_total"]) == (1, 1)
    got = {k: [pixels(call(server.url + url)[2]) for url in done[i]["images"]]
           for k, i in (("a", 0), ("b", 2), ("one", 3))}
    for name, want, side in (("a", cli_a(2), 64), ("b", cli_b(1), 64), ("one", cli_one(1), 16)):
        assert len(got[name]) == len(want)
        for g, w in zip(got[name], want):
            assert g.shape == w.shape == (side, side, 3) and np.array_equal(g, w), name
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
    said = [{**d, "seconds": None} for _, d in seen]
    assert all(a != b for a, b in zip(said, said[1:])), said  # each event says something new (the first not twice)
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
        (dict(control={"image": base64.b64encode(b"not an image").decode()}), 400, "control.image"),
        (dict(control={"image": "%%%"}), 400, "control.image"), (dict(control={"path": "/etc/passwd"}), 400, "control"),
        (dict(control={"image": b64png(big), "is_map": True}), 413, "control.image"),
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


def readme_serving_examples():
    """The commands of the serving guide (docs/serving.md, linked from README's Serving section) that talk to a running
    server (curl), continuation lines joined."""
    with open(os.path.join(ROOT, "docs", "serving.md"), encoding="utf-8") as f:
        section = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    commands = [c.strip() for block in blocks for c in block.replace("\\\n", " ").splitlines()]
    return [c for c in commands if c.startswith("curl")]


def test_readme_serving_examples_run_as_written(server):
    """Every curl example of the serving guide (docs/serving.md), run as written (localhost:8000 made the test server's
    address), gets a JSON answer that is no error; a request's images are done."""
    examples = readme_serving_examples()
    assert examples, "docs/serving.md has no curl example"
    address = server.url.removeprefix("http://")
    for command in examples:
        assert "localhost:8000" in command, command
        out = subprocess.run(["bash", "-c", command.replace("localhost:8000", address)], capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, (command, out.stderr)
        answer = json.loads(out.stdout)
        assert "error" not in answer or answer["error"] is None, (command, answer)
        if "status" in answer:
            assert answer["status"] == "done" and len(answer["images"]) >= 1, (command, answer)


def test_info_advertises_the_limits_it_enforces(server):
    """/v1/info's ranges and limits are the ones requests meet: each range's ends are accepted and a step past them
    refused naming the field; num_images up to the batch; a side up to 16 x the grid's tokens, and width/16 x
    height/16 up to max_tokens; an upload's sides up to max_side; a body of max_body_bytes."""
    info = call(f"{server.url}/v1/info")[2]
    ranges, limits = info["ranges"], info["limits"]
    assert ranges["num_images"] == [1, limits["max_images"]] == [1, 4]  # the test server's --batch 4
    assert ranges["width"] == ranges["height"] == [16, 16 * limits["max_tokens"]]
    assert limits["max_tokens"] == info["grid_tokens"] and limits["max_side"] == 512

    def job(body, want_status, field=None):
        status, _, out = call(f"{server.url}/v1/jobs", "POST", dict(dict(width=16, height=16), **body))
        assert (status, out.get("field")) == (want_status, field), (body, out)
        if status == 202:
            wait_final(server.url, out["id"])

    for name, (low, high) in ranges.items():
        if name in ("width", "height"):
            continue
        step = 1 if name in ("top_k", "seed", "num_images", "preview_every") else 0.01
        job({name: low}, 202)
        job({name: low - step}, 400, name)
        if high is not None:
            job({name: high}, 202)
            job({name: high + step}, 400, name)

    def control(width, height, want_status, field=None):
        status, _, out = call(f"{server.url}/v1/control", "POST", dict(width=width, height=height))
        assert (status, out.get("field") if isinstance(out, dict) else None) == (want_status, field), (width, height)
        if status == 200:
            assert pixels(out).shape == (height, width, 3)

    most, tokens = ranges["width"][1], limits["max_tokens"]
    control(most, 16, 200), control(16, most, 200)
    control(most + 16, 16, 400, "width"), control(16, most + 16, 400, "height")
    control(0, 16, 400, "width"), control(16, 0, 400, "height")
    square = int(tokens ** 0.5) * 16
    control(square, square, 200), control(square + 16, square, 400, "width")
    side = limits["max_side"]
    for w, want in ((side, 200), (side + 1, 413)):
        status, _, out = call(f"{server.url}/v1/control", "POST",
                              dict(control={"image": b64png(np.zeros((16, w, 3), np.uint8)), "is_map": True},
                                   condition_type="seg"))
        assert status == want, (w, out)
    body = json.dumps(dict(width=16, height=16)).encode()
    status, _, out = call(f"{server.url}/v1/jobs", "POST", raw=body + b" " * (limits["max_body_bytes"] - len(body)))
    assert status == 202, out
    wait_final(server.url, out["id"])


def test_uploads_are_fitted_to_what_the_model_draws(server):
    """An upload larger than the model's grid (without width and height) is fitted: its aspect kept as near as
    multiples of 16 allow, within the grid's tokens; a job from it runs; asked sizes are kept, and a size the model
    cannot draw is refused written as width x height."""
    tokens = call(f"{server.url}/v1/info")[2]["limits"]["max_tokens"]
    k = beyond(tokens)
    photo = draw_example("seg", 208 * k, 160 * k)  # 160k wide, 208k high: 130k^2 tokens at its own size
    upload = dict(control={"image": b64png(photo), "is_map": True}, condition_type="seg")
    status, _, png = call(f"{server.url}/v1/control", "POST", upload)
    assert status == 200, png
    h, w = pixels(png).shape[:2]
    assert (h // 16) * (w // 16) <= tokens and h % 16 == w % 16 == 0 and h > w
    assert abs(h / w - 208 / 160) < 0.2, (w, h)
    status, _, out = call(f"{server.url}/v1/generate", "POST", dict(upload, seed=1))
    assert status == 200 and pixels(base64.b64decode(out["images"][0])).shape == (h, w, 3)
    assert (out["width"], out["height"]) == (w, h)
    status, _, png = call(f"{server.url}/v1/control", "POST", dict(upload, width=64, height=32))
    assert status == 200 and pixels(png).shape == (32, 64, 3)
    status, _, out = call(f"{server.url}/v1/control", "POST", dict(upload, width=160 * k, height=208 * k))
    assert status == 400 and f"{160 * k}x{208 * k} (width x height)" in out["error"], out


def beyond(tokens):
    """The smallest k for which a 208k x 160k upload needs more than the model's tokens."""
    return next(k for k in range(1, 64) if 130 * k * k > tokens)


def test_fitted_sizes_keep_the_shape_within_the_grid():
    """fitted_size: an upload's size rounded up where the grid holds it, else the largest multiples of the step near
    its aspect ratio within the grid, thin strips included (a side of one step)."""
    need("starlette")
    from fast_inference.serve import fitted_size

    assert fitted_size(60, 70, 16, 64) == (64, 80) and fitted_size(128, 128, 32, 64) == (128, 128)
    assert fitted_size(208, 160, 16, 64) == (144, 112) and fitted_size(1000, 1000, 32, 64) == (128, 128)
    for h, w, step in ((16, 2048, 16), (2048, 17, 16), (2048, 17, 32), (150, 150, 32), (512, 100, 16), (999, 333, 16)):
        H, W = fitted_size(h, w, step, 64)
        assert H % step == W % step == 0 and min(H, W) >= step and (H // 16) * (W // 16) <= 64, (h, w, step, H, W)
        assert (H >= W) == (h >= w), (h, w, H, W)


def test_control_fields_and_routing_errors_are_the_apis_json(server):
    """Inside control only its own fields are taken; an example is a map of its type (with another condition_type it
    is refused, alone it sets the type); an upload's mistakes name control.image; a page or method that does not
    exist is a JSON 404 / 405 naming what to use."""
    hed = b64png(draw_example("hed", 64, 64))
    cases = [
        (dict(control={"example": "seg", "size": 3}), 400, "control.size"),
        (dict(control={"image": hed, "is_map": True, "threshold": 3}, condition_type="hed"), 400, "control.threshold"),
        (dict(control={"example": "seg", "is_map": True}), 400, "control.is_map"),
        (dict(control={"example": "hed"}, condition_type="seg"), 400, "control.example"),
        (dict(control={"example": "mud"}), 400, "control.example"),
        (dict(control={"image": hed, "is_map": "yes"}, condition_type="seg"), 400, "control.is_map"),
        (dict(control={"image": base64.b64encode(b"GIF89a nonsense").decode()}), 400, "control.image"),
        (dict(control={"image": "%%%"}), 400, "control.image"),
        (dict(control="hed"), 400, "control"),
    ]
    for body, code, field in cases:
        for path in ("/v1/jobs", "/v1/control"):
            status, _, out = call(f"{server.url}{path}", "POST", body)
            assert (status, out.get("field")) == (code, field), (path, body, out)
    status, _, png = call(f"{server.url}/v1/control", "POST", dict(control={"example": "seg"}, width=32, height=32))
    want = call(f"{server.url}/v1/control", "POST", dict(condition_type="seg", width=32, height=32))[2]
    assert status == 200 and np.array_equal(pixels(png), pixels(want))  # the example's own type
    for method, path, code, field in (("GET", "/nowhere", 404, "path"), ("POST", "/v1/info", 405, "method"),
                                      ("GET", "/v1/generate", 405, "method"), ("PUT", "/v1/jobs/x", 405, "method")):
        status, headers, out = call(server.url + path, method)
        assert status == code and headers["Content-Type"] == "application/json", (path, out)
        assert out["field"] == field and path in out["error"], out


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
    stream = events(server.url, job)
    seen = [next(stream)]
    while seen[-1][1]["status"] != "running":
        seen.append(next(stream))
    status, _, out = call(f"{server.url}/v1/jobs/{job}", "DELETE")
    assert status == 200 and wait_final(server.url, job)["status"] == "cancelled"
    seen += list(stream)
    said = [{**d, "seconds": None} for _, d in seen]
    assert seen[-1][0] == "cancelled" and all(a != b for a, b in zip(said, said[1:])), said  # no event twice

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
    # where the engines' time went in the timed phase: steps of 1 to 4 images (the batch), time admitting, stepping
    # and decoding, no more wall time than the phase's in any of a thread's parts
    threads = result["engine_threads"]
    assert sum(e["steps"] for e in threads) > 0 and all(0 < e["mean_images"] <= 4 for e in threads if e["steps"])
    assert all(set(e["seconds"]) == {"idle", "admit", "step", "decode"} for e in threads)
    assert sum(e["seconds"]["admit"] for e in threads) > 0 and sum(e["seconds"]["decode"] for e in threads) > 0
    assert all(0 < e["seconds"]["step"] <= load["seconds"] + 1 for e in threads if e["steps"]), threads
    # the jobs decoded in the phase, each engine's mean per stage: none negative, none longer than the phase
    assert sum(e["jobs"] for e in threads) == 24
    assert all(0 <= v <= load["seconds"] for e in threads if e["jobs"] for v in e["per_job_seconds"].values()), threads
    # the lone request's time by stage: its one job, its tokens' steps, and the rest at the client, none negative
    lone = result["lone"]
    assert lone["requests"] == 1 and lone["jobs"] == 1 and lone["per_job_seconds"]["tokens"] > 0, lone
    assert min(lone["per_job_seconds"].values()) >= 0 and lone["step_ms"] > 0 and lone["outside_s"] > -0.01, lone
    assert abs(lone["image_s"] - sum(lone["per_job_seconds"].values())) < 1e-3
    assert lone["image_s"] + lone["outside_s"] <= result["lone_request_s"] + 0.01, lone


VIEWPORTS = dict(desktop=dict(viewport={"width": 1200, "height": 900}),
                 phone=dict(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True))


@contextlib.contextmanager
def browser_page(tmp_path, size="desktop"):
    """A page in headless Chromium (Playwright driving the system browser) at a desktop's or a phone's size."""
    sync_api = need("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        message = f"no browser at {CHROMIUM}: apt-get install -y chromium"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with sync_api.sync_playwright() as p:  # a fresh profile (--user-data-dir) in tmp_path
        browser = p.chromium.launch_persistent_context(str(tmp_path / f"profile-{size}"), executable_path=CHROMIUM,
                                                       args=flags, headless=True, device_scale_factor=1,
                                                       **VIEWPORTS[size])
        try:
            yield browser.new_page()
        finally:
            browser.close()


def open_page(page, url):
    page.goto(url + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=30000)
    page.wait_for_selector("body[data-state='ready']", timeout=30000)


def no_sideways_scroll(page):
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= page.viewport_size["width"], (width, page.viewport_size)


def shown_pixels(shot, box, size):
    """The pixels of an image shown scaled (nearest neighbour) at box: each source pixel read at its centre."""
    ys = [int(box["y"] + (i + 0.5) * box["height"] / size[0]) for i in range(size[0])]
    xs = [int(box["x"] + (j + 0.5) * box["width"] / size[1]) for j in range(size[1])]
    return shot[np.ix_(ys, xs)]


@pytest.mark.parametrize("size", ["desktop", "phone"])
def test_the_page_in_a_browser(server, tmp_path, size):
    """The page at a desktop's and a phone's size: no sideways scroll; the status says what is so (ready once a map is
    shown); a tap on Generate changes it at once and brings the results into view; an empty seed box sends a random
    seed; previews of every image are drawn, then the images at a readable size with their seeds, and the screenshot's
    pixels there are the PNGs the API serves."""
    with browser_page(tmp_path, size) as page:
        open_page(page, server.url)
        assert page.inner_text("#status").startswith("Ready")
        no_sideways_scroll(page)
        page.click("#examples button:text('seg')")
        page.fill("#width", "64")
        page.fill("#height", "64")
        page.dispatch_event("#height", "change")
        page.wait_for_function("document.getElementById('map').naturalWidth === 64 && "
                               "document.getElementById('map').naturalHeight === 64 && "
                               "document.body.dataset.state === 'ready'", timeout=30000)
        assert "seg map" in page.inner_text("#map_note") and "64x64" in page.inner_text("#map_note")
        page.fill("#seed", "")
        page.fill("#num_images", "2")
        before = page.inner_text("#status")
        with page.expect_request("**/v1/jobs") as sent:
            page.tap("#generate") if size == "phone" else page.click("#generate")
        body = sent.value.post_data_json
        assert body["seed"] != 0 and body["width"] == body["height"] == 64 and body["num_images"] == 2
        assert page.inner_text("#status") != before
        page.wait_for_function("document.getElementById('outputs').getBoundingClientRect().top >= 0 && "
                               "document.getElementById('outputs').getBoundingClientRect().top < window.innerHeight"
                               " - 100", timeout=10000)
        page.wait_for_function("document.querySelectorAll('img.result').length === 2 && "
                               "[...document.querySelectorAll('img.result')].every(i => i.complete && "
                               "i.naturalWidth === 64)", timeout=120000)
        assert page.evaluate("document.body.dataset.state") == "done"
        assert page.inner_text("#status").startswith("Done") and f"seed {body['seed']}" in page.inner_text("#status")
        assert int(page.evaluate("document.body.dataset.previews || 0")) >= 1  # drawn into every image's canvas
        captions = page.eval_on_selector_all("#results figcaption", "els => els.map(e => e.textContent)")
        assert len(captions) == 2 and all(f"seed {body['seed']}" in c for c in captions), captions
        boxes = page.evaluate("[...document.querySelectorAll('img.result')].map(i => { const r = "
                              "i.getBoundingClientRect(); return {x: r.x + window.scrollX + 1, y: r.y + window.scrollY"
                              " + 1, width: r.width - 2, height: r.height - 2}; })")  # inside the 1 px border
        srcs = page.eval_on_selector_all("img.result", "els => els.map(e => e.getAttribute('src'))")
        no_sideways_scroll(page)
        shot = pixels(page.screenshot(path=str(tmp_path / f"page-{size}.png"), full_page=True))
        # Jobs ahead of the page's keep both engines busy for seconds, so that its Cancel lands while its job waits (a
        # slow browser under load twice clicked after a lone job had ended); they are cancelled after
        side = call(f"{server.url}/v1/info")[2]["image_size"]
        ahead = [call(f"{server.url}/v1/jobs", "POST", dict(width=side, height=side, num_images=4))[2]["id"]
                 for _ in range(10)]
        try:
            page.fill("#width", "128")
            page.fill("#height", "128")
            page.fill("#num_images", "4")
            page.click("#generate")
            page.wait_for_selector("body[data-state='queued'], body[data-state='running']", timeout=60000)
            page.click("#cancel")  # the page's own Cancel: the cancelled state, no error
            page.wait_for_selector("body[data-state='cancelled']", timeout=60000)
            assert page.inner_text("#status") == "Cancelled." and not page.inner_text("#error")
        finally:
            for job in ahead:
                call(f"{server.url}/v1/jobs/{job}", "DELETE")
            assert {wait_final(server.url, job)["status"] for job in ahead} <= {"cancelled", "done"}
    assert all(box["width"] >= 250 for box in boxes), boxes  # readable: 64 px images shown at 4x or so
    for box, src in zip(boxes, srcs):
        served = pixels(call(server.url + src)[2])
        assert served.shape == (64, 64, 3) and served.std() > 0
        diff = np.abs(shown_pixels(shot, box, (64, 64)).astype(int) - served).mean()
        assert diff < 4.0, (diff, box)


def test_the_page_fits_uploads_and_keeps_typed_sizes(server, tmp_path):
    """An upload larger than the model's grid: the form shows the size the server fitted it to, and the map; a typed
    width and height stay through a map refresh; a size the model cannot draw clears the map and says why."""
    tokens = call(f"{server.url}/v1/info")[2]["limits"]["max_tokens"]
    big, k = io.BytesIO(), beyond(tokens)
    Image.fromarray(draw_example("seg", 208 * k, 160 * k)).save(big, format="PNG")
    with browser_page(tmp_path) as page:
        open_page(page, server.url)
        page.select_option("#condition_type", "seg")
        page.check("#is_map")
        page.set_input_files("#upload", files=[dict(name="big.png", mimeType="image/png", buffer=big.getvalue())])
        page.wait_for_function("document.getElementById('map_note').textContent.includes('upload')", timeout=30000)
        w, h = int(page.input_value("#width")), int(page.input_value("#height"))
        assert (w // 16) * (h // 16) <= tokens and h > w and page.is_visible("#map")
        assert page.evaluate("[document.getElementById('map').naturalWidth, document.getElementById('map')"
                             ".naturalHeight]") == [w, h]
        page.fill("#width", "64")
        page.fill("#height", "32")
        page.dispatch_event("#height", "change")
        page.wait_for_function("document.getElementById('map').naturalWidth === 64 && "
                               "document.getElementById('map').naturalHeight === 32", timeout=30000)
        page.uncheck("#is_map")  # refreshes the map (now extracted as seg): the typed size stays
        page.wait_for_function("document.getElementById('map_note').textContent.includes('64x32') && "
                               "document.getElementById('map').naturalHeight === 32", timeout=30000)
        assert (page.input_value("#width"), page.input_value("#height")) == ("64", "32")
        wide = (tokens // 2 + 1) * 16  # two rows of tokens this wide need more than the model's
        page.fill("#width", str(wide))
        page.dispatch_event("#width", "change")
        page.wait_for_function("document.body.dataset.state === 'invalid'", timeout=30000)
        assert f"{wide}x32 (width x height)" in page.inner_text("#map_note") and not page.is_visible("#map")
        page.screenshot(path=str(tmp_path / "upload.png"), full_page=True)


def start_server(*flags):
    """Another demo server process (one engine on the CPU) -> (url, process, its log lines so far and to come)."""
    cmd = [sys.executable, os.path.join(ROOT, "fast_inference", "serve.py"), "--port", "0", "--device", "cpu", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=ENV)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)", line)
        if m:
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return m.group(1), proc, lines
    pytest.fail("the server did not start:\n" + "".join(lines))


def test_sigterm_past_the_grace_answers_every_waiting_client(tmp_path):
    """SIGTERM with no grace left: the running and the queued jobs are cancelled, and every client waiting on one gets
    its outcome: /v1/generate a JSON 503 saying so, an event stream its `cancelled` event, the page its cancelled
    state; the process exits 0 without a traceback."""
    need("starlette"), need("uvicorn")
    url, proc, log = start_server("--batch", "2", "--shutdown-grace", "0")
    try:
        long = dict(num_images=2)  # the model's whole grid in both of the batch's slots: one job at a time
        with browser_page(tmp_path) as page:
            open_page(page, url)
            page.fill("#num_images", "2")
            for _ in range(4):  # the page's job waits behind these, so it cannot end before the signal however fast
                call(f"{url}/v1/jobs", "POST", long)
            page.click("#generate")
            page.wait_for_selector("body[data-state='queued']", timeout=60000)
            streamed = call(f"{url}/v1/jobs", "POST", long)[2]["id"]  # queued behind the page's
            seen, answer = [], {}
            listen = threading.Thread(target=lambda: seen.extend(events(url, streamed)))
            wait = threading.Thread(target=lambda: answer.update(out=call(f"{url}/v1/generate", "POST", long)))
            listen.start(), wait.start()
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            page.wait_for_selector("body[data-state='cancelled']", timeout=30000)
            assert page.inner_text("#status") == "Cancelled." and "shut down" in page.inner_text("#error")
            assert not page.query_selector("img.result")
            page.screenshot(path=str(tmp_path / "cancelled.png"), full_page=True)
        listen.join(timeout=30), wait.join(timeout=30)
        status, _, out = answer["out"]
        assert status == 503 and out["status"] == "cancelled" and "shut down" in out["error"], out
        assert seen and seen[-1][0] == "cancelled" and "shut down" in seen[-1][1]["error"], seen[-1:]
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)
    text = "".join(log)
    assert "server stopped" in text and "Traceback" not in text and "CancelledError" not in text, text


def test_sigterm_drains_then_exits_cleanly(server):
    """SIGTERM: new jobs are refused at once (a JSON 503 naming the queue; /healthz 503) while the socket stays open
    for the rest: the running job finishes (its /v1/generate answered with its images), a client polling another job
    gets its status and then its images after the signal; then the process exits 0 with no traceback in its log.
    (Last: it stops the module's server.)"""
    result = {}
    size = call(f"{server.url}/v1/info")[2]["image_size"]
    long = dict(width=size, height=size, num_images=4)

    def generate():
        result["answer"] = call(f"{server.url}/v1/generate", "POST", long, timeout=120)

    t = threading.Thread(target=generate)
    t.start()
    polled = call(f"{server.url}/v1/jobs", "POST", dict(long, seed=8))[2]["id"]
    deadline = time.time() + 30
    while call(f"{server.url}/v1/info")[2]["queue"]["active"] < 2 and time.time() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    status, headers, out = call(f"{server.url}/v1/jobs", "POST", dict(width=64, height=64), timeout=10)
    assert (status, out["field"]) == (503, "queue") and "shutting down" in out["error"] and headers["Retry-After"]
    assert call(f"{server.url}/healthz")[0] == 503
    assert t.is_alive()  # the running job is still running
    final = wait_final(server.url, polled)
    assert final["status"] == "done"
    for url in final["images"]:
        status, _, png = call(server.url + url)
        assert status == 200 and pixels(png).shape == (size, size, 3)
    t.join(timeout=120)
    status, _, out = result["answer"]
    assert status == 200 and out["status"] == "done" and len(out["images"]) == 4
    assert server.proc.wait(timeout=60) == 0
    time.sleep(0.2)
    log = "".join(server.log)
    assert "server stopped" in log and "Traceback" not in log and "CancelledError" not in log, log
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{server.url}/v1/info", timeout=5)


def test_bad_command_lines_are_one_line():
    """Bad flags: one `error:` line naming the fix, exit 2, before any model is built."""
    need("starlette"), need("uvicorn")
    for flags, words in ((["--port", "70000"], "--port"), (["--speculative", "jacobi"], "--speculative"),
                         (["--batch", "0"], "--batch"), (["--decoders", "0"], "--decoders"), (["--warm", "x"], "--warm"),
                         (["--device", "cuda:7"], "cuda"),
                         (["--gpt-ckpt", "missing.safetensors"], "not found")):
        out = subprocess.run([sys.executable, os.path.join(ROOT, "fast_inference", "serve.py"), *flags],
                             capture_output=True, text=True, cwd=ROOT, env=ENV, timeout=120)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], \
            (flags, out.stderr)
