"""The runner's gate step: a real `python -m miles.ci run` over a gated test file."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.registration import GateDeclaration
from miles.metrics.spec import gate_spec
from miles.metrics.store import MetricValue, RunEntry, open_store

register_cpu_ci(est_time=5, suite="stage-a-cpu")

TEST = "tests/e2e/test_gated.py"
GATED = """
from miles.ci.register import register_ci_gate, register_cpu_ci
from miles.metrics.capture import log

register_cpu_ci(est_time=20, suite="stage-b-cpu")
register_ci_gate(metric_key="train/grad_norm")


def test_train():
    for step in range(3):
        log(step, {{"train/grad_norm": {value}}})
"""
REPORTS = ".miles/reports/stage-b-cpu-1of1"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL"):
        monkeypatch.delenv(key, raising=False)


def _project(make_tree, value: float) -> Path:
    return make_tree({TEST: GATED.format(value=value)})


def _run(root: Path, *extra: str) -> int:
    return main(["run", "--root", str(root), "--suite", "stage-b-cpu", *extra])


def _attempt(root: Path) -> dict:
    (attempt,) = json.loads((root / REPORTS / "run.json").read_text())["attempts"]
    return attempt


def _seed_baseline(root: Path, value: float) -> None:
    store = open_store(root=root)
    coordinate = gate_spec(GateDeclaration(TEST, 5, "train/grad_norm")).coordinate(-1)
    for day in range(5):
        entry = RunEntry(TEST, "cpu", "stage-b-cpu", "cpu", "nightly", True,
                         created_at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(days=day))  # fmt: skip
        store.add_run(entry, [MetricValue(coordinate, value)])


def test_a_nightly_run_gates_its_records_and_stores_the_run(make_tree, capsys):
    root = _project(make_tree, 1.0)
    assert _run(root, "--cadence", "nightly") == 0
    verdict = _attempt(root)["gate_verdicts"][0]
    assert (verdict["metric"], verdict["status"]) == ("train/grad_norm", "INACTIVE")
    assert "gate[train/grad_norm]" in (root / REPORTS / "junit.xml").read_text()
    assert "### Metric gates" in (root / REPORTS / "summary.md").read_text()
    (run,) = open_store(root=root).runs(test=TEST)
    assert (run.cadence, run.trusted, run.lane) == ("nightly", True, "cpu")


def test_a_regular_run_is_gated_but_writes_no_history(make_tree, capsys):
    root = _project(make_tree, 1.0)
    assert _run(root) == 0
    assert _attempt(root)["gate_verdicts"][0]["status"] == "INACTIVE"
    assert open_store(root=root).runs(test=TEST) == []


def test_a_regression_fails_the_test_on_the_enforce_lane(make_tree, capsys):
    root = _project(make_tree, 5.0)
    _seed_baseline(root, 1.0)
    assert _run(root) == 1
    attempt = _attempt(root)
    assert (attempt["status"], attempt["classification"]) == ("failed", "gate")
    assert attempt["message"].startswith(
        "metric gate failed: FAIL     train/grad_norm [last] (enforce): 5 is above"
    )
    assert 'type="gate"' in (root / REPORTS / "junit.xml").read_text()


def test_an_unreachable_store_fails_the_enforce_lane_with_the_reason_and_still_reports(
    make_tree, capsys, monkeypatch
):
    monkeypatch.setenv("MILES_HISTORY_URL", "postgresql://miles:pw@127.0.0.1:1/none")
    root = _project(make_tree, 1.0)
    assert _run(root, "--cadence", "nightly") == 1
    attempt = _attempt(root)
    assert attempt["status"] == "failed"
    assert attempt["message"].startswith("history store unreachable: postgresql://miles:***@127.0.0.1:1/none")
    err = capsys.readouterr().err
    assert err.count("durations not stored") == 1, err
    assert "warning: durations not stored: history store unreachable: postgresql://miles:***@" in err
