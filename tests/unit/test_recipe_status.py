"""A profile is "verified" only when a run record says a lane trained it; "trained on the CPU lane" when a
cpu-lane test trains it (read by the CI from the tests' registrations and code into the evidence file
the recipes read); "cannot build" when the Megatron backend's own mapping refuses its model; otherwise
untested.

The run records here are real `miles.ci.reports.record.RunRecord`s written as the runner writes its
run.json; only the GPU that would have produced them is missing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.reports.recipes import cpu_lane_trainings, evidence_drift, evidence_text, profile_suite_problems
from miles.ci.reports.record import Attempt, RunRecord
from miles.recipes import load, shared
from miles.recipes.launch import RunOptions, build_plan, format_plan
from miles.recipes.recipe import RecipeError
from miles.recipes.status import (
    CANNOT_BUILD,
    CPU_LANE,
    CPU_LANE_EVIDENCE,
    FALLBACK,
    UNTESTED,
    UNTESTED_GPU,
    VERIFIED,
    megatron_model_types,
    profile_status,
    record_run,
)

register_cpu_ci(est_time=2, suite="stage-a-cpu")


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


def test_a_gpu_profile_of_a_recipe_with_a_fallback_says_what_it_trains_with(tmp_path, inkling_unbuilt):
    recipe = load("inkling", platform="rocm")
    assert "inkling_text" not in megatron_model_types()
    status = profile_status(recipe, recipe.profiles[0], tmp_path)
    assert status.kind == FALLBACK
    assert status.detail.startswith(
        "fsdp over the HF checkpoint on 4 rocm GPUs instead of Megatron at tp4·pp1·cp1·ep4·etp1+sp (the recipe's "
        "fallback: miles' Megatron backend does not build Inkling yet"
    )
    assert "tests/e2e/recipes/test_inkling_recipe.py trains it in stage-c-4-gpu-mi350" in status.detail


def test_a_megatron_profile_of_a_family_the_backend_does_not_build_cannot_build(tmp_path, inkling_unbuilt):
    recipe = load("inkling", platform="rocm")
    profile = replace(recipe.profiles[0], train_backend="megatron")
    status = profile_status(recipe, profile, tmp_path)
    assert status.kind == CANNOT_BUILD
    assert status.detail == (
        "Inkling-Small is model type inkling_text/inkling_mm_model; miles' Megatron backend builds deepseek_v4, glm4_moe_lite, glm_moe_dsa, "
        "mimo, qwen2, qwen3, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe (miles/families/)"
    )


def test_a_gpu_profile_the_backend_builds_without_a_record_is_untested_on_gpu(tmp_path):
    recipe = shared("qwen3_30b_a3b")
    status = profile_status(recipe, recipe.profiles[0], tmp_path)
    assert status.kind == UNTESTED_GPU
    assert (
        "tests/e2e/recipes/test_qwen3_30b_a3b_recipe.py trains it in stage-c-4-gpu-h200, but no run record"
        in (status.detail)
    )


@pytest.mark.parametrize("name", ["qwen3_4b", "qwen3_30b_a3b", "inkling", "glm5_2_744b_a40b", "deepseek_v4"])
def test_every_cpu_profile_is_trained_on_the_cpu_lane(name, tmp_path):
    recipe = shared(name)
    status = profile_status(recipe, recipe.profile("tiny", "cpu"), tmp_path)
    assert status.kind == CPU_LANE
    assert "in stage-b-cpu" in status.detail


def test_what_the_cpu_lane_trains_is_read_from_its_tests(make_tree):
    """Enabled cpu registrations on cpu-lane suites count; a disabled one, a GPU one, or a file
    that builds no CPU plan do not."""
    plan = "from miles.ci.register import register_{kind}_ci\n\nregister_{kind}_ci({args})\n\n{body}\n"
    cpu = 'est_time=60, suite="stage-b-cpu"'
    root = make_tree(
        {
            "tests/e2e/test_one.py": plan.format(kind="cpu", args=cpu, body=(
                "import pytest\n\n@pytest.mark.parametrize('recipe', ['inkling', 'deepseek_v4'])\n"
                "def test_x(recipe, tmp_path):\n    runs.tiny_plan(recipe, tmp_path)\n"
            )),
            "tests/e2e/test_two.py": plan.format(kind="cpu", args=cpu, body=(
                "SETUP = {'recipe': 'qwen3_30b_a3b'}\n\ndef test_y(tmp_path):\n"
                "    runs.tiny_plan(SETUP['recipe'], tmp_path)\n"
            )),
            "tests/e2e/test_off.py": plan.format(kind="cpu", args=cpu + ', disabled="broken runner, #12"', body=(
                "def test_z(tmp_path):\n    runs.tiny_plan('qwen3_4b', tmp_path)\n"
            )),
            "tests/e2e/test_gpu.py": plan.format(
                kind="cuda", args='est_time=60, suite="stage-c-4-gpu-h200", labels=["megatron"]',
                body="def test_g(tmp_path):\n    runs.tiny_plan('glm5_2_744b_a40b', tmp_path)\n",
            ),
            "tests/e2e/test_names_only.py": plan.format(kind="cpu", args=cpu, body="NAME = 'glm5_2_744b_a40b'\n"),
        }
    )  # fmt: skip
    trained = cpu_lane_trainings(root)
    assert trained == {
        "deepseek_v4": (("tests/e2e/test_one.py", "stage-b-cpu"),),
        "inkling": (("tests/e2e/test_one.py", "stage-b-cpu"),),
        "qwen3_30b_a3b": (("tests/e2e/test_two.py", "stage-b-cpu"),),
    }
    # handed to the recipes as data, which is all they read
    evidence = root / "cpu-lane.json"
    evidence.write_text(evidence_text(trained))
    recipe = shared("qwen3_4b")
    status = profile_status(recipe, recipe.profile("tiny", "cpu"), root / "runs", evidence)
    assert (status.kind, status.detail) == (UNTESTED, "no test of the cpu lane builds its CPU plan")
    status = profile_status(
        shared("inkling"), shared("inkling").profile("tiny", "cpu"), root / "runs", evidence
    )
    assert status.kind == CPU_LANE and "tests/e2e/test_one.py in stage-b-cpu" in status.detail


def test_the_committed_cpu_lane_evidence_is_what_the_tests_say():
    root = Path(__file__).resolve().parents[2]
    assert evidence_drift(CPU_LANE_EVIDENCE, cpu_lane_trainings(root)) is None


def test_a_stale_evidence_file_is_named_with_the_command_that_rewrites_it(tmp_path):
    path = tmp_path / "cpu-lane.json"
    path.write_text(evidence_text({"qwen3_4b": (("tests/e2e/test_gone.py", "stage-b-cpu"),)}))
    drift = evidence_drift(path, {"qwen3_4b": (("tests/e2e/test_new.py", "stage-b-cpu"),)})
    assert drift.endswith("run `python -m miles.ci recipes --write` and review the diff")


def test_every_gpu_profile_names_a_suite_of_its_platform_with_its_gpu_count():
    from miles.recipes import names, variants

    forms = [form for name in names() for form in variants(name)]
    assert profile_suite_problems(forms, load_catalog()) == []
    recipe = shared("qwen3_4b")
    typo = replace(recipe, profiles=(replace(recipe.profiles[0], suite="stage-c-4-gpu-h20"),))
    wrong = replace(recipe, profiles=(replace(recipe.profiles[0], suite="stage-c-8-gpu-h200"),))
    (typo_problem,) = profile_suite_problems([typo])
    assert (
        "profile suite: suite 'stage-c-4-gpu-h20' is not in the catalog for cuda; did you mean"
        in typo_problem
    )
    assert profile_suite_problems([wrong]) == [
        "miles/recipes/library/qwen3_4b.py: qwen3_4b (shared) cuda 1x4 Qwen3-4B: tp2·pp1·cp2(a2a)·ep1·etp1+sp: a profile of 4 "
        "GPU(s) names suite "
        "stage-c-8-gpu-h200, whose runners have 8"
    ]


def test_a_passed_run_of_the_profiles_test_verifies_it(tmp_path, inkling_unbuilt):
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
    # a verified fallback profile says what it was verified with
    assert status.detail.endswith("it trained with the recipe's fallback, --train-backend fsdp, not Megatron")


def test_a_record_of_another_command_does_not_verify(tmp_path, inkling_unbuilt):
    recipe = load("inkling", platform="rocm")
    profile = recipe.profiles[0]
    run = _run_json(tmp_path, "tests/e2e/recipes/test_inkling_recipe.py", "stage-c-4-gpu-mi350")
    record_run(recipe, profile, run, tmp_path / "runs")
    changed = replace(recipe, env=(*recipe.env, ("SGLANG_NEW_SWITCH", "1")))
    status = profile_status(changed, profile, tmp_path / "runs")
    assert status.kind == FALLBACK
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
        "profile    untested on GPU: megatron on cuda: tests/e2e/recipes/test_qwen3_4b_recipe.py"
        in format_plan(plan)
    )
    assert plan.to_json()["status"].startswith("untested on GPU")


def test_a_recipe_trained_through_a_support_helper_is_found_from_the_settings_it_passes(tmp_path):
    from miles.ci.reports.recipes import recipes_trained

    support = tmp_path / "tests" / "support"
    support.mkdir(parents=True)
    (support / "learning.py").write_text(
        'A = {"recipe": "qwen3_4b", "lr": "1e-3"}\nB = {**A, "lr": "2e-3"}\nC = {**A, "recipe": "inkling"}\n'
        "def train(workdir, setup):\n    return runs.tiny_plan(setup['recipe'], workdir)\n"
        "def other(setup):\n    return setup\n"
    )
    test = tmp_path / "tests" / "e2e" / "test_x.py"
    test.parent.mkdir()
    test.write_text(
        "from tests.support.learning import B, C, other, train\n"
        "def test_b(tmp_path):\n    train(tmp_path, B)\n"
        "def test_c(tmp_path):\n    other(C)\n"  # C only reaches a helper that trains nothing
    )
    assert recipes_trained(test) == {"qwen3_4b"}
