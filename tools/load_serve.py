"""Load test of the server (fast_inference/serve.py), loopback only: concurrent clients send a bounded number of
requests; every request must be answered exactly once (retried only on 503, when nothing was accepted); reports
images/s and the latency's p50/p95. With --compare, the same run also times the work the batch CLIs do: fast_eval.py
over the same inputs at --eval-batch, and one image through fast_engine.py against a lone request to the server.

    python tools/load_serve.py --clients 32 --requests 200                    # the CPU demo model, 64x64
    python tools/load_serve.py --clients 32 --requests 200 --size 512 --compare -- --gpt-model GPT-XL
                                                                              # a GPU, GPT-XL shapes, random weights

The model flags after `--` go to the server and the CLIs alike (fast_engine.py's); without --url a server is started
with them on a free port and stopped at the end. Inputs are a synthetic split (scripts/make_synthetic_set.py): seg
maps as ready control maps, random caption embeddings. The summary is printed and written as JSON (--json).
"""
import argparse
import base64
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one with the model flags)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients (default %(default)s)")
    p.add_argument("--requests", type=int, default=200, help="requests in the timed phase (default %(default)s)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels, a multiple of 16 (default %(default)s)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed requests first, all clients at once (default: --clients; compiles each step size)")
    p.add_argument("--lone", type=int, default=3, help="lone requests timed one after another (default %(default)s)")
    p.add_argument("--compare", action="store_true",
                   help="also time fast_eval.py over the same inputs and one image through fast_engine.py")
    p.add_argument("--eval-batch", type=int, default=32, help="fast_eval.py's --batch (default %(default)s)")
    p.add_argument("--server-args", default="", help="more flags for the server (e.g. '--batch 32')")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default %(default)s)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("model", nargs=argparse.REMAINDER, help="-- then model flags for the server and the CLIs")
    args = p.parse_args(argv)
    args.model = [a for a in args.model if a != "--"]
    if args.size % 16 or args.size < 16 or args.clients < 1 or args.requests < 1:
        p.error("--size must be a positive multiple of 16, --clients and --requests at least 1")
    return args


# ---- the server ----------------------------------------------------------------------------------------------------

def start_server(model, extra):
    """A server on a free loopback port -> (process, url), once it says it serves."""
    cmd = [sys.executable, os.path.join(ROOT, "fast_inference", "serve.py"), "--host", "127.0.0.1", "--port", "0",
           *model, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        m = re.search(r"serving .* on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
            return proc, m.group(1)
    raise SystemExit("error: the server did not start:\n" + "".join(lines[-20:]))


def stop_server(proc):
    proc.terminate()
    try:
        return proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def post(url, body, timeout):
    """POST JSON -> (status, JSON body, Retry-After)."""
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r), None
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), e.headers.get("Retry-After")


# ---- requests ------------------------------------------------------------------------------------------------------

def make_inputs(folder, n, size, caption_dim):
    """The synthetic split's first n samples as request bodies (seg maps as ready maps, caption embeddings of the
    server model's width)."""
    from make_synthetic_set import write_split

    write_split(folder, n, size=size, caption_dim=caption_dim)
    bodies = []
    for i in range(n):
        read = lambda sub, ext: base64.b64encode(open(os.path.join(folder, sub, f"{i}{ext}"), "rb").read()).decode()
        bodies.append({"control": {"image": read("control", ".png"), "is_map": True}, "condition_type": "seg",
                       "caption_emb": read("caption_emb", ".npz"), "seed": i, "width": size, "height": size})
    return bodies


def run_clients(url, bodies, clients, timeout):
    """Each body sent once by one of `clients` threads through /v1/generate -> (answers, retries, seconds). A 503
    (nothing accepted) is retried after its Retry-After; any other answer is final."""
    todo, lock = list(enumerate(bodies)), threading.Lock()
    answers, retries = {}, [0]

    def client():
        while True:
            with lock:
                if not todo:
                    return
                i, body = todo.pop(0)
            t0 = time.perf_counter()
            while True:
                status, out, retry = post(url + "/v1/generate", body, timeout)
                if status != 503:
                    break
                with lock:
                    retries[0] += 1
                time.sleep(float(retry or 1))
            with lock:
                answers.setdefault(i, []).append((status, out.get("id"), time.perf_counter() - t0,
                                                  len(out.get("images") or []), out.get("error")))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers, retries[0], time.perf_counter() - t0


