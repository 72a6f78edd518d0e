"""No step writes over, into or around its own input, and every name a step is given stays
inside the folder it belongs to.

`fp8 SRC SRC` used to replace a prepared bf16 folder with its FP8 copy, `dequantize SRC SRC`
the FP8 folder with its dequantized copy, `dequantize` into the prepared HF folder replaced
it with a lossy copy, and `prepare --model '../escape'` wrote outside --model-dir. Paths are
compared resolved (symlinks followed) and by folder identity; a folder holding another step's
finished output is never replaced. The commands are the real CLI (`python -m miles.ckpt`,
called in-process through its `main`; `invoke prepare-ckpt` as a subprocess).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.cli import main
from miles.ckpt.errors import CheckpointError
from miles.ckpt.manifest import MANIFEST_NAME, read_manifest
from miles.ckpt.stage import stage_dir

register_cpu_ci(est_time=3, suite="stage-b-cpu")

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen3-tiny-4layer"


@pytest.fixture(autouse=True)
def _private_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "digest-cache"))


def _one_line(capsys, code: int, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _prepare(
    source: Path | str, model_dir: Path, *steps: str, model: str = MODEL, layers: int = 4
) -> list[str]:
    argv = ["prepare", "--quiet", "--family", "qwen3", "--model", model, "--source", str(source),
            "--model-dir", str(model_dir), "--layers", str(layers), "--scan-nan", "0"]  # fmt: skip
    return argv + (["--plan-steps", ",".join(steps)] if steps else [])


@pytest.fixture
def models(tiny_copy, tmp_path, capsys) -> Path:
    """A model dir with the model's prepared HF folder (fetch) and its FP8 folder; the local
    source they come from is tmp_path / "copy-qwen3-4"."""
    out = tmp_path / "models"
    assert main(_prepare(tiny_copy("qwen3"), out, "fetch", "fp8")) == 0, capsys.readouterr().err
    return out


# --- the cases ----------------------------------------------------------------------


def test_fp8_onto_its_own_source_is_refused_and_the_source_is_kept(models, capsys, tree_digest):
    hf = models / MODEL
    before = tree_digest(hf)
    line = _one_line(capsys, 1, ["fp8", str(hf), str(hf)])
    assert f"output {hf} is the input {hf}" in line and "outside its input" in line, line
    assert tree_digest(hf) == before and read_manifest(hf).step == "fetch"


def test_dequantize_onto_its_own_source_is_refused_and_the_source_is_kept(models, capsys, tree_digest):
    fp8 = models / f"{MODEL}_fp8"
    before = tree_digest(fp8)
    line = _one_line(capsys, 1, ["dequantize", str(fp8), str(fp8)])
    assert f"output {fp8} is the input {fp8}" in line, line
    assert tree_digest(fp8) == before


def test_dequantize_into_the_prepared_hf_folder_is_refused(models, capsys, tree_digest):
    """The HF folder the FP8 copy was made from is not dequantize's input, but it is another
    step's finished output: a lossy copy never replaces it."""
    hf, fp8 = models / MODEL, models / f"{MODEL}_fp8"
    before = tree_digest(hf)
    line = _one_line(capsys, 1, ["dequantize", str(fp8), str(hf)])
    assert f"{hf} holds the finished output of another step ('fetch')" in line, line
    assert "does not replace" in line and "choose another output folder" in line, line
    assert tree_digest(hf) == before
    assert not [p for p in models.iterdir() if ".partial-" in p.name]


@pytest.mark.parametrize(
    ("name", "rule"),
    [
        ("../escape", "climbs outside the folder"),
        ("..", "climbs outside the folder"),
        (".", "empty or '.' part"),
        ("a/b", "holds a '/'"),
        (".hidden", "starts with '.'"),
        ("with\nnewline", "control character"),
        ("/abs/model", "absolute path"),
        ("", "non-empty"),
    ],
)
def test_a_model_name_that_is_not_one_plain_name_is_bad_input(tiny_copy, tmp_path, capsys, name, rule):
    models = tmp_path / "deep" / "models"
    line = _one_line(capsys, 2, _prepare(tiny_copy("qwen3"), models, "fetch", model=name))
    assert "model name" in line and rule in line, line
    assert not (tmp_path / "deep").exists() and not (tmp_path / "escape").exists()


