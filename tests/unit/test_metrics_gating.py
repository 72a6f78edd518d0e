"""Gating a finished attempt end to end, and the `gate` / `history` commands."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.registration import GateDeclaration
from miles.metrics.capture import MetricRecorder
from miles.metrics.gate import ERROR, FAIL, INACTIVE, PASS
from miles.metrics.gating import GateRun, gate_attempt
from miles.metrics.spec import gate_spec
from miles.metrics.store import MetricValue, RunEntry, open_store

register_cpu_ci(est_time=2, suite="stage-a-cpu")

TEST = "tests/e2e/test_toy.py"
GRAD = GateDeclaration(TEST, 3, "train/grad_norm")
REWARD = GateDeclaration(TEST, 4, "rollout/raw_reward")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _run(cadence="nightly", lane_enforces=True) -> GateRun:
    return GateRun(TEST, "cpu", "stage-b-cpu", "cpu", cadence, lane_enforces, commit="abcdef0123")


def _record(directory: Path, grad: float, reward: float = 0.5, steps: int = 3) -> Path:
    recorder = MetricRecorder(directory)
    for step in range(steps):
        recorder.log(step, {"train/grad_norm": grad, "rollout/raw_reward": reward})
    return directory


def _seed(url: str, values: dict[GateDeclaration, float], runs: int = 5) -> None:
    store = open_store(url)
    for i in range(runs):
        entry = RunEntry(
            TEST, "cpu", "stage-b-cpu", "cpu", "nightly", True, created_at=T0 + timedelta(minutes=i)
        )
        store.add_run(entry, [MetricValue(gate_spec(d).coordinate(-1), v) for d, v in values.items()])


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'history.sqlite'}"


def test_a_test_without_gates_is_not_gated_and_never_opens_the_store(tmp_path):
    outcome = gate_attempt(
        tmp_path, [], _run(), write_baseline=True, store_url="postgresql://x:y@127.0.0.1:1/none"
    )
    assert (outcome.verdicts, outcome.failed, outcome.trusted) == ((), False, True)


def test_a_passing_nightly_attempt_on_cold_start_is_stored_as_a_trusted_run(tmp_path, url):
    outcome = gate_attempt(_record(tmp_path / "r", 1.0), [GRAD], _run(), write_baseline=True, store_url=url)
    assert [v.status for v in outcome.verdicts] == [INACTIVE]
    assert outcome.trusted is True and outcome.baseline_run_id is not None
    (run,) = open_store(url).runs()
    assert (run.trusted, run.cadence, run.commit) == (True, "nightly", "abcdef0123")


def test_a_regular_cadence_attempt_never_writes_a_baseline(tmp_path, url):
    gate_attempt(_record(tmp_path / "r", 1.0), [GRAD], _run("regular"), write_baseline=True, store_url=url)
    assert open_store(url).runs() == []


def test_only_the_passing_attempt_writes(tmp_path, url):
    gate_attempt(_record(tmp_path / "r", 1.0), [GRAD], _run(), write_baseline=False, store_url=url)
    assert open_store(url).runs() == []


def test_a_value_inside_the_band_passes_and_one_outside_fails_an_enforced_gate(tmp_path, url):
    _seed(url, {GRAD: 1.0})
    good = gate_attempt(
        _record(tmp_path / "a", 1.2), [GRAD], _run("regular"), write_baseline=False, store_url=url
    )
    bad = gate_attempt(
        _record(tmp_path / "b", 3.0), [GRAD], _run("regular"), write_baseline=False, store_url=url
    )
    assert (good.verdicts[0].status, good.trusted, good.failed) == (PASS, True, False)
    assert (bad.verdicts[0].status, bad.trusted, bad.failed) == (FAIL, False, True)
    assert bad.message.startswith("metric gate failed: FAIL     train/grad_norm [last] (enforce): 3 is above")


def test_a_failing_gate_in_a_shadow_lane_is_reported_but_does_not_fail(tmp_path, url):
    _seed(url, {GRAD: 1.0})
    outcome = gate_attempt(
        _record(tmp_path / "r", 3.0),
        [GRAD],
        _run("regular", lane_enforces=False),
        write_baseline=False,
        store_url=url,
    )
    assert (outcome.trusted, outcome.failed) == (False, False)
    assert outcome.message.startswith("metric gate (shadow): FAIL")


def test_a_declaration_with_enforce_true_is_enforced_even_in_a_shadow_lane(tmp_path, url):
    _seed(url, {GRAD: 1.0})
    enforced = GateDeclaration(TEST, 3, "train/grad_norm", enforce=True)
    outcome = gate_attempt(
        _record(tmp_path / "r", 3.0),
        [enforced],
        _run(lane_enforces=False),
        write_baseline=False,
        store_url=url,
    )
    assert outcome.failed


def test_an_untrusted_nightly_run_is_stored_but_does_not_move_the_baseline(tmp_path, url):
    _seed(url, {GRAD: 1.0})
    outcome = gate_attempt(_record(tmp_path / "r", 50.0), [GRAD], _run(), write_baseline=True, store_url=url)
    assert outcome.trusted is False and outcome.baseline_run_id is not None
    coordinate = gate_spec(GRAD).coordinate(-1)
    assert open_store(url).baselines(TEST, "cpu", "stage-b-cpu", [coordinate], 20) == {coordinate: [1.0] * 5}


def test_a_truncated_record_is_refused_cleanly_and_nothing_is_stored(tmp_path, url):
    records = _record(tmp_path / "r", 1.0)
    (path,) = records.glob("*.jsonl")
    text = path.read_text()
    path.write_text(text[: len(text) - 7])  # a crash mid-line
    outcome = gate_attempt(records, [GRAD, REWARD], _run(), write_baseline=True, store_url=url)
    assert [v.status for v in outcome.verdicts] == [ERROR, ERROR]
    assert "metric record refused" in outcome.verdicts[0].message and "ends mid-line" in outcome.message
    assert (outcome.trusted, outcome.failed) == (False, True)
    assert open_store(url).runs() == []


def test_an_unreachable_store_in_a_shadow_lane_warns_and_passes(tmp_path):
    outcome = gate_attempt(
        _record(tmp_path / "r", 1.0),
        [GRAD],
        _run(lane_enforces=False),
        write_baseline=True,
        store_url=f"sqlite:///{_blocked(tmp_path)}",
    )
    assert not outcome.failed and outcome.trusted is None
    (warning,) = outcome.warnings
    assert warning.startswith("warning: history store unreachable: sqlite:///")


def test_an_unreachable_store_in_an_enforce_lane_fails_the_test(tmp_path):
    outcome = gate_attempt(
        _record(tmp_path / "r", 1.0),
        [GRAD],
        _run(),
        write_baseline=True,
        store_url=f"sqlite:///{_blocked(tmp_path)}",
    )
    assert outcome.failed and outcome.message.startswith("history store unreachable: ")


def _blocked(tmp_path: Path) -> Path:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    return blocker / "history.sqlite"


# -- the commands ---------------------------------------------------------------------------

GATED_TEST = """\
from miles.ci.register import register_ci_gate, register_cpu_ci
register_cpu_ci(est_time=30, suite="stage-b-cpu")
register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="rollout/raw_reward")
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / TEST).write_text(GATED_TEST)
    return tmp_path


