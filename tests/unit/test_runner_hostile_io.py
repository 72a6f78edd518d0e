"""What a test (or a careless user) leaves where the runner reads and writes.

The runner reads test-produced data only from regular files and in bounded amounts, writes
only in the files and attempts/ folder it made for the run (exclusively, never through a
planted link), never deletes what it did not make, and ends within its grace period on
SIGTERM with every report written. Each case runs `python -m miles.ci run` as a user does,
in-process through `main`, or as a subprocess where a hang or a signal is involved.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.metrics.store import open_store

REPORTS = ".miles/reports/stage-b-cpu-1of1"
PASSES = """
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time={est}, suite="stage-b-cpu")
def test_ok():
    pass
"""
GATED = """
import os
from pathlib import Path
from miles.ci.register import register_ci_gate, register_cpu_ci
from miles.metrics.capture import MetricRecorder
register_cpu_ci(est_time=1, suite="stage-b-cpu")
register_ci_gate(metric_key="train/grad_norm")
def test_train():
    folder = Path(os.environ["MILES_CI_GATE_RECORD_DIR"])
    MetricRecorder(folder).log(0, {{"train/grad_norm": 1.0}})
    {plant}
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL",
                "MILES_HISTORY_TIMEOUT"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}


def _run(root: Path, *extra: str) -> int:
    return main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream", *extra])


def _run_json(root: Path, reports: str = REPORTS) -> dict:
    return json.loads((root / reports / "run.json").read_text())


# -- reads of what the test left --------------------------------------------------------------


@pytest.mark.parametrize(
    "plant",
    [
        'os.mkfifo(folder / "2-fifo.jsonl")',
        'os.symlink("/dev/zero", folder / "2-zero.jsonl")',
    ],
    ids=["fifo", "dev-zero"],
)
def test_a_record_folder_trap_fails_the_gate_and_the_run_ends(make_tree, tmp_path, plant):
    """The issue's cases: a FIFO blocked the runner forever; /dev/zero was read until memory ran out."""
    root = make_tree({"tests/e2e/test_gated.py": GATED.format(plant=plant)})
    env = {**_env(), "MILES_HISTORY_URL": f"sqlite:///{tmp_path / 'h.sqlite'}"}
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"],
        env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    (attempt,) = _run_json(root)["attempts"]
    assert (attempt["status"], attempt["classification"]) == ("failed", "gate")  # the cpu lane enforces
    verdict = attempt["gate_verdicts"][0]
    expected = (
        "2-fifo.jsonl is a FIFO, not a regular file" if "fifo" in plant else "2-zero.jsonl is a symlink"
    )
    assert verdict["status"] == "ERROR" and expected in verdict["message"], verdict
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_junit_file_that_is_a_trap_is_an_error_not_a_hang(make_tree, kind):
    plant = {
        "fifo": "os.unlink(p) if os.path.exists(p) else None; os.mkfifo(p)",
        "dev-zero": "os.unlink(p) if os.path.exists(p) else None; os.symlink('/dev/zero', p)",
    }[kind]
    conftest = f"""
import os
def pytest_unconfigure(config):
    p = config.option.xmlpath
    {plant}
"""
    root = make_tree({"tests/e2e/test_j.py": PASSES.format(est=1), "tests/e2e/conftest.py": conftest})
    assert _run(root) == 1
    (attempt,) = _run_json(root)["attempts"]
    expected = (
        "is a FIFO, not a regular file" if kind == "fifo" else "is a symlink; only a regular file is read"
    )
    assert attempt["status"] == "error" and expected in attempt["message"], attempt["message"]


def test_the_tail_of_one_huge_line_stays_bounded(tmp_path):
    """Output is read in chunks, never as lines: one 200 MB line passes through in pieces of at
    most PUMP_CHUNK bytes and the tail never holds more than twice TAIL_BYTES."""
    from miles.ci.running.execute import PUMP_CHUNK, TAIL_BYTES, Tail, _pump

    size = 200 << 20
    writer = subprocess.Popen(
        [sys.executable, "-c", f"import sys; [sys.stdout.buffer.write(b'x' * (1 << 20)) for _ in range({size >> 20})]"],
        stdout=subprocess.PIPE,
    )  # fmt: skip

    class Log:
        largest = total = 0

        def write(self, chunk: bytes) -> None:
            self.largest = max(self.largest, len(chunk))
            self.total += len(chunk)

        def flush(self) -> None:
            pass

    class WatchedTail(Tail):
        peak = 0

        def add(self, chunk: bytes) -> None:
            super().add(chunk)
            self.peak = max(self.peak, len(self._buf))

    log, tail = Log(), WatchedTail()
    _pump(writer.stdout, log, tail, None)
    writer.wait()
    assert log.total == size and log.largest <= PUMP_CHUNK
    assert tail.peak <= 2 * TAIL_BYTES and tail.text() == "x" * 12_000


# -- writes: only the run's own files and folders ----------------------------------------------

