"""The GitHub workflows keep the catalog's promises: sessions exist, suites are consumed,
runner labels are the catalog's, ROCm containers see their GPUs, images are real variants."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.image.config import load_images

register_cpu_ci(est_time=3, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = ROOT / ".github" / "workflows"
NOX_SESSION = re.compile(r"\bnox\b(?:\s+--?[\w-]+)*\s+-s\s+([\w.-]+)")
MATRIX_LANE = re.compile(r"-m miles\.ci matrix --lane ([\w.-]+)")
# Jobs that prepare a run (policy, matrices, the image) instead of running tests.
PLANNING = re.compile(r"-m miles\.ci (?:policy|matrix)\b|\binvoke refresh-image\b|pip install\b")


@cache
def workflows() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(WORKFLOWS.glob("*.yml"))}


def _runs(job: dict) -> list[str]:
    return [step["run"] for step in job.get("steps", []) if "run" in step]


def _sessions(job: dict) -> list[str]:
    return [m for run in _runs(job) for m in NOX_SESSION.findall(run)]


def _matrix_lanes(workflow: dict, job: dict) -> list[str]:
    """Lanes whose `miles.ci matrix` output feeds this job's strategy.matrix."""
    source = str(job.get("strategy", {}).get("matrix", ""))
    match = re.search(r"needs\.(\w+)\.outputs\.(\w+)", source)
    if not match:
        return []
    producer = workflow["jobs"][match[1]]
    step_ref = re.search(r"steps\.(\w+)\.outputs", producer["outputs"][match[2]])[1]
    (step,) = [s for s in producer["steps"] if s.get("id") == step_ref]
    return MATRIX_LANE.findall(step["run"])


@cache
def nox_sessions() -> set[str]:
    """Every session `nox -l` shows, selected by default (*) or not (-)."""
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-l"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return set(re.findall(r"^[*-] ([\w.-]+) ->", done.stdout, flags=re.MULTILINE))


def test_every_catalog_workflow_exists_and_parses():
    named = {c.name for s in load_catalog().suites.values() for c in s.consumers if c.kind == "workflow"}
    assert named and named <= set(workflows())


def test_every_nox_session_a_workflow_calls_exists():
    called = {
        (name, s) for name, wf in workflows().items() for job in wf["jobs"].values() for s in _sessions(job)
    }
    assert called
    missing = sorted(f"{name}: nox -s {s}" for name, s in called if s not in nox_sessions())
    assert missing == []


def test_every_job_either_calls_a_nox_session_or_only_plans():
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            if _sessions(job):
                continue
            others = [run for run in _runs(job) if not PLANNING.search(run)]
            assert others == [], f"{name}: job {job_name} runs something other than nox or planning"


def test_every_suite_is_run_by_the_workflows_that_claim_it():
    catalog = load_catalog()
    for suite in catalog.suites.values():
        for consumer in suite.consumers:
            if consumer.kind != "workflow":
                continue
            wf = workflows()[consumer.name]
            lanes = {s for job in wf["jobs"].values() for s in _sessions(job)}
            assert suite.lane in lanes, f"{consumer.name} never runs nox -s {suite.lane} for {suite.name}"


def test_runner_labels_are_the_catalogs():
    catalog = load_catalog()
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            lanes = set(_sessions(job))
            if not lanes:
                continue
            where = f"{name}: job {job_name}"
            if job.get("strategy", {}).get("matrix"):
                # a sharded job takes its labels from the matrix, which the catalog fills
                assert job["runs-on"] == "${{ matrix.runner_labels }}", where
                assert set(_matrix_lanes(wf, job)) == lanes, where
            else:
                labels = {tuple(s.runner_labels) for lane in lanes for s in catalog.suites_of_lane(lane)}
                runs_on = job["runs-on"] if isinstance(job["runs-on"], list) else [job["runs-on"]]
                assert labels == {tuple(runs_on)}, where


def test_gpu_jobs_verify_the_image_instead_of_installing():
    catalog = load_catalog()
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            for lane in _sessions(job):
                if catalog.lanes[lane].backend != "cpu":
                    assert any("--system" in run for run in _runs(job)), f"{name}: {job_name}"


def test_rocm_containers_get_the_devices_and_the_runners_gpu_pinning():
    catalog = load_catalog()
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            if not any(catalog.lanes[lane].backend == "rocm" for lane in _sessions(job)):
                continue
            start = " ".join(run for run in _runs(job) if "docker run" in run)
            for flag in ("--device=/dev/kfd", "--device=/dev/dri", "-e HIP_VISIBLE_DEVICES"):
                assert flag in start, f"{name}: {job_name} lacks {flag}"


def test_images_are_variants_built_for_the_jobs_backend():
    catalog, config = load_catalog(), load_images()
    for name, wf in workflows().items():
        variants = [
            v
            for job in wf["jobs"].values()
            for run in _runs(job)
            for v in re.findall(r"--variant ([\w-]+)", run)
        ]
        backends = {catalog.lanes[s].backend for job in wf["jobs"].values() for s in _sessions(job)} - {"cpu"}
        assert {config.stacks[config.variant(v).stack].backend for v in variants} == backends, name


