"""The metric side under hostile input: what a test leaves in its record folder is read only from
regular files and in bounded amounts, every store query has a time limit, a row another program
wrote is refused in one line, and a metric key no store can hold is refused at registration.

Every command is the one a user types (`python -m miles.ci history show | gate`), in-process
through its `main`, or as a subprocess where a hang would otherwise stop the test run. The
PostgreSQL cases need a server (MILES_TEST_POSTGRES_URL, as in the store contract tests).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import parse_test_file
from miles.metrics.capture import MetricRecorder
from miles.metrics.records import RecordError, merge_records
from miles.metrics.spec import Coordinate
from miles.metrics.store import MetricValue, RunEntry, mask_url, open_store

register_cpu_ci(est_time=3, suite="stage-a-cpu")

TEST = "tests/e2e/test_toy.py"
GATED_TEST = """\
from miles.ci.register import register_ci_gate, register_cpu_ci
register_cpu_ci(est_time=30, suite="stage-b-cpu")
register_ci_gate(metric_key="train/grad_norm", enforce=True)
"""
LAST = Coordinate("train/grad_norm", "last", "{}", -1)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    (tmp_path / TEST).write_text(GATED_TEST)
    return tmp_path


@pytest.fixture(autouse=True)
def _no_ci_env(monkeypatch):
    for key in (
        "GITHUB_ACTIONS",
        "GITHUB_REF",
        "GITHUB_EVENT_NAME",
        "MILES_HISTORY_URL",
        "MILES_HISTORY_TIMEOUT",
    ):
        monkeypatch.delenv(key, raising=False)


def _one_error_line(capsys, code: int, argv: list[str]) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def _good_record(directory: Path) -> Path:
    recorder = MetricRecorder(directory)
    for step in range(3):
        recorder.log(step, {"train/grad_norm": 1.0})
    return directory


# -- the record folder ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero", "link to a regular file", "folder"])
def test_a_record_that_is_not_a_regular_file_is_refused_without_reading_it(tmp_path, kind):
    folder = _good_record(tmp_path / "records")
    bad = folder / "9-evil.jsonl"
    if kind == "fifo":
        os.mkfifo(bad)  # a blocking open or read of it would wait forever: no writer ever comes
    elif kind == "link to /dev/zero":
        bad.symlink_to("/dev/zero")  # read whole, it fills memory
    elif kind == "link to a regular file":
        target = tmp_path / "elsewhere.jsonl"
        target.write_text('{"metric": "train/grad_norm", "series": [[0, 5.0]]}\n')
        bad.symlink_to(target)
    else:
        bad.mkdir()
    with pytest.raises(RecordError, match="9-evil.jsonl") as info:
        merge_records(folder)
    assert "\n" not in str(info.value)


def test_the_gate_command_ends_on_a_fifo_in_the_record_folder(project, tmp_path):
    """The issue's case, as a user runs it: before, the open of the FIFO blocked forever."""
    folder = _good_record(tmp_path / "records")
    os.mkfifo(folder / "0-fifo.jsonl")
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "gate", "--root", str(project), "--test", TEST,
         "--record", str(folder), "--store", f"sqlite:///{tmp_path / 'h.sqlite'}"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "0-fifo.jsonl is a FIFO, not a regular file" in done.stdout + done.stderr


def test_a_record_over_the_size_limit_is_refused_unread(tmp_path):
    folder = _good_record(tmp_path / "records")
    with open(folder / "1-huge.jsonl", "wb") as fh:
        fh.truncate(40 << 20)  # sparse: 40 MiB that take no disk
    with pytest.raises(RecordError, match="over the 33554432-byte limit"):
        merge_records(folder)


def test_a_record_folder_with_too_many_files_is_refused(tmp_path):
    from miles.metrics.records import MAX_RECORD_FILES

    folder = tmp_path / "records"
    folder.mkdir()
    for i in range(MAX_RECORD_FILES + 1):
        (folder / f"{i}-x.jsonl").write_text("")
    with pytest.raises(RecordError, match=f"more than {MAX_RECORD_FILES} record files"):
        merge_records(folder)