def _cli(project: Path, url: str, *args: str) -> int:
    return main([*args, "--root", str(project), "--store", url])


def _gate_nightly(project: Path, url: str, record: Path, *extra: str) -> int:
    """Gate `record` by hand as a nightly run would, writing it to the history."""
    return _cli(
        project,
        url,
        "gate",
        "--record",
        str(record),
        "--test",
        TEST,
        "--write",
        "--cadence",
        "nightly",
        *extra,
    )


def test_gate_command_gates_a_record_by_hand(project, url, capsys):
    _seed(url, {GRAD: 1.0, REWARD: 0.5})
    _record(project / "good", 1.1)
    _record(project / "bad", 1.1, reward=0.1)
    assert _cli(project, url, "gate", "--record", str(project / "good"), "--test", TEST) == 0
    assert "PASS     rollout/raw_reward" in capsys.readouterr().out
    assert _cli(project, url, "gate", "--record", str(project / "bad"), "--test", TEST) == 1
    out, err = capsys.readouterr()
    assert "FAIL     rollout/raw_reward [last] (enforce): 0.1 is below" in out and "NOT TRUSTED" in out
    assert "error: metric gate failed" in err


def test_gate_command_writes_only_with_a_baseline_cadence(project, url, capsys):
    _record(project / "r", 1.0)
    assert _cli(project, url, "gate", "--record", str(project / "r"), "--test", TEST, "--write") == 2
    assert "only nightly or weekly runs write baselines" in capsys.readouterr().err
    assert _gate_nightly(project, url, project / "r", "--json") == 0
    assert json.loads(capsys.readouterr().out)["baseline_run_id"] == 1