PLANTS_LINKS = """
import os
from pathlib import Path
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=1, suite="stage-b-cpu")
def test_plant():
    reports = Path(os.environ["MILES_CI_GATE_RECORD_DIR"]).parents[4]
    victims = Path(os.environ["VICTIMS"])
    for name in ("junit.xml", "summary.md", "run.json"):
        for planted in (name, f".{name}.tmp"):
            target = victims / planted.strip(".")
            target.write_text("keep me")
            path = reports / planted
            if path.exists() or path.is_symlink():
                path.unlink()
            path.symlink_to(target)
"""


def test_links_planted_in_the_report_folder_are_replaced_never_written_through(
    make_tree, tmp_path, monkeypatch
):
    root = make_tree({"tests/e2e/test_plant.py": PLANTS_LINKS, "tests/e2e/test_z.py": PASSES.format(est=2)})
    victims = tmp_path / "victims"
    victims.mkdir()
    monkeypatch.setenv("VICTIMS", str(victims))
    assert _run(root) == 0
    assert {p.name: p.read_text() for p in victims.iterdir()} == {
        name: "keep me" for name in ("junit.xml", "summary.md", "run.json", "junit.xml.tmp", "summary.md.tmp",
                                     "run.json.tmp")
    }  # fmt: skip
    reports = root / REPORTS
    assert not (reports / "run.json").is_symlink() and _run_json(root)["passed"] is True
    ET.parse(reports / "junit.xml")


SWAPS_THE_NEXT_FOLDER = """
import atexit, os
from pathlib import Path
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=1, suite="stage-b-cpu")


def _swap():  # as pytest exits: the suite's folder becomes a link to somewhere else
    suite_dir = Path(os.environ["MILES_CI_GATE_RECORD_DIR"]).parents[2]
    os.rename(suite_dir, str(suite_dir) + ".moved")
    os.symlink(os.environ["VICTIMS"], suite_dir)


def test_swap():
    atexit.register(_swap)
"""


def test_a_swapped_attempts_folder_fails_the_next_attempt_and_is_not_followed(
    make_tree, tmp_path, monkeypatch
):
    root = make_tree(
        {"tests/e2e/test_a.py": SWAPS_THE_NEXT_FOLDER, "tests/e2e/test_b.py": PASSES.format(est=2)}
    )
    victims = tmp_path / "victims"
    victims.mkdir()
    monkeypatch.setenv("VICTIMS", str(victims))
    assert _run(root, "--continue-on-error") == 1
    _, second = _run_json(root)["attempts"]  # the first finds its own JUnit file gone: its doing
    assert (second["status"], second["classification"]) == ("failed", "report-folder")
    assert "is a link or a file, not a folder this run made" in second["message"]
    assert list(victims.iterdir()) == []


