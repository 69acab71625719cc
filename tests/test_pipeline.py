"""The library's entry point (fast_inference.Pipeline) on the demo model, CPU: the command line's images for a seed,
the README's Python block as written, the control's forms, errors as one line; and the layering: no module imports
a command-line module."""
import ast
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT
from fast_inference import Pipeline, PipelineConfig, UserError, fast_engine
from fast_inference.text import TextError
from test_plan import imported_modules

CLI_MODULES = {"fast_engine", "fast_eval", "bench", "serve"}  # fast_inference's command lines (each has a __main__)


@pytest.fixture(scope="module")
def pipe():
    return Pipeline(device="cpu")


def test_pipeline_draws_the_command_lines_images(pipe, tmp_path, capsys):
    """The same seed and flags: fast_engine.py's samples (its --save-samples PNGs) and tokens are the Pipeline's."""
    argv = ["--device", "cpu", "--seed", "1", "--num-images", "2", "--cfg-scale", "3", "--top-k", "50",
            "--condition-type", "seg", "--prompt", "a white circle and a red diamond on a blue background",
            "--out", str(tmp_path / "grid.png"), "--save-samples", str(tmp_path / "s"),
            "--save-tokens", str(tmp_path / "t.npy")]
    fast_engine.main(argv)
    images, tokens = Pipeline(device="cpu", condition_type="seg")(
        prompt="a white circle and a red diamond on a blue background", num_images=2, seed=1, cfg_scale=3.0,
        top_k=50, return_tokens=True)
    assert np.array_equal(tokens.numpy(), np.load(tmp_path / "t.npy"))
    assert len(images) == 2
    for i, image in enumerate(images):
        assert np.array_equal(np.array(image), np.array(Image.open(tmp_path / "s" / f"{i}.png").convert("RGB")))
    # the demo's default run too: no prompt (the demo scene's caption), no control (the demo scene's map)
    fast_engine.main(["--device", "cpu", "--out", str(tmp_path / "g.png"), "--save-samples", str(tmp_path / "d")])
    assert np.array_equal(np.array(pipe()[0]), np.array(Image.open(tmp_path / "d" / "0.png").convert("RGB")))


def readme_python_block():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), re.S)
    assert len(blocks) == 1, "the README has one Python example"
    return blocks[0]


