"""prepare(): every step once, a rerun does nothing, a killed run resumes to the same bytes.

Kills are real SIGKILLs of a forked child that runs the pipeline (forked so it starts with
the test's imports already loaded); a file-size limit is a real write refused by the kernel
(RLIMIT_FSIZE with SIGXFSZ ignored). Full and read-only disks: test_ckpt_disk_failures.py.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.errors import CheckpointError, StepFailed
from miles.ckpt.manifest import read_manifest
from miles.ckpt.pipeline import prepare
from miles.ckpt.plan import FAMILIES, STEPS, CheckpointPlan
from miles.ckpt.shards import read_weight_map

register_cpu_ci(est_time=20, suite="stage-b-cpu")

OUTPUT_STEPS = ("fetch", "validate", "fp8", "torch_dist", "stage")


def _plan(
    root: Path, family: str = "qwen3_moe", *, source: str | None = None, layers: int = 4, steps=OUTPUT_STEPS
):
    return CheckpointPlan(
        family=family,
        model_name=f"{family}-tiny-{layers}layer",
        source=source or f"tiny:{family}",
        model_dir=str(root / "models"),
        num_layers=layers,
        steps=tuple(s for s in STEPS if s in steps),
        stage_dir=str(root / "local") if "stage" in steps else None,
    )


def _outputs(plan: CheckpointPlan) -> list[Path]:
    dirs = [Path(plan.hf_dir), Path(plan.fp8_dir), Path(plan.torch_dist_dir)]
    if plan.stage_dir:
        dirs += [Path(plan.stage_dir) / d.name for d in dirs]
    return dirs


def _digest(plan: CheckpointPlan, tree_digest) -> dict[str, dict[str, str]]:
    return {
        f"{i}:{d.name.split('-tiny-')[-1]}": tree_digest(d)
        for i, d in enumerate(_outputs(plan))
        if d.exists()
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_all_steps_then_a_second_run_does_nothing(tmp_path, family):
    plan = _plan(tmp_path, family)
    first = prepare(plan, progress=False)
    assert first.ran == ("fetch", "validate", "fp8", "torch_dist", "stage")
    for d in _outputs(plan):
        assert read_manifest(d) is not None, d
    assert (Path(plan.torch_dist_dir) / "latest_checkpointed_iteration.txt").read_text() == "release"
    second = prepare(plan, progress=False)
    assert second.ran == () and {s.status for s in second.steps} == {"skipped"}


def test_dry_run_reports_the_work_and_writes_nothing(tmp_path):
    plan = _plan(tmp_path, "qwen3")
    result = prepare(plan, dry=True, progress=False)
    assert [s.status for s in result.steps] == ["would run"] * 5
    assert not (tmp_path / "models").exists() and not (tmp_path / "local").exists()
    prepare(plan, steps=["fetch"], progress=False)
    statuses = {s.step: s.status for s in prepare(plan, dry=True, progress=False).steps}
    assert statuses == {
        "fetch": "skipped",
        "validate": "would run",
        "fp8": "would run",
        "torch_dist": "would run",
        "stage": "would run",
    }


def test_steps_run_alone_need_their_inputs_and_must_belong_to_the_plan(tmp_path):
    plan = _plan(tmp_path, "qwen3", steps=("fetch", "validate", "fp8"))
    with pytest.raises(StepFailed, match="fp8 needs .* does not exist yet; run the fetch"):
        prepare(plan, steps=["fp8"], progress=False)
    with pytest.raises(CheckpointError, match=r"step\(s\) \['torch_dist'\] do not apply"):
        prepare(plan, steps=["torch_dist"], progress=False)
    assert prepare(plan, steps=["fetch", "fp8"], progress=False).ran == ("fetch", "fp8")


def test_trim_cuts_a_deeper_local_checkpoint_and_leaves_the_source_untouched(tmp_path, tiny, tree_digest):
    source = tiny("qwen3", 6)
    before = tree_digest(source)
    plan = _plan(tmp_path, "qwen3", source=str(source), steps=("fetch", "validate", "trim", "fp8"))
    result = prepare(plan, progress=False)
    assert result.ran == ("validate", "trim", "fp8")  # fetch has nothing to do: trim reads the source
    assert tree_digest(source) == before
    hf = Path(plan.hf_dir)
    config = json.loads((hf / "config.json").read_text())
    assert config["num_hidden_layers"] == 4 and len(config["layer_types"]) == 4
    names = set(read_weight_map(hf).weight_map)
    assert "model.layers.3.mlp.up_proj.weight" in names and not any(".layers.4." in n for n in names)
    assert prepare(plan, progress=False).ran == ()


def test_trim_keeps_the_mtp_layer_renumbered_after_the_slice(tmp_path, tiny):
    # GLM-5 names its MTP layer model.layers.<L>: a 4-layer slice of a 6-layer model keeps it as layer 4
    plan = _plan(
        tmp_path, "glm_moe_dsa", source=str(tiny("glm_moe_dsa", 6)), steps=("fetch", "validate", "trim")
    )
    prepare(plan, progress=False)
    names = set(read_weight_map(Path(plan.hf_dir)).weight_map)
    assert "model.layers.4.eh_proj.weight" in names and not any(
        ".layers.5." in n or ".layers.6." in n for n in names
    )


def test_a_source_with_the_wrong_layer_count_stops_at_validate(tmp_path, tiny):
    plan = _plan(tmp_path, "qwen3", source=str(tiny("qwen3", 6)), steps=("fetch", "validate", "fp8"))
    with pytest.raises(
        StepFailed,
        match=r"(?s)validate of .*num_hidden_layers\] is 6 but the model is a 4-layer slice; add the trim step",
    ):
        prepare(plan, progress=False)
    assert not Path(plan.fp8_dir).exists()


def test_a_changed_source_redoes_every_step_downstream(tmp_path, tiny_copy):
    source = tiny_copy("qwen3")
    plan = _plan(tmp_path, "qwen3", source=str(source), steps=("fetch", "validate", "fp8", "torch_dist"))
    prepare(plan, progress=False)
    config = json.loads((source / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (source / "config.json").write_text(json.dumps(config))
    assert prepare(plan, progress=False).ran == ("fetch", "validate", "fp8", "torch_dist")
    assert json.loads((Path(plan.fp8_dir) / "config.json").read_text())["rms_norm_eps"] == 1e-5


def test_a_rerun_redoes_a_step_whose_files_were_overwritten_in_place(tmp_path, tree_digest):
    """The manifest's digests are checked, not only the sizes: an output overwritten in place
    (same size) is no longer "up to date"; the rerun rewrites it and the bytes come back."""
    plan = _plan(tmp_path, "qwen3", layers=2, steps=("fetch", "validate", "torch_dist"))
    prepare(plan, progress=False)
    dist = Path(plan.torch_dist_dir)
    good = tree_digest(dist)
    data = dist / "release" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.seek(size // 2)
        f.write(b"\x41" * 64)
    result = {s.step: s for s in prepare(plan, progress=False).steps}
    assert result["fetch"].status == "skipped" and result["torch_dist"].status == "ran"
    assert result["torch_dist"].detail == (
        f"redone: {data} is not the file that was written: its sha256 differs from the recorded one (changed in place)"
    )
    assert tree_digest(dist) == good
    weights = next(Path(plan.hf_dir).glob("*.safetensors"))
    weights.write_bytes(
        weights.read_bytes()[:-8]
    )  # the fetched model truncated: rebuilt, the rest up to date
    result = {s.step: s for s in prepare(plan, progress=False).steps}
    assert result["fetch"].status == "ran" and "truncated" in result["fetch"].detail
    assert result["torch_dist"].status == "skipped"


def test_stage_copies_only_files_that_changed(tmp_path, tiny_copy):
    source = tiny_copy("qwen3")
    plan = _plan(tmp_path, "qwen3", source=str(source), steps=("fetch", "validate", "fp8", "stage"))
    first = {s.step: s for s in prepare(plan, progress=False).steps}["stage"]
    assert int(first.detail.split()[1]) > 1_000_000
    new = '{"do_sample": true}\n'
    (source / "generation_config.json").write_text(new)
    result = prepare(plan, progress=False)
    assert result.ran == ("fetch", "validate", "fp8", "stage")
    second = {s.step: s for s in result.steps}["stage"]
    # the HF and FP8 dirs changed in that one small file; every shard is already staged
    assert second.detail == f"copied {2 * len(new)} bytes"
    for d in (plan.hf_dir, plan.fp8_dir):
        assert (Path(plan.stage_dir) / Path(d).name / "generation_config.json").read_text() == new


def test_a_directory_miles_did_not_write_is_never_replaced(tmp_path):
    plan = _plan(tmp_path, "qwen3", steps=("fetch", "validate", "fp8"))
    prepare(plan, steps=["fetch"], progress=False)
    Path(plan.fp8_dir).mkdir()
    (Path(plan.fp8_dir) / "notes.txt").write_text("mine")
    with pytest.raises(StepFailed, match="was not written by miles"):
        prepare(plan, progress=False)
    assert (Path(plan.fp8_dir) / "notes.txt").read_text() == "mine"


def _fork(fn) -> int:
    pid = os.fork()
    if pid == 0:  # child: run, report by exit code only, never return into pytest
        code = 0
        try:
            import torch

            torch.set_num_threads(1)
            fn()
        except BaseException as exc:  # the parent reads the message from a file
            Path(os.environ.get("MILES_TEST_CHILD_ERR", "/dev/null")).write_text(str(exc))
            code = 3
        finally:
            os._exit(code)
    return pid


def _wait(pid: int, timeout: float = 120.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise AssertionError("the child run did not finish in time")


def test_sigkill_at_random_points_then_rerun_gives_the_bytes_of_an_uninterrupted_run(tmp_path, tree_digest):
    reference = _plan(tmp_path / "ref")
    prepare(reference, progress=False)
    expected = _digest(reference, tree_digest)
    rng = random.Random(20261130)
    targets = ["fetch", "fp8", "torch_dist", "stage"]
    for trial, target in enumerate(targets):
        plan = _plan(tmp_path / f"killed{trial}")
        pid = _fork(lambda plan=plan: prepare(plan, progress=False))
        watch = {
            "fetch": Path(plan.hf_dir),
            "fp8": Path(plan.fp8_dir),
            "torch_dist": Path(plan.torch_dist_dir),
            "stage": Path(plan.stage_dir or "") / Path(plan.hf_dir).name,
        }[target]
        partial = watch.parent / f".{watch.name}.partial-{pid}"
        deadline = time.monotonic() + 120
        reaped = False  # the child may finish before its partial folder is seen (a loaded machine)
        while not partial.exists() and time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                reaped = True
                break
            time.sleep(0.001)
        if not reaped:
            time.sleep(rng.uniform(0.0, 0.05))
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _wait(pid)
        for d in _outputs(plan):  # whatever exists under a final name is complete
            assert not d.exists() or read_manifest(d) is not None, d
        prepare(plan, progress=False)
        assert _digest(plan, tree_digest) == expected, f"kill during {target}"
        leftovers = [p.name for d in _outputs(plan) for p in d.parent.iterdir() if ".partial-" in p.name]
        assert leftovers == []


def test_a_file_size_limit_mid_step_fails_in_one_line_marks_nothing_done_and_a_rerun_finishes(
    tmp_path, tree_digest, monkeypatch
):
    plan = _plan(tmp_path, "qwen3", steps=("fetch", "validate", "fp8"))
    prepare(plan, steps=["fetch", "validate"], progress=False)
    hf_before = tree_digest(Path(plan.hf_dir))
    err = tmp_path / "child-error.txt"
    monkeypatch.setenv("MILES_TEST_CHILD_ERR", str(err))

    def full_disk_run():
        # Writes past 200 kB fail with EFBIG, as a full disk fails them with ENOSPC.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
        prepare(plan, progress=False)

    status = _wait(_fork(full_disk_run))
    assert os.waitstatus_to_exitcode(status) == 3
    message = err.read_text()
    assert "fp8 of qwen3-tiny-4layer: file too large writing" in message and ".safetensors" in message
    assert "nothing was marked done and the inputs are untouched; raise the file size limit" in message
    assert "\n" not in message
    assert not Path(plan.fp8_dir).exists()
    assert not [p for p in Path(plan.model_dir).iterdir() if ".partial-" in p.name]
    assert tree_digest(Path(plan.hf_dir)) == hf_before
    assert prepare(plan, progress=False).ran == ("fp8",)