def test_a_report_dir_holding_someone_elses_attempts_is_refused_and_kept(make_tree, capsys):
    """The issue's case: --report-dir D deleted a D/attempts/ tree the user already had."""
    root = make_tree(
        {"tests/e2e/test_ok.py": PASSES.format(est=1), "mine/attempts/notes.txt": "my own notes"}
    )
    assert _run(root, "--report-dir", str(root / "mine")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --report-dir") and "already holds attempts" in line, line
    assert (root / "mine" / "attempts" / "notes.txt").read_text() == "my own notes"


def test_a_report_dir_holding_a_foreign_report_file_is_refused(make_tree, capsys):
    root = make_tree({"tests/e2e/test_ok.py": PASSES.format(est=1), "mine/run.json": "{}"})
    assert _run(root, "--report-dir", str(root / "mine")) == 2
    assert "already holds run.json" in capsys.readouterr().err
    assert (root / "mine" / "run.json").read_text() == "{}"


def test_a_rerun_replaces_the_attempts_its_own_earlier_run_made(make_tree):
    root = make_tree({"tests/e2e/test_ok.py": PASSES.format(est=1)})
    assert _run(root) == 0
    first = _run_json(root)["attempts"][0]["record_dir"]
    (Path(first) / "left-by-run-1").write_text("x")
    assert _run(root) == 0
    assert not (Path(first) / "left-by-run-1").exists() and Path(first).is_dir()


def test_an_attempts_folder_swapped_after_the_run_is_not_deleted_by_the_next(make_tree, tmp_path):
    root = make_tree({"tests/e2e/test_ok.py": PASSES.format(est=1)})
    assert _run(root) == 0
    reports = root / REPORTS
    (reports / "attempts").rename(tmp_path / "old-attempts")
    (reports / "attempts").mkdir()
    (reports / "attempts" / "someone.txt").write_text("not the runner's")
    assert _run(root) == 2
    assert (reports / "attempts" / "someone.txt").read_text() == "not the runner's"
    assert json.loads((reports / ".miles-reports.json").read_text())["attempts"]


def test_a_test_path_longer_than_a_folder_name_runs_with_the_rest(make_tree):
    """The issue's case: a flattened attempt folder name over 255 bytes crashed the runner."""
    deep = "/".join(["d" * 100] * 4)
    root = make_tree(
        {f"tests/e2e/{deep}/test_long.py": PASSES.format(est=1), "tests/e2e/test_z.py": PASSES.format(est=2)}
    )
    assert _run(root) == 0
    attempts = _run_json(root)["attempts"]
    assert [a["status"] for a in attempts] == ["passed", "passed"]
    for a in attempts:
        assert all(len(part.encode()) <= 255 for part in Path(a["record_dir"]).parts)


def test_calibrate_write_never_follows_a_planted_temp_link(make_tree, tmp_path):
    """The issue's case: `calibrate --write` wrote the test file's new content into any file."""
    from datetime import UTC, datetime

    from miles.metrics.store import DurationRecord

    root = make_tree({"tests/e2e/test_slow.py": PASSES.format(est=5)})
    path = root / "tests/e2e/test_slow.py"
    past = time.time() - 60
    os.utime(path, (past, past))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (path.parent / ".test_slow.py.calibrate.tmp").symlink_to(victim)
    store = open_store(f"sqlite:///{root / '.miles' / 'history.sqlite'}")
    store.add_durations(
        [DurationRecord("tests/e2e/test_slow.py", "cpu", "stage-b-cpu", 100.0, "passed",
                        created_at=datetime.now(UTC)) for _ in range(3)]
    )  # fmt: skip
    assert main(["calibrate", "--root", str(root), "--write"]) == 0
    assert victim.read_text() == "keep me"
    assert "est_time=105" in path.read_text() and not path.is_symlink()


# -- SIGTERM ends the runner within its grace period ------------------------------------------


def test_sigterm_during_a_stuck_gate_ends_the_runner_with_reports_written(make_tree, tmp_path):
    """The gate step waits on a store another process holds (and may wait 600 s): SIGTERM must
    still end the run within the grace period, with the reports final and complete."""
    root = make_tree({"tests/e2e/test_gated.py": GATED.format(plant="pass")})
    store = tmp_path / "h.sqlite"
    open_store(f"sqlite:///{store}")
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")  # readers and writers both wait for it
    env = {**_env(), "MILES_HISTORY_URL": f"sqlite:///{store}", "MILES_HISTORY_TIMEOUT": "600"}
    log = tmp_path / "runner.log"
    try:
        with open(log, "wb") as out:
            runner = subprocess.Popen(
                [sys.executable, "-m", "miles.ci", "run", "--root", str(root), "--suite", "stage-b-cpu",
                 "--no-stream", "--grace", "2"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
            deadline = time.monotonic() + 120
            while not _holds(runner.pid, store) and runner.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)  # the test passed and the gate step has opened the store
            assert _holds(runner.pid, store), log.read_text()
            time.sleep(0.3)
            runner.send_signal(signal.SIGTERM)
            code = runner.wait(timeout=60)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert code == 1, log.read_text()
    run = _run_json(root)
    assert run["complete"] is True and run["cancelled_by"] == "SIGTERM"
    (attempt,) = run["attempts"]
    assert attempt["status"] == "cancelled" and "metric gate had not finished" in attempt["message"], attempt
    ET.parse(root / REPORTS / "junit.xml")


def _holds(pid: int, path: Path) -> bool:
    """Whether process `pid` has `path` open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                return True
        except OSError:
            continue
    return False


def test_a_locked_postgres_store_fails_an_enforced_gate_in_bounded_time(make_tree, tmp_path):
    """The issue's case for the runner: a table lock made its gate step wait forever."""
    import uuid

    psycopg = pytest.importorskip("psycopg")
    base = os.environ.get("MILES_TEST_POSTGRES_URL", "")
    if not base:
        if os.environ.get("MILES_REQUIRE_POSTGRES") == "1":
            pytest.fail("MILES_REQUIRE_POSTGRES=1 but MILES_TEST_POSTGRES_URL is not set")
        pytest.skip("needs a PostgreSQL server: set MILES_TEST_POSTGRES_URL")
    schema = f"miles_run_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    url = f"{base}{'&' if '?' in base else '?'}options=-csearch_path%3D{schema}"
    open_store(url)
    holder = psycopg.connect(url, connect_timeout=5)
    holder.execute("LOCK TABLE runs, metric_values IN ACCESS EXCLUSIVE MODE")
    gated = GATED.format(plant="pass").replace(
        'metric_key="train/grad_norm"', 'metric_key="train/grad_norm", enforce=True'
    )
    root = make_tree({"tests/e2e/test_gated.py": gated})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "miles.ci", "run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"],
            env={**_env(), "MILES_HISTORY_URL": url, "MILES_HISTORY_TIMEOUT": "2"},
            capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
    finally:
        holder.rollback()
        holder.close()
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")
    assert done.returncode == 1, done.stdout + done.stderr
    (attempt,) = _run_json(root)["attempts"]
    assert (attempt["status"], attempt["classification"]) == ("failed", "gate")
    assert "no answer within 2 s" in attempt["message"], attempt["message"]
