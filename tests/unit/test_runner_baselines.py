"""Who may store trusted history: the event of the run decides, never a PR label.

One rule (`miles.ci.selection.policy.stores_history`) is asked by the policy command, by the runner's
gate step and by `python -m miles.ci gate --write`; each is checked here against real runs
and a real SQLite store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.selection.policy import CiEvent, resolve_policy, stores_history
from miles.metrics.capture import MetricRecorder
from miles.metrics.store import open_store

register_cpu_ci(est_time=3, suite="stage-a-cpu")

CATALOG = load_catalog()
MAIN = "refs/heads/main"
NIGHTLY_WF = "miles-ci/miles/.github/workflows/nightly-rocm.yml@refs/heads/main"
CUDA_NIGHTLY_WF = "miles-ci/miles/.github/workflows/nightly-cuda.yml@refs/heads/main"
PR_WF = "miles-ci/miles/.github/workflows/pr-test.yml@refs/pull/7/merge"

TEST = "tests/e2e/test_gated.py"
GATED = """
from miles.ci.register import register_ci_gate, register_cpu_ci
from miles.metrics.capture import log

register_cpu_ci(est_time=20, suite="stage-b-cpu", nightly=True)
register_ci_gate(metric_key="train/grad_norm")


def test_train():
    for step in range(3):
        log(step, {"train/grad_norm": 1.0})