# -- metric keys at registration -------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "rule"),
    [
        ("train/\\ud800grad", "lone surrogates"),
        ("train/grad\\nnorm", "control characters"),
        ("train/grad\\x1b[31m", "control characters"),
        (" train/grad_norm", "surrounding spaces"),
        ("x" * 201, "longer than 200"),
    ],
)
def test_a_metric_key_no_store_can_hold_is_refused_at_registration(tmp_path, key, rule):
    path = tmp_path / "test_keys.py"
    path.write_text(
        "from miles.ci.register import register_ci_gate, register_cpu_ci\n"
        'register_cpu_ci(est_time=30, suite="stage-b-cpu")\n'
        f'register_ci_gate(metric_key="{key}")\n'
    )
    test_file, problems = parse_test_file(path, "tests/e2e/test_keys.py", load_catalog())
    assert test_file.gates == ()
    (problem,) = problems
    assert problem.line == 3 and rule in problem.message and "\n" not in str(problem), problem


def test_a_surrogate_key_never_reaches_a_store(project, tmp_path, capsys):
    (project / TEST).write_text(GATED_TEST.replace("train/grad_norm", "train/\\udc80"))
    folder = _good_record(tmp_path / "records")
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    line = _one_error_line(
        capsys, 2, ["gate", "--root", str(project), "--test", TEST, "--record", str(folder), "--store", url]
    )
    assert "lone surrogates" in line, line


# -- rows another program wrote ---------------------------------------------------------------


def _seeded(tmp_path: Path) -> tuple[str, Path]:
    path = tmp_path / "h.sqlite"
    store = open_store(f"sqlite:///{path}")
    entry = RunEntry(
        TEST, "cpu", "stage-b-cpu", "cpu", "nightly", True, created_at=datetime(2026, 1, 1, tzinfo=UTC)
    )
    store.add_run(entry, [MetricValue(LAST, 1.0)])
    return f"sqlite:///{path}", path


def _raw(path: Path, sql: str, params=()) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute(sql, params)


FOREIGN_RUNS = {
    "created_at is not a time": ("UPDATE runs SET created_at = 'yesterday'", "created_at = 'yesterday'"),
    "created_at has no zone": ("UPDATE runs SET created_at = '2026-01-01T00:00:00'", "with its time zone"),
    "trusted is text": ("UPDATE runs SET trusted = 'yes'", "trusted = 'yes'"),
    "value is text": ("UPDATE metric_values SET value = 'abc'", "value = 'abc'"),
    "step is text": ("UPDATE metric_values SET step = 'last'", "step = 'last'"),
    "nonfinite is made up": (
        "UPDATE metric_values SET value = NULL, nonfinite = 'Nope'",
        "nonfinite = 'Nope'",
    ),
    "metric is a blob": ("UPDATE metric_values SET metric = x'00ff'", "metric"),
}


@pytest.mark.parametrize("case", list(FOREIGN_RUNS))
def test_history_show_refuses_a_foreign_row_in_one_line(project, tmp_path, capsys, case):
    sql, expected = FOREIGN_RUNS[case]
    url, path = _seeded(tmp_path)
    _raw(path, sql)
    line = _one_error_line(
        capsys, 1, ["history", "show", "--root", str(project), "--test", TEST, "--store", url]
    )
    assert expected in line and "miles did not write that row" in line, line


def test_a_foreign_baseline_value_fails_the_gate_in_one_line(project, tmp_path, capsys):
    url, path = _seeded(tmp_path)
    _raw(path, "UPDATE metric_values SET value = 'abc'")
    folder = _good_record(tmp_path / "records")
    assert (
        main(["gate", "--root", str(project), "--test", TEST, "--record", str(folder), "--store", url]) == 1
    )
    captured = capsys.readouterr()
    assert "metric_values row" in captured.err and "value = 'abc'" in captured.err


def test_text_stored_as_bad_utf8_reads_back_replaced_not_as_a_crash(project, tmp_path, capsys):
    url, path = _seeded(tmp_path)
    _raw(path, "UPDATE runs SET untrusted_reason = CAST(x'ff41' AS TEXT), trusted = 0")
    assert main(["history", "show", "--root", str(project), "--test", TEST, "--store", url]) == 0
    assert "untrusted: \ufffdA" in capsys.readouterr().out