def test_matrix_command_gives_the_catalogs_runner_labels():
    catalog = load_catalog()
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "matrix", "--lane", "cuda-h200", "--cadence", "nightly"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    for entry in json.loads(done.stdout)["include"]:
        assert entry["runner_labels"] == list(catalog.suites[entry["suite"]].runner_labels)


# ------------------------------------------------------------------ supply chain and secrets

SHA_PIN = re.compile(r"^[\w.-]+/[\w./-]+@[0-9a-f]{40}$")


def test_every_action_is_pinned_to_a_full_commit():
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            for step in job.get("steps", []):
                if "uses" in step:
                    assert SHA_PIN.match(step["uses"]), f"{name}: {job_name}: {step['uses']}"


def test_no_checkout_keeps_the_token_in_the_working_tree():
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            for step in job.get("steps", []):
                if step.get("uses", "").startswith("actions/checkout@"):
                    assert step.get("with", {}).get("persist-credentials") is False, f"{name}: {job_name}"


def test_only_the_image_jobs_may_write_packages():
    for name, wf in workflows().items():
        assert wf["permissions"] == {"contents": "read"}, name
        for job_name, job in wf["jobs"].items():
            writes = [k for k, v in job.get("permissions", {}).items() if v == "write"]
            assert writes in ([], ["packages"]), f"{name}: {job_name}"
            if writes:
                assert any("refresh-image" in run for run in _runs(job)), f"{name}: {job_name}"


def test_store_secrets_come_through_environments_read_only_for_prs():
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            if "secrets.MILES_HISTORY_URL" in json.dumps(job):
                expected = "history-write" if "schedule" in wf[True] else "history-read"
                assert job.get("environment") == expected, f"{name}: {job_name}"


def test_a_pr_image_build_never_moves_the_rolling_alias():
    for name, wf in workflows().items():
        if "pull_request" not in wf[True]:
            continue
        for job in wf["jobs"].values():
            for step in job.get("steps", []):
                if "refresh-image" in step.get("run", "") and "--push" in step["run"]:
                    assert "$NO_ALIAS" in step["run"], name
                    assert (
                        "'--no-alias'" in step["env"]["NO_ALIAS"]
                        and "pull_request" in step["env"]["NO_ALIAS"]
                    )


def test_a_github_cancel_reaches_the_runner_inside_the_container():
    """The shard runs as the container's attached command (exec'd, --init), not through
    `docker exec`, whose client does not pass signals on."""
    for name, wf in workflows().items():
        for job_name, job in wf["jobs"].items():
            if not _sessions(job):
                continue
            runs = " ".join(_runs(job))
            assert "docker exec" not in runs, f"{name}: {job_name}"
            if "docker run" in runs:
                (shard,) = [r for r in _runs(job) if "nox -s" in r]
                assert shard.startswith("exec docker run --rm --init "), f"{name}: {job_name}"
                assert "-d " not in shard.split('"$IMAGE"')[0]


# ------------------------------------------------------------------ what each event runs

EXPRESSION = re.compile(r"\$\{\{\s*(.*?)\s*\}\}")


def _run_plan_job(workflow: str, event: str, pr_labels: list[str], tmp: Path) -> tuple[dict, str]:
    """Run the `plan` job's steps of `workflow` as GitHub would for `event` on main: each step's
    own shell command and env, with the expressions it uses filled in. Returns the job's
    outputs and what its steps printed on stderr."""
    job = workflows()[workflow]["jobs"]["plan"]
    ref = "refs/pull/7/merge" if event == "pull_request" else "refs/heads/main"
    labels = json.dumps([{"name": name} for name in pr_labels]) if event == "pull_request" else "null"
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "python").unlink(missing_ok=True)
    (bindir / "python").symlink_to(sys.executable)
    steps: dict[str, dict[str, str]] = {}

    def evaluate(text: str) -> str:
        def one(match: re.Match) -> str:
            expr = match[1]
            known = {
                "github.event_name": event,
                "toJSON(github.event.pull_request.labels)": labels,
                "inputs.cadence": "",
            }
            if expr in known:
                return known[expr]
            step = re.fullmatch(r"steps\.(\w+)\.outputs\.(\w+)", expr)
            assert step, f"{workflow}: the test does not know the expression {expr!r}"
            return steps[step[1]][step[2]]

        return EXPRESSION.sub(one, str(text))

    stderr = ""
    for index, step in enumerate(s for s in job["steps"] if "run" in s):
        output = tmp / f"{workflow}-{event}-{index}.out"
        output.write_text("")
        env = {
            "PATH": f"{bindir}{os.pathsep}/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "GITHUB_ACTIONS": "true",
            "GITHUB_EVENT_NAME": event,
            "GITHUB_REF": ref,
            "GITHUB_WORKFLOW_REF": f"miles-ci/miles/.github/workflows/{workflow}@{ref}",
            "GITHUB_OUTPUT": str(output),
            **{key: evaluate(value) for key, value in step.get("env", {}).items()},
        }
        done = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", step["run"]], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, f"{workflow}: {step['run']}\n{done.stderr}"
        stderr += done.stderr
        steps[step.get("id", str(index))] = dict(
            line.split("=", 1) for line in output.read_text().splitlines() if "=" in line
        )
    return {key: evaluate(value) for key, value in job["outputs"].items()}, stderr