def test_history_show_lists_runs_with_values_bands_and_verdicts(project, url, capsys):
    _seed(url, {GRAD: 1.0}, runs=5)
    _record(project / "r", 1.05)
    _gate_nightly(project, url, project / "r")
    capsys.readouterr()
    assert _cli(project, url, "history", "show", "--test", TEST, "--metric", "train/grad_norm") == 0
    out = capsys.readouterr().out
    assert "cpu / stage-b-cpu" in out and "[0.5, 1.5]" in out and "PASS" in out
    assert _cli(project, url, "history", "show", "--test", TEST, "--json") == 0
    rows = {(r["run"], r["metric"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[6, "train/grad_norm"]["verdict"] == "PASS" and rows[6, "train/grad_norm"]["step"] == "last"
    assert rows[6, "rollout/raw_reward"]["verdict"] == "INACTIVE"  # no history for it yet


def test_history_show_json_writes_non_finite_values_as_the_record_does(project, url, capsys):
    store = open_store(url)
    coordinates = [
        gate_spec(GateDeclaration(TEST, 3, "train/grad_norm", steps=(1, 2, 3))).coordinate(s)
        for s in (1, 2, 3)
    ]
    values = [
        MetricValue(c, v, ERROR) for c, v in zip(coordinates, (math.nan, math.inf, -math.inf), strict=True)
    ]
    store.add_run(RunEntry(TEST, "cpu", "stage-b-cpu", "cpu", "nightly", False, created_at=T0), values)
    assert _cli(project, url, "history", "show", "--test", TEST, "--json") == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["value"] for r in rows] == ["NaN", "Infinity", "-Infinity"]


def test_history_untrust_by_run_and_by_commit(project, url, capsys):
    _seed(url, {GRAD: 1.0}, runs=2)
    assert _cli(project, url, "history", "untrust", "--run", "1", "--reason", "bad node") == 0
    assert "marked 1 run(s) of run 1 untrusted" in capsys.readouterr().out
    assert _cli(project, url, "history", "untrust", "--commit", "1234567") == 1
    assert "no stored run matches commit 1234567" in capsys.readouterr().err
    assert [r.trusted for r in open_store(url).runs()] == [True, False]


def test_history_commands_report_an_unreachable_store_with_exit_1(project, tmp_path, capsys):
    url = f"sqlite:///{_blocked(tmp_path)}"
    assert _cli(project, url, "history", "show", "--test", TEST) == 1
    assert capsys.readouterr().err.startswith("error: history store unreachable: sqlite:///")
    assert _cli(project, url, "history", "untrust", "--run", "1") == 1
    assert "history store unreachable" in capsys.readouterr().err


def test_history_plot_writes_an_image(project, url, capsys):
    _seed(url, {GRAD: 1.0}, runs=5)
    _record(project / "r", 4.0)
    _gate_nightly(project, url, project / "r")
    out_png = project / "plots" / "grad.png"
    assert (
        _cli(
            project, url, "history", "plot", "--test", TEST, "--metric", "train/grad_norm", "-o", str(out_png)
        )
        == 0
    )
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000
    assert _cli(project, url, "history", "plot", "--test", TEST, "--metric", "nope", "-o", str(out_png)) == 2
    assert "no stored values of 'nope'" in capsys.readouterr().err


def test_gate_command_asks_which_registration_when_there_are_several(project, url, capsys):
    (project / TEST).write_text(
        GATED_TEST + "from miles.ci.register import register_cuda_ci\n"
        'register_cuda_ci(est_time=30, suite="stage-c-4-gpu-h200", labels=["megatron"])\n'
    )
    _record(project / "r", 1.0)
    assert _cli(project, url, "gate", "--record", str(project / "r"), "--test", TEST) == 2
    assert "choose one with --backend and --suite" in capsys.readouterr().err