"""
GITHUB = ("GITHUB_ACTIONS", "GITHUB_EVENT_NAME", "GITHUB_REF", "GITHUB_WORKFLOW_REF", "GITHUB_STEP_SUMMARY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in (*GITHUB, "GITHUB_OUTPUT", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL"):
        monkeypatch.delenv(key, raising=False)


def _event(name: str, ref: str, workflow: str) -> CiEvent:
    return CiEvent(name, ref, workflow)


@pytest.mark.parametrize(
    ("event", "cadence", "stores"),
    [
        (_event("schedule", MAIN, NIGHTLY_WF), "nightly", True),
        (_event("workflow_dispatch", MAIN, NIGHTLY_WF), "nightly", True),
        (_event("workflow_dispatch", MAIN, NIGHTLY_WF), "weekly", True),
        # the CUDA nightly stores the history of the PR suites it runs, scheduled or dispatched
        (_event("schedule", MAIN, CUDA_NIGHTLY_WF), "nightly", True),
        (_event("workflow_dispatch", MAIN, CUDA_NIGHTLY_WF), "nightly", True),
        # a regular cadence extends no baseline, whatever the event
        (
            _event("push", MAIN, "miles-ci/miles/.github/workflows/pr-test.yml@refs/heads/main"),
            "regular",
            False,
        ),
        (_event("schedule", MAIN, NIGHTLY_WF), "regular", False),
        # unmerged code never does: a PR at nightly cadence (the `nightly` label) ...
        (_event("pull_request", "refs/pull/7/merge", PR_WF), "nightly", False),
        (_event("pull_request_target", "refs/heads/main", PR_WF), "nightly", False),
        (_event("merge_group", "refs/heads/gh-readonly-queue/main/pr-7", PR_WF), "nightly", False),
        # ... a dispatch on a branch, or by a workflow that is not a baseline writer
        (_event("workflow_dispatch", "refs/heads/feature", NIGHTLY_WF), "nightly", False),
        (
            _event("workflow_dispatch", MAIN, "miles-ci/miles/.github/workflows/pr-test.yml@refs/heads/main"),
            "nightly",
            False,
        ),  # fmt: skip
        (_event("push", "refs/heads/feature", NIGHTLY_WF), "nightly", False),
        (_event("push", "refs/tags/v1", NIGHTLY_WF), "nightly", False),
        # under CI an event the runner cannot see is not trusted
        (_event("", "", ""), "nightly", False),
        # outside CI (a person at a terminal) the cadence asked for decides
        (None, "nightly", True),
        (None, "regular", False),
    ],
)
def test_only_main_line_events_at_a_baseline_cadence_store_history(event, cadence, stores):
    assert stores_history(event, cadence, CATALOG) is stores


def test_a_push_to_main_runs_every_gpu_label_but_stores_nothing():
    policy = resolve_policy("push", [], CATALOG, ref=MAIN, workflow=PR_WF.replace("refs/pull/7/merge", MAIN))
    assert policy.labels.all and policy.outputs()["labels"] == "run-ci-all"
    assert policy.outputs()["store_history"] == "false"
    assert policy.gpu_scope() == "every GPU test (merged code)"
    unlabeled = resolve_policy("pull_request", ["bug"], CATALOG, ref="refs/pull/7/merge", workflow=PR_WF)
    assert unlabeled.outputs()["labels"] == "" and unlabeled.gpu_scope().startswith("no GPU test")


def test_the_github_environment_is_read_into_the_event():
    env = {"GITHUB_ACTIONS": "true", "GITHUB_EVENT_NAME": "schedule", "GITHUB_REF": MAIN,
           "GITHUB_WORKFLOW_REF": NIGHTLY_WF}  # fmt: skip
    assert CiEvent.from_env(env) == CiEvent("schedule", MAIN, NIGHTLY_WF)
    assert CiEvent.from_env(env).workflow_file == "nightly-rocm.yml"
    assert CiEvent.from_env({"GITHUB_EVENT_NAME": "schedule"}) is None  # not under Actions


def test_the_policy_says_a_labelled_pr_may_run_nightly_tests_but_stores_nothing():
    policy = resolve_policy("pull_request", ["nightly"], CATALOG, ref="refs/pull/7/merge", workflow=PR_WF)
    assert policy.cadence == "nightly"
    assert policy.outputs()["store_history"] == "false"
    nightly = resolve_policy("schedule", [], CATALOG, ref=MAIN, workflow=NIGHTLY_WF)
    assert nightly.outputs()["store_history"] == "true"


def _project(make_tree) -> Path:
    return make_tree({TEST: GATED})


def _run(root: Path, *extra: str) -> int:
    return main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream", *extra])


def _under_actions(monkeypatch, event: str, ref: str, workflow: str) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_EVENT_NAME", event)
    monkeypatch.setenv("GITHUB_REF", ref)
    monkeypatch.setenv("GITHUB_WORKFLOW_REF", workflow)


def _ran_gated(root: Path) -> bool:
    run = json.loads((root / ".miles/reports/stage-b-cpu-1of1/run.json").read_text())
    return [a["gate_verdicts"][0]["status"] for a in run["attempts"]] == ["INACTIVE"]


def test_a_pr_run_with_the_nightly_label_gates_but_never_stores_history(make_tree, monkeypatch, capsys):
    root = _project(make_tree)
    _under_actions(monkeypatch, "pull_request", "refs/pull/7/merge", PR_WF)
    assert _run(root, "--labels", "nightly") == 0
    assert _ran_gated(root)
    assert open_store(root=root).runs(test=TEST) == []
    assert "history is not stored" in capsys.readouterr().out


def test_a_nightly_label_outside_ci_does_not_store_history_either(make_tree, capsys):
    root = _project(make_tree)
    assert _run(root, "--labels", "nightly") == 0
    assert _ran_gated(root)
    assert open_store(root=root).runs(test=TEST) == []


def test_the_scheduled_nightly_run_on_main_stores_trusted_history(make_tree, monkeypatch, capsys):
    root = _project(make_tree)
    _under_actions(monkeypatch, "schedule", MAIN, NIGHTLY_WF)
    assert _run(root, "--cadence", "nightly") == 0
    (stored,) = open_store(root=root).runs(test=TEST)
    assert (stored.cadence, stored.trusted) == ("nightly", True)


def test_gate_write_by_hand_is_refused_inside_a_pr_job(make_tree, monkeypatch, capsys, tmp_path):
    root = _project(make_tree)
    records = MetricRecorder(tmp_path / "records")
    records.log(0, {"train/grad_norm": 1.0})
    _under_actions(monkeypatch, "pull_request", "refs/pull/7/merge", PR_WF)
    argv = ["gate", "--root", str(root), "--record", str(records.directory), "--test", TEST,
            "--cadence", "nightly", "--write"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --write: a pull_request run never stores history")
    assert open_store(root=root).runs(test=TEST) == []