def test_readme_python_block_runs_as_written(tmp_path):
    """The README's example, five lines on the demo model, run from the repository root as a user would."""
    code = readme_python_block()
    assert len(code.strip().splitlines()) == 5 and "from fast_inference import Pipeline" in code
    env = dict(os.environ, PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code.replace("sample/", str(tmp_path) + "/")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    sizes = {Image.open(tmp_path / p).size for p in os.listdir(tmp_path)}
    assert len(os.listdir(tmp_path)) == 2 and len(sizes) == 1 and sizes.pop()[0] % 16 == 0


def test_the_control_as_a_path_an_image_or_an_array(pipe):
    """One picture given as a path, a PIL image or an array makes one control map; is_map takes it as it is."""
    path = os.path.join(ROOT, "condition", "example", "hed.png")
    if not os.path.isfile(path):
        pytest.skip("condition/example/ is written by the demo's first run")
    by_path = pipe.prepare_control(path, is_map=True, height=128, width=128)
    image = Image.open(path)
    assert torch.equal(by_path, pipe.prepare_control(image, is_map=True, height=128, width=128))
    assert torch.equal(by_path, pipe.prepare_control(np.array(image.convert("RGB")), is_map=True, height=128,
                                                     width=128))
    assert by_path.shape == (3, 128, 128) and by_path.min() >= -1 and by_path.max() <= 1
    images = pipe(np.array(image.convert("RGB"))[:128, :128], is_map=True, num_images=1, seed=3)
    assert images[0].size == (128, 128)


def test_pipeline_errors_are_one_line_naming_the_setting(pipe):
    cases = [(dict(top_k=-1), "top_k -1 is out of range; use a whole number >= 0"),
             (dict(cfg_scale=float("nan")), "cfg_scale nan is out of range"),
             (dict(num_images=0), "num_images 0 is out of range"),
             (dict(control=3), "control must be a path, a PIL image or a uint8 (H, W, 3) array"),
             (dict(height=50), "height 50 is not a positive multiple of 16; use e.g. 64"),
             (dict(height=1024, width=1024), f"needs 4096 tokens but the model's grid has {pipe.margs.block_size}"),
             (dict(speculative="jacobi", cfg_interval=3), "speculative jacobi guides every token; use cfg_interval -1"),
             (dict(speculative="jacobi", draft_tree="4x3", draft_coupling="gumbel"), "draft_tree is exact with draft_coupling pathwise only"),
             (dict(prompt="a red circle", caption_emb=torch.zeros(1, 4, 8)), "give one text source")]
    for kwargs, message in cases:
        with pytest.raises(UserError) as e:
            pipe(**kwargs)
        assert message in str(e.value) and "\n" not in str(e.value), (kwargs, str(e.value))
    with pytest.raises(TextError, match="the demo model knows no 'dog'"):
        pipe(prompt="a red dog")
    with pytest.raises(UserError, match=r"unknown Pipeline setting\(s\) \['gpt_path'\]; the settings are gpt_model"):
        Pipeline(gpt_path="x.safetensors")
    with pytest.raises(UserError, match="gpt_ckpt nowhere.safetensors not found"):
        Pipeline(gpt_model="GPT-B", gpt_ckpt="nowhere.safetensors")


def test_pipeline_from_a_json_config(tmp_path):
    """A JSON of the settings builds the Pipeline they name (here a tiny random model); unknown keys are refused."""
    (tmp_path / "gpt.json").write_text(json.dumps(dict(n_layer=1, n_head=2, dim=32, caption_dim=32, block_size=4)))
    (tmp_path / "vq.json").write_text(json.dumps(dict(codebook_size=64, codebook_embed_dim=4, ch=16,
                                                      ch_mult=[1, 1, 1, 1, 1], z_channels=16,
                                                      num_res_blocks=1, norm_groups=4)))
    config = dict(gpt_model=str(tmp_path / "gpt.json"), vq_model=str(tmp_path / "vq.json"), codebook_size=64,
                  condition_type="canny", device="cpu", cls_token_num=8)
    (tmp_path / "pipe.json").write_text(json.dumps(config))
    pipe = Pipeline.from_json(str(tmp_path / "pipe.json"))
    assert pipe.margs.dim == 32 and pipe.config == PipelineConfig(**config)
    caption = torch.randn(1, 8, 32)
    images, tokens = pipe(np.zeros((32, 32, 3), np.uint8), caption_emb=caption, num_images=2, return_tokens=True)
    assert tokens.shape == (2, 4) and tokens.max() < 64 and images[0].size == (32, 32)
    again = pipe(np.zeros((32, 32, 3), np.uint8), caption_emb=caption, num_images=2, return_tokens=True)[1]
    assert torch.equal(tokens, again)  # the same seed, the same tokens
    (tmp_path / "typo.json").write_text(json.dumps(dict(config, gpt_ckpts="x")))
    with pytest.raises(UserError, match=r"unknown setting\(s\) \['gpt_ckpts'\]"):
        PipelineConfig.from_json(str(tmp_path / "typo.json"))


def python_files(*folders):
    for folder in folders:
        for where, _, names in os.walk(os.path.join(ROOT, folder)):
            yield from (os.path.join(where, n) for n in names if n.endswith(".py"))


def test_no_module_imports_a_command_line_module():
    """The command lines sit on top: the library, the other command lines, scripts/ and tools/ import none of them
    (their shared flags live in flags.py, the benchmark's workload in workload.py)."""
    offenders = []
    for path in python_files("fast_inference", "scripts", "tools"):
        cli = {f"fast_inference.{m}" for m in CLI_MODULES}
        for module in imported_modules(path) & cli:
            offenders.append(f"{os.path.relpath(path, ROOT)} imports {module}")
    assert not offenders, offenders


def test_importing_the_pipeline_loads_no_command_line_module():
    code = ("import sys; from fast_inference import Pipeline; import fast_inference.pipeline; "
            f"print(sorted(m for m in sys.modules if m.split('.')[-1] in {sorted(CLI_MODULES)}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_command_line_is_thin_and_the_readme_a_guide():
    """fast_engine.py parses, checks and saves (a few hundred lines); the README stays a user's guide (<= 250)."""
    with open(os.path.join(ROOT, "fast_inference", "fast_engine.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    assert tree.body[-1].end_lineno <= 400
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert len(readme.splitlines()) <= 250
    for page in ("docs/serving.md", "docs/speculative.md", "docs/evaluation.md", "docs/decode_plan.md",
                 "docs/PERF_NOTES.md"):
        assert os.path.isfile(os.path.join(ROOT, page)) and readme.count(f"]({page})") == 1, page
