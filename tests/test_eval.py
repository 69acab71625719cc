"""fast_eval.py end to end on a tiny random model (CPU): shards, kill -9 and resume, torchrun ranks,
the JSONL manifest, and the one-line errors. Every run writes 64x64 images of a 7-sample split."""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "scripts"))
import make_synthetic_set  # noqa: E402
from fast_inference import conditions, fast_eval
from fast_inference.hed import HED
from fast_inference.images import save_image

SCRIPT = os.path.join(ROOT, "fast_inference", "fast_eval.py")
N = 7
TINY = dict(n_layer=3, n_head=2, dim=32, caption_dim=32)


def write_split(root, n=N, size=64):
    """The official extracted layout (image/, control/, control_depth/, label/, caption_emb/, code/)."""
    make_synthetic_set.write_split(root, n, size, TINY["caption_dim"])


pytestmark = pytest.mark.usefixtures("one_thread")  # the in-process runs then match the subprocess ones


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    write_split(str(root / "val"))
    (root / "tiny.json").write_text(json.dumps(TINY))
    return root


def common(split, *extra):
    return ["--gpt-model", str(split / "tiny.json"), "--image-size", "64", "--device", "cpu", "--precision", "fp32",
            "--engine", "fast", "--backend", "eager", "--top-k", "10", "--batch", "2", "--num-workers", "1",
            "--condition-type", "canny", "--data-path", str(split / "val"), *map(str, extra)]


def env():
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    e["OMP_NUM_THREADS"] = "1"
    return e