def test_invoke_prepare_ckpt_with_an_escaping_model_name_is_one_line_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "invoke", "-r", str(ROOT), "prepare-ckpt", "--model", "../escape",
         "--family", "qwen3", "--source", "tiny:qwen3", "--model-dir", str(tmp_path / "models")],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: model name '../escape' climbs outside the folder with '..'; it must name a file inside it"
    ]
    assert not (tmp_path / "models").exists() and not (tmp_path / "escape").exists()


# --- the same rule, other ways in -----------------------------------------------------------


def test_an_output_inside_its_input_is_refused(models, capsys, tree_digest):
    hf = models / MODEL
    before = tree_digest(hf)
    line = _one_line(capsys, 1, ["fp8", str(hf), str(hf / "fp8")])
    assert f"output {hf / 'fp8'} lies inside the input {hf}" in line, line
    assert tree_digest(hf) == before


def test_an_output_that_contains_its_input_is_refused_before_any_work(models, capsys, tree_digest):
    hf = models / MODEL
    before = tree_digest(models)
    line = _one_line(capsys, 1, ["fp8", str(hf), str(models)])
    assert f"output {models} contains the input {hf}" in line, line
    assert tree_digest(models) == before


def test_an_output_that_is_a_symlink_to_the_input_is_refused(models, tmp_path, capsys, tree_digest):
    hf = models / MODEL
    link = tmp_path / "looks-new"
    link.symlink_to(hf)
    before = tree_digest(hf)
    line = _one_line(capsys, 1, ["fp8", str(hf), str(link)])
    assert f"output {link} is the input {hf}" in line and f"resolved: {hf}" in line, line
    assert tree_digest(hf) == before and link.is_symlink()


def test_an_output_under_a_symlinked_folder_leading_into_the_input_is_refused(models, tmp_path, capsys):
    hf = models / MODEL
    (tmp_path / "elsewhere").symlink_to(hf)
    out = tmp_path / "elsewhere" / "fp8"
    line = _one_line(capsys, 1, ["fp8", str(hf), str(out)])
    assert f"output {out} lies inside the input {hf}" in line, line
    assert not (hf / "fp8").exists()


def test_an_input_named_through_a_symlink_is_still_its_own_folder(models, tmp_path, capsys, tree_digest):
    fp8 = models / f"{MODEL}_fp8"
    link = tmp_path / "alias"
    link.symlink_to(fp8)
    before = tree_digest(fp8)
    line = _one_line(capsys, 1, ["dequantize", str(link), str(fp8)])
    assert f"output {fp8} is the input {link}" in line, line
    assert tree_digest(fp8) == before


def test_dequantize_into_another_models_hf_folder_is_refused(models, tmp_path, capsys, tree_digest):
    other = tmp_path / "other-models"
    assert main(_prepare(tmp_path / "copy-qwen3-4", other, "fetch", model="other")) == 0
    before = tree_digest(other / "other")
    line = _one_line(capsys, 1, ["dequantize", str(models / f"{MODEL}_fp8"), str(other / "other")])
    assert "holds the finished output of another step ('fetch')" in line, line
    assert tree_digest(other / "other") == before


def test_a_rerun_onto_the_steps_own_earlier_output_is_allowed(models, tmp_path, capsys):
    hf, out = models / MODEL, tmp_path / "fp8-copy"
    assert main(["fp8", str(hf), str(out)]) == 0, capsys.readouterr().err
    assert main(["fp8", str(hf), str(out)]) == 0, capsys.readouterr().err
    assert read_manifest(out).step == "fp8"


def test_a_rerun_over_hard_links_to_the_input_never_writes_into_the_input(
    models, tmp_path, capsys, tree_digest
):
    """An output whose files were hard-linked to the input's is replaced file by file, by new
    files renamed into place: the input's bytes are never written through the shared inodes."""
    hf, out = models / MODEL, tmp_path / "fp8-copy"
    assert main(["fp8", str(hf), str(out)]) == 0
    for shard in sorted(out.glob("*.safetensors")):
        shard.unlink()
        os.link(hf / shard.name, shard)
    before, links = tree_digest(hf), {s.name: os.stat(s).st_nlink for s in hf.glob("*.safetensors")}
    assert main(["fp8", str(hf), str(out)]) == 0, capsys.readouterr().err
    assert tree_digest(hf) == before
    assert {s.name: os.stat(s).st_nlink for s in hf.glob("*.safetensors")} == {
        k: n - 1 for k, n in links.items()
    }