def summarize(answers, n, seconds, retries):
    """Every request answered exactly once, each a different job with its images -> the load figures."""
    once = all(len(answers.get(i, [])) == 1 for i in range(n))
    final = [a[0] for i in range(n) for a in answers.get(i, [])]
    ids = [a[1] for i in range(n) for a in answers.get(i, [])]
    done = [a for i in range(n) for a in answers.get(i, []) if a[0] == 200]
    latency = sorted(a[2] for a in done)
    images = sum(a[3] for a in done)
    pct = lambda q: latency[min(len(latency) - 1, int(q * len(latency)))] if latency else None
    return dict(requests=n, answered=len(final), answered_once=once, ok=len(done), lost=n - len(answers),
                distinct_jobs=len(set(ids)) == len(ids),
                failed=[x[4] for tries in answers.values() for x in tries if x[0] != 200][:5],
                retries_503=retries, seconds=round(seconds, 3), images=images,
                images_per_s=round(images / seconds, 3), p50_s=pct(0.5) and round(pct(0.5), 3),
                p95_s=pct(0.95) and round(pct(0.95), 3))


# ---- the CLIs, in the same run -------------------------------------------------------------------------------------

def time_eval(model, folder, n, size, batch):
    """fast_eval.py over the split at --batch: images/s over its batches after the first (compile left out)."""
    out = tempfile.mkdtemp(prefix="load_eval_")
    cmd = [sys.executable, os.path.join(ROOT, "fast_inference", "fast_eval.py"), *model, "--condition-type", "seg",
           "--data-path", folder, "--sample-dir", out, "--batch", str(batch), "--end", str(n),
           "--image-H", str(size), "--image-W", str(size)]
    subprocess.run(cmd, check=True, cwd=ROOT)
    logs = [json.loads(line) for f in os.listdir(os.path.join(out, "logs"))
            for line in open(os.path.join(out, "logs", f))]
    batches = [r for r in logs if r["event"] == "batch"][1:]
    images = sum(len(r["names"]) for r in batches)
    seconds = sum(len(r["names"]) / r["images_per_s"] for r in batches)
    return dict(batch=batch, images=images, seconds=round(seconds, 3),
                images_per_s=round(images / seconds, 3) if seconds else None)


def time_cli(model, folder, size):
    """One image through fast_engine.py after two warm-up images: its stages' seconds (condition encoder, prefill,
    decode, VQ decode) added up."""
    cmd = [sys.executable, os.path.join(ROOT, "fast_inference", "fast_engine.py"), *model, "--condition-type", "seg",
           "--condition-path", os.path.join(folder, "control", "0.png"), "--condition-is-map",
           "--caption-emb", os.path.join(folder, "caption_emb", "0.npz"), "--image-H", str(size), "--image-W",
           str(size), "--warmup", "2", "--out", os.path.join(tempfile.mkdtemp(prefix="load_cli_"), "0.png")]
    text = subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, text=True).stdout
    stages = {k: float(v) for k, v in re.findall(r"(condition encoder|prefill|decode|VQ decode) ([\d.]+)s", text)}
    return dict(stages=stages, seconds=round(sum(stages.values()), 4))


def engine_time(before, after):
    """An engine's work between two /v1/info answers: its steps, their mean images, its threads' wall seconds
    (waiting for work, admitting, issuing steps, VQ decoding), and the mean seconds of the jobs it decoded meanwhile
    in each stage (queued, its tokens issued, waiting for the decoder, decoding)."""
    steps = after["steps"] - before["steps"]
    images = after["images_stepped"] - before["images_stepped"]
    jobs = after["jobs_done"] - before["jobs_done"]
    per_job = {k: round((after["job_seconds"][k] - before["job_seconds"][k]) / max(jobs, 1), 3)
               for k in after["job_seconds"]}
    return dict(steps=steps, mean_images=round(images / max(steps, 1), 2),
                seconds={k: round(after["seconds"][k] - before["seconds"][k], 2) for k in after["seconds"]},
                jobs=jobs, per_job_seconds=per_job)


def lone_time(before, after, walls):
    """Where the lone requests' time went, summed over the engines: a request's mean seconds in each of the server's
    stages (queued; tokens: its prefill and steps; decode_queue; decode) and their sum (image_s: the server's time
    for the image, as fast_engine.py's stages time its image, neither counting a PNG), a step's mean ms, and the rest
    of its wall time at the client (the request's parsing, the PNG answer, HTTP)."""
    if not walls:
        return None
    pairs = list(zip(before["engines"], after["engines"]))
    jobs = sum(b["jobs_done"] - a["jobs_done"] for a, b in pairs)
    steps = sum(b["steps"] - a["steps"] for a, b in pairs)
    step_s = sum(b["seconds"]["step"] - a["seconds"]["step"] for a, b in pairs)
    stages = {k: round(sum(b["job_seconds"][k] - a["job_seconds"][k] for a, b in pairs) / max(jobs, 1), 4)
              for k in after["engines"][0]["job_seconds"]}
    return dict(requests=len(walls), jobs=jobs, per_job_seconds=stages, image_s=round(sum(stages.values()), 4),
                step_ms=round(1e3 * step_s / steps, 4) if steps else None,
                outside_s=round(statistics.mean(walls) - sum(stages.values()), 4))