def cli(*args, runner=(sys.executable, SCRIPT)):
    r = subprocess.run([*runner, *args], capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def names(folder):
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def finished(sample_dir):
    return [n for n in names(sample_dir / "visualization") if os.path.isfile(sample_dir / "annotations" / n)]


def assert_same_outputs(a, b, expected):
    """Exactly the expected files in both, each a readable PNG, byte for byte equal."""
    for sub in ("visualization", "annotations"):
        assert names(a / sub) == names(b / sub) == expected, sub
        for n in expected:
            with Image.open(b / sub / n) as im:
                im.load()
            assert (a / sub / n).read_bytes() == (b / sub / n).read_bytes(), f"{sub}/{n} differs"


def pngs(ids):
    return [f"{i:06d}.png" for i in ids]


@pytest.fixture(scope="module")
def uninterrupted(split):
    out = split / "full"
    cli(*common(split, "--sample-dir", out))
    return out


def test_outputs_follow_the_official_layout(split, uninterrupted):
    assert names(uninterrupted / "visualization") == pngs(range(N))
    with Image.open(uninterrupted / "visualization" / "000000.png") as im:
        assert (im.mode, im.size) == ("RGB", (64, 64))
    # The annotation is channel 0 of the canny control, saved as grey RGB: canny of image/0.png.
    rgb = np.array(Image.open(split / "val" / "image" / "0.png").convert("RGB"))
    ann = np.array(Image.open(uninterrupted / "annotations" / "000000.png"))
    assert ann.shape == (64, 64, 3) and np.array_equal(ann[..., 0], conditions.canny(rgb))
    logs = [json.loads(line) for line in open(uninterrupted / "logs" / "rank0_0-7.jsonl")]
    assert [e["event"] for e in logs] == ["start", "batch", "batch", "batch", "batch", "done"]
    assert logs[0]["settings"]["batch"] == 2 and logs[1]["names"] == ["000000", "000001"]


def test_shards_kill_and_resume_equal_an_uninterrupted_run(split, uninterrupted):
    out = split / "sharded"
    # Shard edges off the batch grid (batch 2): [0, 3) then [3, 7), the second killed and resumed.
    cli(*common(split, "--sample-dir", out, "--start", 0, "--end", 3))
    assert finished(out) == pngs(range(3))
    proc = subprocess.Popen([sys.executable, SCRIPT, *common(split, "--sample-dir", out, "--start", 3, "--end", 7)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env(), cwd=ROOT)
    deadline = time.time() + 120
    while "000003.png" not in names(out / "visualization") and proc.poll() is None and time.time() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert len(finished(out)) < N, "killed too late: nothing left to resume"
    r = cli(*common(split, "--sample-dir", out, "--start", 3, "--end", 7))
    assert "done before" in r.stdout
    assert_same_outputs(uninterrupted, out, pngs(range(N)))
    # Running it again makes nothing and rewrites nothing.
    stamp = os.stat(out / "visualization" / "000004.png").st_mtime_ns
    assert "are done" in cli(*common(split, "--sample-dir", out)).stdout
    assert os.stat(out / "visualization" / "000004.png").st_mtime_ns == stamp


def test_torchrun_ranks_share_the_range_and_rank0_scores_it(split, uninterrupted):
    out = split / "torchrun"
    runner = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT)
    r = cli(*common(split, "--sample-dir", out, "--metrics"), runner=runner)
    assert "rank 1/2" in r.stdout and "rank 0/2" in r.stdout
    logs = {rank: [json.loads(line) for line in open(out / "logs" / f"rank{rank}_0-7.jsonl")] for rank in (0, 1)}
    firsts = {rank: [e["first"] for e in log if e["event"] == "batch"] for rank, log in logs.items()}
    assert firsts == {0: [0, 4], 1: [2, 6]}  # every other batch
    assert_same_outputs(uninterrupted, out, pngs(range(N)))
    assert "f1" in json.load(open(out / "metrics.json"))


def test_manifest_matches_the_official_layout(split, tmp_path):
    """The same samples through a JSONL manifest (seg: control used as is, label as annotation)."""
    val = split / "val"
    lines = [dict(id=i, control=f"val/control/{i}.png", caption_emb=f"val/caption_emb/{i}.npz",
                  label=f"val/label/{i}.png") for i in range(3)]
    lines.append(dict(id="extra-sample", control="val/control/3.png", caption_emb="val/caption_emb/3.npz"))
    manifest = split / "val.jsonl"
    manifest.write_text("".join(json.dumps(x) + "\n" for x in lines))
    base = [a for a in common(split) if a not in ("--data-path", str(val))]
    seg = ["--condition-type", "seg", "--num-workers", "0"]
    fast_eval.main([*base, *seg, "--manifest", str(manifest), "--sample-dir", str(tmp_path / "m")])
    fast_eval.main([*base, *seg, "--data-path", str(val), "--end", "3", "--sample-dir", str(tmp_path / "d")])
    assert names(tmp_path / "m" / "visualization") == pngs(range(3)) + ["extra-sample.png"]
    for n in pngs(range(3)):
        assert (tmp_path / "m" / "visualization" / n).read_bytes() == (tmp_path / "d" / "visualization" / n).read_bytes()
    with Image.open(tmp_path / "m" / "annotations" / "000001.png") as im:
        assert im.mode == "L" and np.array_equal(np.array(im), np.array(Image.open(val / "label" / "1.png")))
    with Image.open(tmp_path / "m" / "annotations" / "extra-sample.png") as im:  # no label: control channel 0
        assert im.mode == "RGB"


def test_hed_controls_are_extracted_from_the_images(split, tmp_path):
    """test_t2i.py semantics: the HED network runs on image/{i}.png; the annotation is its channel 0."""
    torch.manual_seed(0)
    torch.save(HED().state_dict(), tmp_path / "hed.pth")
    out = tmp_path / "hed"
    args = [a if a != "canny" else "hed" for a in common(split, "--num-workers", 0, "--end", 2)]
    fast_eval.main([*args, "--condition-ckpt", str(tmp_path / "hed.pth"), "--sample-dir", str(out)])
    rgb = np.array(Image.open(split / "val" / "image" / "1.png").convert("RGB"))
    control = conditions.extract_control(rgb, "hed", ckpt=str(tmp_path / "hed.pth"))
    save_image(control[0], str(tmp_path / "want.png"))
    assert (out / "annotations" / "000001.png").read_bytes() == (tmp_path / "want.png").read_bytes()


def run_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        fast_eval.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the progress bar, if one started
    assert e.value.code == 2 and err.startswith("error: "), err
    return err


def test_user_errors_are_one_line_and_write_nothing(split, tmp_path, capsys):
    val = str(split / "val")
    args = [a for a in common(split, "--num-workers", 0) if a not in ("--data-path", val)]
    assert "is not a folder" in run_error(capsys, [*args, "--data-path", str(tmp_path / "nope")])
    assert "--data-path DIR" in run_error(capsys, args)
    bad = tmp_path / "bad"
    write_split(str(bad), n=3)
    (bad / "caption_emb" / "0.npz").write_bytes(b"not a zip")
    out = tmp_path / "out"
    assert "0.npz" in run_error(capsys, [*args, "--data-path", str(bad), "--sample-dir", str(out)])
    assert finished(out) == []
    write_split(str(bad), n=3)
    Image.fromarray(np.zeros((32, 48, 3), np.uint8)).save(bad / "image" / "0.png")
    assert "48x32, expected 64x64" in run_error(capsys, [*args, "--data-path", str(bad), "--sample-dir", str(out)])
    assert finished(out) == []
    os.remove(bad / "image" / "1.png")
    assert "image/1.png is missing" in run_error(capsys, [*args, "--data-path", str(bad)])
    hed = [a if a != "canny" else "hed" for a in args]
    assert "--condition-ckpt" in run_error(capsys, [*hed, "--data-path", val, "--sample-dir", str(out)])


def test_settings_change_is_refused(split, uninterrupted, capsys):
    err = run_error(capsys, common(split, "--sample-dir", uninterrupted, "--seed", 5, "--num-workers", 0))
    assert "seed: 0 -> 5" in err and "another --sample-dir" in err
    err = run_error(capsys, common(split, "--sample-dir", uninterrupted, "--quantize", "int8", "--num-workers", 0))
    assert "quantize: None -> 'int8'" in err  # settings.json without the key: made unquantized


def test_shard_covers_every_index_once():
    for start, end, batch, world in [(0, 7, 2, 1), (3, 7, 2, 2), (1, 100, 8, 3), (5, 6, 4, 4)]:
        got = [p for r in range(world) for _, ps in fast_eval.shard(start, end, batch, r, world) for p in ps]
        assert sorted(got) == list(range(start, end))
        firsts = [f for r in range(world) for f, _ in fast_eval.shard(start, end, batch, r, world)]
        assert all(f % batch == 0 for f in firsts)


def test_evaluation_demo(tmp_path, monkeypatch):
    """No model flags and no data: the trained demo model on the first scenes of the demo set's test split (written
    once under sample/demo_set/), canny controls extracted from the images, the canny F1 scored."""
    monkeypatch.setattr(fast_eval, "DEMO_SPLIT", 2)
    monkeypatch.setattr(fast_eval, "ROOT", str(tmp_path))
    out = tmp_path / "s"
    fast_eval.main(["--device", "cpu", "--condition-type", "canny", "--batch", "2", "--num-workers", "0",
                    "--metrics", "--sample-dir", str(out)])
    assert names(out / "visualization") == pngs(range(2))
    result = json.load(open(out / "metrics.json"))
    assert result["num_images"] == 2 and 0 <= result["f1"] <= 1
    split = [p for p in (tmp_path / "sample" / "demo_set").iterdir()]
    assert len(split) == 1 and sorted(os.listdir(split[0] / "caption_emb")) == ["0.npz", "1.npz"]


# ---- issue 68: folders that cannot mix or block, numbers and manifests checked -------------------------

def quick(split, out, *extra):
    """One batch of two samples, in this process."""
    return [*common(split, "--num-workers", 0, "--end", 2, "--sample-dir", out), *map(str, extra)]


def test_a_failed_run_never_blocks_the_corrected_rerun(split, tmp_path, capsys):
    (tmp_path / "broken.pt").write_bytes(b"not a checkpoint")
    out = tmp_path / "out"
    assert "broken.pt is not a readable torch checkpoint" in run_error(
        capsys, quick(split, out, "--gpt-ckpt", tmp_path / "broken.pt"))
    assert not (out / "settings.json").exists() and finished(out) == []
    fast_eval.main(quick(split, out))  # the corrected command: random weights
    assert finished(out) == pngs(range(2))
    assert json.load(open(out / "settings.json"))["gpt_ckpt"] is None


def test_folder_identity_is_the_content_of_configs_and_weights(split, tmp_path, capsys):
    config, out = tmp_path / "model.json", tmp_path / "out"
    config.write_text(json.dumps(TINY))
    fast_eval.main(quick(split, out, "--gpt-model", config))
    moved = tmp_path / "elsewhere" / "same.json"  # the same config copied elsewhere resumes the folder
    moved.parent.mkdir()
    moved.write_text(config.read_text())
    fast_eval.main(quick(split, out, "--gpt-model", moved))
    assert "are done" in capsys.readouterr().out
    config.write_text(json.dumps(dict(TINY, n_layer=2)))  # another model behind the same path
    err = run_error(capsys, quick(split, out, "--gpt-model", config))
    assert "content.model.n_layer: 3 -> 2" in err and "another --sample-dir" in err
    settings = json.load(open(out / "settings.json"))
    assert settings["content"]["model"]["n_layer"] == 3 and "gpt_ckpt" in settings["content"]


def test_content_hash_follows_content_not_path_or_mtime(tmp_path):
    data_ = np.random.default_rng(0).bytes(3 << 20)
    (tmp_path / "a.pt").write_bytes(data_)
    (tmp_path / "copy.pt").write_bytes(data_)
    os.utime(tmp_path / "copy.pt", (1, 1))
    cache = {}
    want = hashlib.sha256(data_).hexdigest()
    assert fast_eval.content_hash(str(tmp_path / "a.pt"), cache) == want
    assert fast_eval.content_hash(str(tmp_path / "copy.pt"), cache) == want
    # A change in place, one byte, with the size and mtime put back: the stat still differs (ctime).
    stat = os.stat(tmp_path / "a.pt")
    with open(tmp_path / "a.pt", "r+b") as f:
        f.seek(len(data_) // 3)
        f.write(b"\0" if data_[len(data_) // 3] else b"\1")
    os.utime(tmp_path / "a.pt", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert fast_eval.content_hash(str(tmp_path / "a.pt"), cache) != want
    # The cache is used while the stat is unchanged: nothing read again.
    cache[os.path.realpath(tmp_path / "copy.pt")][1] = "cached"
    assert fast_eval.content_hash(str(tmp_path / "copy.pt"), cache) == "cached"
    folder = tmp_path / "t5"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    first = fast_eval.content_hash(str(folder), cache)
    (folder / ".cache").mkdir()
    (folder / ".cache" / "x").write_text("lock files and the like")
    assert fast_eval.content_hash(str(folder), cache) == first
    (folder / "config.json").write_text('{"d_model": 32}')
    assert fast_eval.content_hash(str(folder), cache) != first


HOLDER = """
import sys
sys.path.insert(0, sys.argv[1])
from fast_inference.fast_eval import lock_sample_dir, write_record
write_record(lock_sample_dir(sys.argv[2], "job-A"), "job-A", checked=True)
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(split, tmp_path, capsys):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, ROOT, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        err = run_error(capsys, quick(split, out))
        assert f"is being written by another fast_eval.py run (host {socket.gethostname()}, pid {holder.pid}" in err
        assert sorted(os.listdir(out)) == [".lock"]  # nothing else written
        with pytest.raises(fast_eval.UserError, match="another fast_eval.py run"):  # a rank of another job
            fast_eval.wait_for_lock(str(out), "job-B", grace=0.3)
        fast_eval.wait_for_lock(str(out), "job-A")  # a rank of the holder's job goes on at once
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    os.close(fast_eval.lock_sample_dir(str(out), "job-C"))  # its lock ended with its process


def test_job_ids_tell_torchrun_jobs_apart(monkeypatch):
    for k, v in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="none").items():
        monkeypatch.setenv(k, v)
    one = fast_eval.job_id(2)
    assert one == f"{socket.gethostname()}:29500:none" and fast_eval.job_id(1) != one
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert fast_eval.job_id(2) != one


def test_numbers_and_values_are_one_line(split, tmp_path, capsys):
    out = tmp_path / "out"
    for extra, needle in ((["--cfg-scale", "nan"], "--cfg-scale nan is out of range"),
                          (["--temperature", "-1"], "--temperature -1.0 is out of range; use a number >= 0"),
                          (["--batch", "0"], "--batch 0 is out of range; use a whole number >= 1"),
                          (["--num-workers", "-1"], "--num-workers -1 is out of range"),
                          (["--start", "-1"], "--start -1 is out of range"),
                          (["--image-H", "0"], "--image-H 0 is out of range"),
                          (["--batch", "x"], "argument --batch: invalid int value: 'x'"),
                          (["--gpt-ckpt", str(tmp_path / "nope.pt")], "--gpt-ckpt"),
                          (["--sample-dir", str(split / "tiny.json")], "is a file; give a folder")):
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            fast_eval.main(quick(split, out, *extra))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and needle in err, err
    assert not out.exists()


def test_batches_beyond_the_free_memory_are_refused(split, tmp_path, capsys, monkeypatch):
    from fast_inference import memory

    monkeypatch.setattr(memory, "available", lambda device: (2**20, f"{device} has 0.0 GiB free"))
    err = run_error(capsys, quick(split, tmp_path / "out"))
    assert "2 image(s) of 64x64" in err and "use a smaller --batch" in err
    assert not (tmp_path / "out").exists()


def test_manifest_paths_stay_in_its_folder(split, tmp_path, capsys):
    from fast_inference import data

    (tmp_path / "m").mkdir()
    os.symlink(split / "val" / "control", tmp_path / "m" / "out_link")
    for control in ("../outside.png", str(split / "val" / "control" / "0.png"), "out_link/0.png"):
        (tmp_path / "m" / "val.jsonl").write_text(json.dumps(dict(id=0, control=control, caption_emb="e.npz")) + "\n")
        with pytest.raises(data.DataError) as e:
            data.manifest_samples(str(tmp_path / "m" / "val.jsonl"), "seg")
        assert f"val.jsonl:1: \"control\" {control!r} leaves the manifest's folder" in str(e.value)
        assert "--allow-outside-paths" in str(e.value)
        assert data.manifest_samples(str(tmp_path / "m" / "val.jsonl"), "seg", anywhere=True)[0].source.endswith(
            control.split("/")[-1])
    base = [a for a in common(split, "--num-workers", 0) if a not in ("--data-path", str(split / "val"))]
    err = run_error(capsys, [*base, "--manifest", str(tmp_path / "m" / "val.jsonl"), "--sample-dir", str(tmp_path / "o")])
    assert "leaves the manifest's folder" in err and "--allow-outside-paths" in err


def test_manifest_errors_name_the_manifest_not_another_tools_flag(split, tmp_path):
    from fast_inference import data

    (tmp_path / "val.jsonl").write_text(json.dumps(dict(id=0, control="missing.png", caption_emb="e.npz")) + "\n")
    (sample,) = data.manifest_samples(str(tmp_path / "val.jsonl"), "seg")
    err = data.read_sample(sample, "seg", 64, 64, 120, "emb")["error"]
    assert "missing.png not found; fix line 1 of --manifest" in err and "--condition-path" not in err
    sample.class_label = 10
    with pytest.raises(data.DataError, match="class_label 10 is not in 0..9"):
        data.check_text([sample], "label", num_classes=10)


# ---- issue 70: speculative Jacobi decoding ------------------------------------------------------

def test_speculative_with_the_drafts_left_to_the_plan(split, tmp_path, capsys, monkeypatch):
    """--speculative jacobi alone: the engine's drafts are pinned at --batch before the first batch (every batch of
    the run runs them: Engine.pin_drafts), the chain of 16 on the CPU; the folder records the flags as given."""
    from fast_inference.engine import Engine

    pinned = []
    pin = Engine.pin_drafts
    monkeypatch.setattr(Engine, "pin_drafts", lambda self, *a: pinned.append((a, pin(self, *a))) or pinned[-1][1])
    fast_eval.main(common(split, "--num-workers", 0, "--sample-dir", tmp_path / "out", "--end", 3, "--speculative",
                          "jacobi"))
    assert "passes per image" in capsys.readouterr().out
    (args, drafts), = pinned
    assert args[0] == 2 and (drafts.window, drafts.coupling, drafts.tree, drafts.auto) == (16, "gumbel", (), False)
    settings = json.load(open(tmp_path / "out" / "settings.json"))
    assert (settings["speculative"], settings["draft_window"], settings["draft_coupling"]) == ("jacobi", None, None)


def test_speculative_shards_equal_one_run_and_keep_their_folder(split, tmp_path, capsys):
    """--speculative jacobi: a row's tokens depend on its batch's seed only, so a shard resumed elsewhere makes the
    same files; the folder records the sampler (its random stream is another one) and refuses the plain one."""
    spec = ("--speculative", "jacobi", "--draft-window", 3, "--draft-init", "left")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    fast_eval.main([*common(split, "--num-workers", 0, "--sample-dir", whole), *map(str, spec)])
    assert "passes per image" in capsys.readouterr().out
    for start, end in ((0, 3), (3, 7)):
        fast_eval.main([*common(split, "--num-workers", 0, "--sample-dir", parts, "--start", start, "--end", end),
                        *map(str, spec)])
    assert_same_outputs(whole, parts, pngs(range(N)))
    settings = json.load(open(whole / "settings.json"))
    assert (settings["speculative"], settings["draft_window"], settings["draft_init"]) == ("jacobi", 3, "left")
    err = run_error(capsys, common(split, "--sample-dir", whole, "--num-workers", 0))
    assert "speculative: 'jacobi' -> None" in err and "another --sample-dir" in err
    for extra, needle in ((["--cfg-interval", "3"], "use --cfg-interval -1"),
                          (["--engine", "reference"], "drop --engine reference"),
                          (["--draft-window", "1"], "--draft-window 1 is out of range"),
                          (["--draft-window", "5", "--draft-init", "above"], "at least 80 pixels wide")):
        err = run_error(capsys, [*common(split, "--sample-dir", tmp_path / "new", "--num-workers", 0),
                                 "--speculative", "jacobi", *extra])
        assert needle in err, err
    assert not (tmp_path / "new").exists()