def test_make_tiny_into_a_folder_holding_another_steps_output_is_refused(models, capsys, tree_digest):
    fp8 = models / f"{MODEL}_fp8"
    before = tree_digest(fp8)
    line = _one_line(capsys, 1, ["make-tiny", "--family", "qwen3", "--layers", "2", "--out", str(fp8)])
    assert "holds the finished output of another step ('fp8')" in line, line
    assert tree_digest(fp8) == before


def test_a_stage_dir_that_is_the_model_dir_is_refused_before_copying(models, tmp_path, capsys, tree_digest):
    source = tmp_path / "copy-qwen3-4"
    before = tree_digest(models)
    argv = _prepare(source, models, "fetch", "fp8", "stage") + ["--stage-dir", str(models)]
    line = _one_line(capsys, 1, argv)
    assert line.startswith(
        f"error: stage of {MODEL}: its output {models / MODEL} is the input {models / MODEL}"
    )
    assert tree_digest(models) == before


def test_a_stage_dir_inside_the_hf_folder_is_refused(models, tmp_path, capsys, tree_digest):
    stage = models / MODEL / "staged"
    before = tree_digest(models / MODEL)
    argv = _prepare(tmp_path / "copy-qwen3-4", models, "fetch", "stage") + ["--stage-dir", str(stage)]
    line = _one_line(capsys, 1, argv)
    assert f"its output {stage / MODEL} lies inside the input {models / MODEL}" in line, line
    assert tree_digest(models / MODEL) == before


def test_a_model_dir_inside_the_local_source_is_refused(tiny_copy, capsys, tree_digest):
    source = tiny_copy("qwen3")
    before = tree_digest(source)
    line = _one_line(capsys, 1, _prepare(source, source / "models", "fetch"))
    assert line.startswith(
        f"error: fetch of {MODEL}: its output {source / 'models' / MODEL} lies inside the input"
    )
    assert tree_digest(source) == before


def test_trim_of_a_source_that_is_the_hf_folder_itself_is_refused(tiny, tmp_path, capsys, tree_digest):
    """A 4-layer checkpoint placed as the 2-layer model's own folder: trim would read and replace it."""
    models = tmp_path / "models"
    name = "qwen3-tiny-2layer"
    shutil.copytree(tiny("qwen3"), models / name)
    (models / name / MANIFEST_NAME).unlink()  # a folder the user put there
    before = tree_digest(models / name)
    line = _one_line(capsys, 1, _prepare(models / name, models, "fetch", "trim", model=name, layers=2))
    assert line.startswith(
        f"error: trim of {name}: its output {models / name} is the input {models / name}"
    ), line
    assert tree_digest(models / name) == before


def test_stage_dir_refuses_to_copy_a_folder_onto_itself(models, tree_digest):
    hf = models / MODEL
    before = tree_digest(hf)
    with pytest.raises(CheckpointError, match=f"stage copy {hf} is the input {hf}"):
        stage_dir(hf, hf)
    assert tree_digest(hf) == before


@pytest.mark.parametrize("step", ["fp8", "torch_dist"])
def test_a_steps_output_folder_planted_as_a_link_to_the_hf_folder_is_refused(
    models, tmp_path, capsys, tree_digest, step
):
    """`<model>_fp8` (or `_torch_dist`) made a symlink to `<model>`: the step would read and replace one folder."""
    hf, out = models / MODEL, models / f"{MODEL}_{step}"
    if out.exists():
        shutil.rmtree(out)
    out.symlink_to(hf)
    before = tree_digest(hf)
    line = _one_line(capsys, 1, _prepare(tmp_path / "copy-qwen3-4", models, "fetch", step))
    assert line.startswith(f"error: {step} of {MODEL}: its output {out} is the input {hf}"), line
    assert tree_digest(hf) == before and out.is_symlink()
