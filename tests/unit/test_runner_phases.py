"""Where each test file's time went: the phases its processes record, each instant charged once.

A file's row adds up to its elapsed time (two ranks in the same phase count once; a phase inside
another is charged by precedence; what no process marked is `other`), the lane's summary and
console show the table, and a process without a runner records nothing and times no import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.reports.phases import COLUMNS, attribute, read_intervals

register_cpu_ci(est_time=6, suite="stage-a-cpu")

REPORTS = ".miles/reports/stage-b-cpu-1of1"
# The test's own process converts for 0.4 s; a child process it starts (a rank) rolls out for 0.6 s
# and then works 0.8 s of CPU.
TIMED = """
import subprocess
import sys
import time

from miles import phases
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=30, suite="stage-b-cpu")
RANK = (
    "from miles import phases; import time\\nwith phases.phase(phases.ROLLOUT): time.sleep(0.6)\\n"
    "while time.process_time() < 0.8: pass"  # and 0.8 s of CPU, whatever the machine's load
)


def test_timed():
    with phases.phase(phases.CHECKPOINT):
        time.sleep(0.4)
    assert subprocess.run([sys.executable, "-c", RANK]).returncode == 0
"""

CONFTEST = 'pytest_plugins = ("miles.ci.pytest_plugin",)\n'  # as the project's own tests/conftest.py


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path_factory):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MILES_DURATIONS_PATH", str(tmp_path_factory.mktemp("store") / "durations.sqlite"))


def test_each_instant_is_charged_to_one_phase_and_a_row_adds_up_to_the_elapsed_time():
    intervals = [
        ("start", -5.0, 2.0),  # from before the attempt: clipped to it
        ("checkpoint", 3.0, 4.0),
        ("start", 3.5, 3.8),  # an import inside the conversion is the import's
        ("rollout", 5.0, 9.0),
        ("rollout", 6.0, 8.0),  # the other rank, at the same time: counted once
        ("train", 8.5, 10.0),  # one rank already stepping while the other finishes its rollout
        ("teardown", 11.0, None),  # open: until the attempt ends
    ]
    seconds = attribute(intervals, 0.0, 12.0)
    expected = {"start": 2.3, "checkpoint": 0.7, "init": 0.0, "rollout": 3.5, "train": 1.5, "teardown": 1.0}
    assert seconds == pytest.approx({**expected, "other": 3.0})
    assert set(seconds) == set(COLUMNS) and sum(seconds.values()) == pytest.approx(12.0)


def test_records_the_runner_cannot_trust_are_left_out(tmp_path):
    good = {"phase": "train", "start": 1.0, "end": 2.0}
    lines = [json.dumps(good), "not json", json.dumps({"phase": "lunch", "start": 1, "end": 2}),
             '{"phase": "init", "start": NaN, "end": 2}', json.dumps({"phase": "init"}), "[1, 2]"]  # fmt: skip
    (tmp_path / "1.jsonl").write_text("\n".join(lines) + "\n")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.jsonl"
    outside.write_text(json.dumps({"phase": "rollout", "start": 0, "end": 100}) + "\n")
    (tmp_path / "2.jsonl").symlink_to(outside)  # never followed
    os.mkfifo(tmp_path / "3.jsonl")  # never opened for a blocking read
    assert read_intervals(tmp_path) == [("train", 1.0, 2.0)]
    assert read_intervals(tmp_path / "absent") == []


def test_a_lane_run_shows_where_each_file_spent_its_time(make_tree, capsys):
    root = make_tree({"tests/e2e/test_timed.py": TIMED, "tests/conftest.py": CONFTEST})
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"]) == 0
    (attempt,) = json.loads((root / REPORTS / "run.json").read_text())["attempts"]
    phases = attempt["phases"]
    assert list(phases) == list(COLUMNS), phases
    assert phases["checkpoint"] >= 0.35 and phases["rollout"] >= 0.55, phases
    # the pytest process's own start-up and teardown are recorded (the teardown of a file this
    # small can take under the table's 0.1 s rounding, so its record is what is checked)
    recorded = {
        phase
        for path in (root / REPORTS / "attempts").rglob("phases")
        for phase, _, _ in read_intervals(path)
    }
    assert {"start", "teardown"} <= recorded, recorded
    assert phases["start"] > 0, phases
    assert sum(phases.values()) == pytest.approx(attempt["elapsed"], abs=0.5), (phases, attempt["elapsed"])
    assert attempt["cpu"] >= 0.8, attempt["cpu"]  # the child's CPU counts in the file's
    summary = (root / REPORTS / "summary.md").read_text()
    assert "### Where the time went" in summary and "`tests/e2e/test_timed.py`" in summary
    console = capsys.readouterr().out
    assert "where the time went" in console and "tests/e2e/test_timed.py" in console


def test_without_a_runner_a_process_records_nothing_and_times_no_import(tmp_path):
    probe = (
        "import builtins, miles.phases as p\n"
        "with p.phase(p.TRAIN): pass\n"
        "p.started()\n"
        "print(builtins.__import__ is p._real_import)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MILES_CI_PHASE_DIR"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
    assert list(Path(tmp_path).iterdir()) == []


def test_start_up_ends_at_the_first_work_and_a_later_trainer_start_is_not_start_up(tmp_path):
    # a test process that works for 1.5 s, then calls the trainer in-process (whose main() says
    # "started"): that second mark must not charge the test's work to start-up; a child forked
    # after it ends its own start-up at its own first mark, from its fork
    probe = (
        "import os, time\n"
        "from miles import phases as p\n"
        "p.started()\n"
        "with p.phase(p.TRAIN): time.sleep(1.5)\n"
        "p.started()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(0.3); p.started(); p.flush(); os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    folder = tmp_path / "phases"
    folder.mkdir()
    env = {**os.environ, "MILES_CI_PHASE_DIR": str(folder)}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = sorted(folder.glob("*.jsonl"), key=lambda f: f.stat().st_size, reverse=True)
    assert len(files) == 2, files
    parent, child = ([json.loads(line) for line in f.read_text().splitlines()] for f in files)
    ends = [row["end"] - row["start"] for row in parent if row["phase"] == "start"]
    assert ends and max(ends) < 1.5, parent  # the second started() after 1.5 s of work wrote nothing
    (forked,) = [row for row in child if row["phase"] == "start"]
    assert 0.25 <= forked["end"] - forked["start"] < 1.5, child  # from the fork to its mark


NESTED = """
import time
from pathlib import Path
import pytest
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=30, suite="stage-b-cpu")
OUT = Path(__file__).parents[2]
INNER = "from miles.ci.register import register_cpu_ci\\nregister_cpu_ci(est_time=1, suite='stage-b-cpu')\\n" \\
    "def test_inner():\\n    assert 1\\n"