def _full_matrix(lane: str) -> list[dict]:
    """The lane's matrix with every label admitted (no --labels): all of its GPU tests."""
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "matrix", "--lane", lane],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["include"]


def _gpu_matrix_jobs(workflow: str) -> list[tuple[str, str, str]]:
    """(job, lane, plan output holding its matrix) of every GPU job fed by the plan job."""
    wf = workflows()[workflow]
    found = []
    for job_name, job in wf["jobs"].items():
        source = str(job.get("strategy", {}).get("matrix", ""))
        match = re.search(r"needs\.plan\.outputs\.(\w+)", source)
        if match:
            (lane,) = _matrix_lanes(wf, job)
            found.append((job_name, lane, match[1]))
    return found


@pytest.mark.parametrize("workflow", ["pr-test.yml", "pr-test-rocm.yml"])
def test_a_push_to_main_runs_every_gpu_test_of_every_gpu_lane(workflow, tmp_path):
    assert "push" in workflows()[workflow][True]
    outputs, stderr = _run_plan_job(workflow, "push", [], tmp_path)
    jobs = _gpu_matrix_jobs(workflow)
    assert jobs
    for job_name, lane, output in jobs:
        full = _full_matrix(lane)
        assert full, f"{lane} registers no GPU test, so this test shows nothing"
        assert json.loads(outputs[output])["include"] == full, f"{workflow}: {job_name}"
    assert "push runs every GPU test (merged code)" in stderr


@pytest.mark.parametrize("workflow", ["pr-test.yml", "pr-test-rocm.yml"])
def test_an_unlabeled_pr_runs_no_gpu_test_and_the_policy_says_so(workflow, tmp_path):
    outputs, stderr = _run_plan_job(workflow, "pull_request", ["documentation"], tmp_path)
    for job_name, _lane, output in _gpu_matrix_jobs(workflow):
        assert json.loads(outputs[output])["include"] == [], f"{workflow}: {job_name}"
        assert (
            workflows()[workflow]["jobs"][job_name]["if"]
            == f"needs.plan.outputs.{output.replace('matrix', 'empty')} == 'false'"
        )
    assert "pull_request runs no GPU test, only the CPU lane: add run-ci-<label>" in stderr


def test_a_labelled_pr_runs_the_gpu_tests_its_labels_name(tmp_path):
    outputs, _ = _run_plan_job("pr-test-rocm.yml", "pull_request", ["run-ci-fsdp"], tmp_path)
    include = json.loads(outputs["matrix"])["include"]
    assert include and sum(entry["tests"] for entry in include) < sum(
        e["tests"] for e in _full_matrix("rocm-mi350")
    )


# ------------------------------------------------------------------ baselines for every gate


def _cadence_passed(job: dict, lane: str) -> str:
    """The cadence a job runs its lane at: `--cadence X` on its nox command, else the lane's."""
    for run in _runs(job):
        if f"nox -s {lane}" in run:
            match = re.search(r"--cadence (\w+)", run)
            return match[1] if match else load_catalog().lanes[lane].cadence
    return ""


def test_every_scheduled_workflow_is_in_the_catalog_with_the_cadence_it_runs():
    catalog = load_catalog()
    scheduled = {name for name, wf in workflows().items() if "schedule" in wf[True]}
    assert scheduled == set(catalog.schedules)
    for name in scheduled:
        for job_name, job in workflows()[name]["jobs"].items():
            for lane in _sessions(job):
                assert _cadence_passed(job, lane) == catalog.schedules[name], f"{name}: {job_name}"
                assert job.get("environment") == "history-write", f"{name}: {job_name}"


def test_every_suite_a_pr_runs_is_also_run_on_a_schedule_that_stores_its_baselines():
    catalog = load_catalog()
    for suite in catalog.suites.values():
        if suite.cadence != "regular" or not suite.is_gpu:
            continue
        writers = [w for w, cadence in catalog.scheduled_runs(suite.name) if cadence in ("nightly", "weekly")]
        assert writers, f"no scheduled workflow stores the history of {suite.name}"
        for writer in writers:
            lanes = {s for job in workflows()[writer]["jobs"].values() for s in _sessions(job)}
            assert suite.lane in lanes, f"{writer} never runs nox -s {suite.lane} for {suite.name}"
