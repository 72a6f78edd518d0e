"""A profile is "verified" only when a run record says a lane trained it; else "layout checked" or "untested".

The run records here are real `miles.ci.record.RunRecord`s written as the runner writes its
run.json; only the GPU that would have produced them is missing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.record import Attempt, RunRecord
from miles.recipes import load, shared
from miles.recipes.launch import RunOptions, build_plan, format_plan
from miles.recipes.recipe import RecipeError, lane_megatron_core
from miles.recipes.status import LAYOUT_CHECKED, UNTESTED, VERIFIED, profile_status, record_run


def _run_json(tmp_path: Path, file: str, suite: str, status: str = "passed") -> Path:
    attempt = Attempt(
        file=file, backend="rocm", suite=suite, lane="rocm-mi350", shard="1/1", attempt=1, status=status,
        exit_code=0 if status == "passed" else 1, signal=None, elapsed=1520.4, est_time=1600, retry_reason=None,
        classification=status, commit="0123456789abcdef", started_at=1767225600.0,
    )  # fmt: skip
    run = RunRecord(
        lane="rocm-mi350", suites=(suite,), shard="1/1", backend="rocm", cadence="regular", labels=None,
        commit="0123456789abcdef", started_at=1767225600.0, finished_at=1767227200.0, attempts=(attempt,),
    )  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run.to_json()))
    return path


def test_megatron_gpu_profiles_without_a_record_are_layout_checked(tmp_path):
    recipe = load("inkling", platform="rocm")
    status = profile_status(recipe, recipe.profiles[0], tmp_path)
    assert status.kind == LAYOUT_CHECKED
    assert f"megatron-core {lane_megatron_core('rocm')}" in status.detail  # the lane's pin
    assert "no lane has trained it" in status.detail
    assert "megatron-core lacks 5 feature(s) of Inkling-Small" in status.detail


def test_the_cpu_tiny_profile_without_a_record_is_untested(tmp_path):
    recipe = shared("qwen3_4b")
    tiny = recipe.profile("tiny", "cpu")
    status = profile_status(recipe, tiny, tmp_path)
    assert status.kind == UNTESTED
    assert "tests/e2e/test_train_megatron_tiny.py trains it in stage-b-cpu" in status.detail


def test_a_passed_run_of_the_profiles_test_verifies_it(tmp_path):
    recipe = load("inkling", platform="rocm")
    profile = recipe.profiles[0]
    run = _run_json(tmp_path, "tests/e2e/recipes/test_inkling_recipe.py", "stage-c-4-gpu-mi350")
    path = record_run(recipe, profile, run, tmp_path / "runs")
    assert path.name == "inkling-rocm-rocm-1x4-Inkling-Small-4layer.json"
    status = profile_status(recipe, profile, tmp_path / "runs")
    assert status.kind == VERIFIED
    assert status.detail.startswith(
        "tests/e2e/recipes/test_inkling_recipe.py passed in stage-c-4-gpu-mi350 at commit 0123456789ab on 2026-01-01"
    )


def test_a_record_of_another_command_does_not_verify(tmp_path):
    recipe = load("inkling", platform="rocm")
    profile = recipe.profiles[0]
    run = _run_json(tmp_path, "tests/e2e/recipes/test_inkling_recipe.py", "stage-c-4-gpu-mi350")
    record_run(recipe, profile, run, tmp_path / "runs")
    changed = replace(recipe, env=(*recipe.env, ("SGLANG_NEW_SWITCH", "1")))
    status = profile_status(changed, profile, tmp_path / "runs")
    assert status.kind == LAYOUT_CHECKED
    assert "does not count: it was recorded for another command or environment" in status.detail


def test_a_failed_run_cannot_be_recorded(tmp_path):
    recipe = load("inkling", platform="rocm")
    run = _run_json(
        tmp_path, "tests/e2e/recipes/test_inkling_recipe.py", "stage-c-4-gpu-mi350", status="failed"
    )
    with pytest.raises(RecipeError, match="failed in stage-c-4-gpu-mi350; only a passed run verifies"):
        record_run(recipe, recipe.profiles[0], run, tmp_path / "runs")


def test_a_run_of_another_suite_cannot_be_recorded(tmp_path):
    recipe = load("inkling", platform="rocm")
    run = _run_json(tmp_path, "tests/e2e/recipes/test_inkling_recipe.py", "nightly-stage-c-4-gpu-mi350")
    with pytest.raises(
        RecipeError,
        match="no attempt of tests/e2e/recipes/test_inkling_recipe.py in suite stage-c-4-gpu-mi350",
    ):
        record_run(recipe, recipe.profiles[0], run, tmp_path / "runs")


def test_no_committed_profile_claims_verified_without_a_record():
    from miles.recipes import names, variants
    from miles.recipes.status import RUNS_DIR

    for name in names():
        for form in variants(name):
            for p in form.profiles:
                if profile_status(form, p).kind == VERIFIED:
                    assert any(RUNS_DIR.glob(f"{name}-{form.variant}-*.json"))


def test_the_dry_run_plan_states_the_status():
    plan = build_plan(shared("qwen3_4b"), RunOptions(model="Qwen3-4B", model_dir="/m"), base_env={})
    assert (
        f"profile    layout checked: the rules of megatron-core {lane_megatron_core('cuda')} pass"
        in format_plan(plan)
    )
    assert plan.to_json()["status"].startswith("layout checked")
