"""The runner keeps its reports whatever happens: a metric record no parser expected, a
Ctrl-C under nox while a daemon holds the output pipe, a kill without warning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=8, suite="stage-a-cpu")

REPORTS = ".miles/reports/stage-b-cpu-1of1"
GATED_WITH_A_BAD_RECORD = """
import os
from pathlib import Path
from miles.ci.register import register_ci_gate, register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-b-cpu")
register_ci_gate(metric_key="train/grad_norm")


def test_train():
    record = Path(os.environ["MILES_CI_GATE_RECORD_DIR"]) / "1-bad.jsonl"
    record.write_text('{{"metric": "train/grad_norm", "series": [[0, {value}]]}}\\n')
"""
LATER = """
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-b-cpu")


def test_later():
    pass
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL"):
        monkeypatch.delenv(key, raising=False)


@pytest.mark.parametrize(
    "value",
    ["1" + "0" * 400, "-1" + "0" * 400, "[[[[1]]]]", '"NaN "', "true", "1e999999"],
    ids=["400-digit", "negative-400-digit", "nested", "bad-string", "bool", "float-overflow"],
)
def test_a_bad_metric_record_fails_its_test_and_the_run_goes_on(make_tree, capsys, value):
    root = make_tree(
        {
            "tests/e2e/test_a_gated.py": GATED_WITH_A_BAD_RECORD.format(value=value),
            "tests/e2e/test_b_later.py": LATER,
        }
    )
    code = main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--continue-on-error", "--no-stream"])
    assert code == 1
    run = json.loads((root / REPORTS / "run.json").read_text())
    gated, later = run["attempts"]
    assert (gated["status"], gated["classification"]) == ("failed", "gate")
    assert "metric record refused" in gated["message"] or "metric gate error" in gated["message"]
    assert later["status"] == "passed"
    assert "Traceback" not in capsys.readouterr().err


NEVER = LATER.replace("est_time=2", "est_time=120")  # planned after the hanging test
HOLDS_THE_PIPE = """
import os, subprocess, sys, time
from pathlib import Path
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=60, suite="stage-b-cpu")


def test_hangs_with_a_daemon_on_stdout():
    out = Path(os.environ["MARKER_DIR"])
    (out / "pytest.pid").write_text(str(os.getpid()))
    # a daemon in its own session that inherits pytest's stdout (the runner's output pipe)
    # and ignores SIGTERM, so stopping it takes the whole grace period
    script = f"echo $$ > {out}/daemon.pid; trap '' TERM; exec sleep 600"
    subprocess.run(["setsid", "-f", "sh", "-c", script], check=True)
    while not (out / "daemon.pid").exists():
        time.sleep(0.01)
    (out / "ready").write_text("ready")
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_reports_survive_ctrl_c_under_nox_with_a_daemon_holding_stdout(make_tree, tmp_path):
    """nox answers Ctrl-C by signalling the runner and SIGKILLing it 0.5 s later."""
    root = make_tree({"tests/e2e/test_1_hang.py": HOLDS_THE_PIPE, "tests/e2e/test_2_never.py": NEVER})
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "miles.ci",
            "run",
            "--root",
            str(root),
            "--suite",
            "stage-b-cpu",
            "--grace",
            "30",
        ],
        env={**env, "MARKER_DIR": str(markers)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (markers / "ready").exists() and runner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (markers / "ready").exists(), "the test never got far enough to start its daemon"
    runner.send_signal(signal.SIGINT)
    time.sleep(0.5)
    runner.kill()
    runner.wait(timeout=30)
    try:
        reports = root / REPORTS
        ET.parse(reports / "junit.xml")  # valid XML
        run = json.loads((reports / "run.json").read_text())
        assert run["complete"] is False and run["passed"] is False
        assert [(a["file"], a["status"]) for a in run["attempts"]] == [
            ("tests/e2e/test_1_hang.py", "cancelled"),
            ("tests/e2e/test_2_never.py", "cancelled"),
        ]
        assert "The run has not finished" in (reports / "summary.md").read_text()
    finally:
        _kill_leftovers(markers)  # the runner was SIGKILLed before its sweep


def test_a_runner_killed_without_warning_leaves_reports_that_say_so(make_tree, tmp_path):
    root = make_tree({"tests/e2e/test_1_hang.py": HOLDS_THE_PIPE, "tests/e2e/test_2_never.py": NEVER})
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    runner = subprocess.Popen(
        [sys.executable, "-m", "miles.ci", "run", "--root", str(root), "--suite", "stage-b-cpu"],
        env={**env, "MARKER_DIR": str(markers)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while not (markers / "ready").exists() and runner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    runner.kill()  # no signal the runner could handle
    runner.wait(timeout=30)
    try:
        run = json.loads((root / REPORTS / "run.json").read_text())
        assert run["complete"] is False and run["exit_code"] == 1
        first, second = run["attempts"]
        assert first["message"].startswith("unfinished: the runner stopped")
        assert second["message"].startswith("not started: the runner stopped")
        ET.parse(root / REPORTS / "junit.xml")
    finally:
        _kill_leftovers(markers)


def _kill_leftovers(markers: Path) -> None:
    for name in ("daemon.pid", "pytest.pid"):
        path = markers / name
        if path.exists() and _alive(int(path.read_text())):
            os.kill(int(path.read_text()), signal.SIGKILL)