def main(argv=None):
    args = parse_args(argv)
    folder = tempfile.mkdtemp(prefix="load_split_")
    proc = None
    if args.url is None:
        proc, args.url = start_server(args.model, args.server_args.split())
    try:
        caption_dim = json.load(urllib.request.urlopen(args.url + "/v1/info"))["caption_dim"]
        bodies = make_inputs(folder, args.requests, args.size, caption_dim)
        warm = args.clients if args.warmup is None else args.warmup
        post(args.url + "/v1/generate", bodies[0], args.timeout)
        run_clients(args.url, bodies[:warm], min(args.clients, max(warm, 1)), args.timeout)
        lone = []
        alone = json.load(urllib.request.urlopen(args.url + "/v1/info"))
        for i in range(args.lone):
            t0 = time.perf_counter()
            status, out, _ = post(args.url + "/v1/generate", bodies[i % len(bodies)], args.timeout)
            lone.append(time.perf_counter() - t0)
            assert status == 200, out
        before = json.load(urllib.request.urlopen(args.url + "/v1/info"))
        answers, retries, seconds = run_clients(args.url, bodies, args.clients, args.timeout)
        info = json.load(urllib.request.urlopen(args.url + "/v1/info"))
    finally:
        code = stop_server(proc) if proc is not None else 0
    result = dict(clients=args.clients, size=args.size, model=info["model"], engines=[e["device"] for e in
                                                                                      info["engines"]],
                  load=summarize(answers, len(bodies), seconds, retries),
                  lone_request_s=round(statistics.median(lone), 4) if lone else None,
                  lone=lone_time(alone, before, lone), server_exit=code,
                  engine_threads=[engine_time(a, b) for a, b in zip(before["engines"], info["engines"])])
    if args.compare:
        result["fast_eval"] = time_eval(args.model, folder, args.requests, args.size, args.eval_batch)
        cli = time_cli(args.model, folder, args.size)
        result["fast_engine_one_image_s"], result["fast_engine_stages_s"] = cli["seconds"], cli["stages"]
    load = result["load"]
    print(f"{load['requests']} requests from {args.clients} clients on {info['model']} ({', '.join(result['engines'])}"
          f", {args.size}x{args.size}): answered once {load['answered_once']}, lost {load['lost']}, 503 retries "
          f"{load['retries_503']}; {load['images_per_s']} images/s, latency p50 {load['p50_s']}s p95 {load['p95_s']}s;"
          f" a lone request {result['lone_request_s']}s")
    if result["lone"]:
        lone = result["lone"]
        stages = ", ".join(f"{k} {v}s" for k, v in lone["per_job_seconds"].items())
        print(f"a lone request in the server: {stages}, {lone['step_ms']} ms a step; outside those (parsing, the PNG "
              f"answer, HTTP): {lone['outside_s']}s")
    for i, e in enumerate(result["engine_threads"]):
        spent = ", ".join(f"{k} {v}s" for k, v in e["seconds"].items())
        per_job = ", ".join(f"{k} {v}s" for k, v in e["per_job_seconds"].items())
        print(f"engine {i} in the timed phase: {e['steps']} steps of {e['mean_images']} images on average; its "
              f"threads' wall time: {spent}; a job's mean over its {e['jobs']} decoded: {per_job}")
    if args.compare:
        print(f"fast_eval.py --batch {args.eval_batch}: {result['fast_eval']['images_per_s']} images/s; "
              f"fast_engine.py one image: {result['fast_engine_one_image_s']}s (in-process stages: "
              f"{result['fast_engine_stages_s']})")
        if result["lone"]:
            one = result["fast_engine_one_image_s"]
            print(f"a lone request against fast_engine.py's image: {result['lone']['image_s'] / one:.3f}x in the "
                  f"server's stages, {result['lone_request_s'] / one:.3f}x at the client")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = load["answered_once"] and load["lost"] == 0 and load["ok"] == load["requests"] and load["distinct_jobs"]
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