def test_runs_a_session_of_its_own():
    (OUT / "began").write_text(repr(time.time()))
    inner = OUT / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(INNER)
    # the CI plugin in the inner session too, as a pytester run of the project's own tests has it
    assert pytest.main([str(inner), "-q", "-p", "no:cacheprovider", "-p", "miles.ci.pytest_plugin"]) == 0
    (OUT / "ended").write_text(repr(time.time()))
"""


def test_a_session_a_test_runs_inside_its_own_does_not_end_the_files_start_up_or_begin_its_teardown(
    make_tree,
):
    root = make_tree({"tests/e2e/test_nested.py": NESTED, "tests/conftest.py": CONFTEST})
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"]) == 0
    began, ended = (float((root / name).read_text()) for name in ("began", "ended"))
    (folder,) = (root / REPORTS / "attempts" / "stage-b-cpu").glob("*/1/phases")
    rows = [json.loads(line) for path in folder.glob("*.jsonl") for line in path.read_text().splitlines()]
    teardown = [r for r in rows if r["phase"] == "teardown" and r["end"] is None]
    assert len(teardown) == 1 and teardown[0]["start"] >= ended, (teardown, ended)
    long_starts = [r for r in rows if r["phase"] == "start" and r["end"] - r["start"] > 0.5]
    assert all(r["end"] <= began for r in long_starts), (
        long_starts,
        began,
    )  # the inner collection is not start-up