def test_a_control_character_in_a_stored_reason_is_printed_escaped(project, tmp_path, capsys):
    url, path = _seeded(tmp_path)
    _raw(path, "UPDATE runs SET trusted = 0, untrusted_reason = ?", ("bad\n::error::forged",))
    assert main(["history", "show", "--root", str(project), "--test", TEST, "--store", url]) == 0
    out = capsys.readouterr().out
    assert "bad\\x0a::error::forged" in out and not any(line.startswith("::") for line in out.splitlines())


# -- time limits ----------------------------------------------------------------------------


def test_a_sqlite_store_another_process_holds_fails_within_the_store_timeout(
    project, tmp_path, monkeypatch, capsys
):
    url, path = _seeded(tmp_path)
    monkeypatch.setenv("MILES_HISTORY_TIMEOUT", "1")
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")  # the write lock, held
    try:
        line = _one_error_line(
            capsys, 1, ["history", "untrust", "--root", str(project), "--store", url, "--run", "1"]
        )
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert "database is locked" in line and "no answer within 1 s" in line, line


def test_a_store_timeout_that_is_not_a_number_is_one_line(project, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MILES_HISTORY_TIMEOUT", "soon")
    line = _one_error_line(
        capsys,
        2,  # bad input, like a malformed store URL
        ["history", "show", "--root", str(project), "--test", TEST, "--store", f"sqlite:///{tmp_path}/h.db"],
    )
    assert "MILES_HISTORY_TIMEOUT='soon' must be a number of seconds" in line


def _postgres_schema_url() -> tuple[str, str]:
    import psycopg

    base = os.environ.get("MILES_TEST_POSTGRES_URL", "")
    if not base:
        if os.environ.get("MILES_REQUIRE_POSTGRES") == "1":
            pytest.fail("MILES_REQUIRE_POSTGRES=1 but MILES_TEST_POSTGRES_URL is not set")
        pytest.skip("needs a PostgreSQL server: set MILES_TEST_POSTGRES_URL")
    schema = f"miles_lock_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        if os.environ.get("MILES_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL at {mask_url(base)} is unreachable: {exc}")
        pytest.skip(f"PostgreSQL at {mask_url(base)} is unreachable")
    return f"{base}{'&' if '?' in base else '?'}options=-csearch_path%3D{schema}", schema


@pytest.fixture
def locked_postgres():
    """A PostgreSQL store whose runs and metric_values tables another session holds locked."""
    import psycopg

    url, schema = _postgres_schema_url()
    store = open_store(url)
    store.add_run(RunEntry(TEST, "cpu", "stage-b-cpu", "cpu", "nightly", True), [MetricValue(LAST, 1.0)])
    holder = psycopg.connect(url, connect_timeout=5)
    holder.execute("LOCK TABLE runs, metric_values IN ACCESS EXCLUSIVE MODE")  # held until rollback
    try:
        yield url
    finally:
        holder.rollback()
        holder.close()
        with psycopg.connect(url.split("?")[0], autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.mark.parametrize("command", ["history show", "gate"])
def test_a_locked_postgres_table_fails_the_command_within_the_store_timeout(
    project, tmp_path, locked_postgres, command
):
    """The issue's case: before, only the connect had a timeout, and the command waited forever.
    The store's URL carries its own options (a search_path): the timeouts are set without
    replacing them, or the command would look for the tables elsewhere and not meet the lock."""
    folder = _good_record(tmp_path / "records")
    extra = ["--record", str(folder)] if command == "gate" else []
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", *command.split(), "--root", str(project), "--test", TEST,
         "--store", locked_postgres, *extra],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "MILES_HISTORY_TIMEOUT": "2"},
    )  # fmt: skip
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "no answer within 2 s" in done.stderr and "lock" in done.stderr, done.stderr
    assert mask_url(locked_postgres) in done.stderr and "canceling statement" in done.stderr


def test_a_limit_past_what_a_store_can_hold_is_bad_usage(project, tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'h.sqlite'}"
    argv = ["history", "show", "--root", str(project), "--test", TEST, "--store", url, "--limit", "9" * 20]
    line = _one_error_line(capsys, 2, argv)
    assert "must be at least 1 and at most 1000000" in line, line
