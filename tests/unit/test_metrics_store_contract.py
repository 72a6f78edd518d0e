"""The history-store contract, run against SQLite and PostgreSQL alike.

The PostgreSQL half needs a server: MILES_TEST_POSTGRES_URL (set by .ci/run) names one, and
each test works in a schema of its own. Without it those tests skip with the reason, except
under MILES_REQUIRE_POSTGRES=1 (CI), where a missing server is a failure.
"""

from __future__ import annotations

import math
import os
import socket
import sqlite3
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.metrics.spec import Coordinate
from miles.metrics.store import (
    DurationRecord,
    MetricValue,
    RunEntry,
    StoreError,
    StoreUnreachable,
    mask_url,
    open_store,
)
from miles.metrics.store_sql import SCHEMA_VERSION

register_cpu_ci(est_time=5, suite="stage-a-cpu")

POSTGRES_URL_ENV = "MILES_TEST_POSTGRES_URL"
REQUIRE_POSTGRES_ENV = "MILES_REQUIRE_POSTGRES"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
C = Coordinate("train/grad_norm", "last", "{}", -1)


def _postgres_or_skip() -> str:
    url = os.environ.get(POSTGRES_URL_ENV, "")
    required = os.environ.get(REQUIRE_POSTGRES_ENV) == "1"
    if not url:
        reason = f"PostgreSQL half of the store contract: set {POSTGRES_URL_ENV}=postgresql://user:pw@host/db"
        if required:
            pytest.fail(f"{REQUIRE_POSTGRES_ENV}=1 but {POSTGRES_URL_ENV} is not set; {reason}")
        pytest.skip(reason)
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'history.sqlite'}"
        return
    import psycopg

    base = _postgres_or_skip()
    schema = f"miles_test_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as exc:
        message = f"PostgreSQL at {mask_url(base)} is unreachable: {' '.join(str(exc).split())}"
        if os.environ.get(REQUIRE_POSTGRES_ENV) == "1":
            pytest.fail(message)
        pytest.skip(message)
    yield f"{base}{'&' if '?' in base else '?'}options=-csearch_path%3D{schema}"
    with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def _raw(url: str, sql: str) -> None:
    """Run SQL on the store's database directly, behind the store's back."""
    if url.startswith("sqlite:///"):
        with sqlite3.connect(url.removeprefix("sqlite:///")) as conn:
            conn.execute(sql)
        return
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql)


def _run(test="tests/e2e/test_a.py", backend="cpu", suite="stage-b-cpu", *, minutes=0, trusted=True, **kw):
    return RunEntry(
        test, backend, suite, "cpu", "nightly", trusted, created_at=T0 + timedelta(minutes=minutes), **kw
    )


def _add(store, value: float, *, coordinate: Coordinate = C, **kw) -> int:
    return store.add_run(_run(**kw), [MetricValue(coordinate, value, "PASS")])


def test_a_new_store_creates_its_schema_at_the_current_version(store_url):
    assert open_store(store_url).schema_version() == SCHEMA_VERSION


def test_reopening_a_store_keeps_its_data_and_does_not_migrate_again(store_url):
    run_id = _add(open_store(store_url), 1.0)
    again = open_store(store_url)
    assert [r.id for r in again.runs()] == [run_id] and again.schema_version() == SCHEMA_VERSION


def test_a_store_written_by_a_newer_miles_is_refused(store_url):
    open_store(store_url)
    _raw(store_url, "UPDATE miles_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(
        StoreError, match=f"schema version 99, newer than this miles understands \\({SCHEMA_VERSION}\\)"
    ):
        open_store(store_url)


def test_a_run_and_its_values_round_trip(store_url):
    store = open_store(store_url)
    nan_at = Coordinate("train/ppo_kl", "all", '{"rel_up":0.5}', 3)
    entry = _run(minutes=5, commit="0123abcd", pr="42", ci_run_id="777")
    run_id = store.add_run(
        entry, [MetricValue(C, 1.5, "PASS", 1.4, 1.0, 2.0), MetricValue(nan_at, math.nan, "ERROR")]
    )
    (run,) = store.runs(test="tests/e2e/test_a.py")
    assert (run.id, run.uid, run.commit, run.pr, run.ci_run_id, run.cadence, run.lane) == (
        run_id, entry.uid, "0123abcd", "42", "777", "nightly", "cpu",
    )  # fmt: skip
    assert run.created_at == T0 + timedelta(minutes=5) and run.trusted is True
    values = store.values([run_id])[run_id]
    assert values[0] == MetricValue(C, 1.5, "PASS", 1.4, 1.0, 2.0)
    assert values[1].coordinate == nan_at and math.isnan(values[1].value) and values[1].verdict == "ERROR"


def test_baselines_are_the_newest_k_trusted_values_per_coordinate(store_url):
    store = open_store(store_url)
    other = Coordinate("train/grad_norm", "all", "{}", 4)
    for minute in range(6):
        store.add_run(
            _run(minutes=minute), [MetricValue(C, float(minute)), MetricValue(other, 10.0 + minute)]
        )
    history = store.baselines("tests/e2e/test_a.py", "cpu", "stage-b-cpu", [C, other], k=3)
    assert history == {C: [5.0, 4.0, 3.0], other: [15.0, 14.0, 13.0]}


def test_histories_of_different_backends_suites_and_tests_never_mix(store_url):
    store = open_store(store_url)
    _add(store, 1.0)
    _add(store, 2.0, backend="rocm", suite="nightly-stage-c-4-gpu-mi350")
    _add(store, 3.0, backend="cuda", suite="stage-c-4-gpu-h200")
    _add(store, 4.0, test="tests/e2e/test_b.py")
    _add(store, 5.0, suite="stage-a-cpu")
    assert store.baselines("tests/e2e/test_a.py", "cpu", "stage-b-cpu", [C], k=20) == {C: [1.0]}
    assert store.baselines("tests/e2e/test_a.py", "rocm", "nightly-stage-c-4-gpu-mi350", [C], k=20) == {
        C: [2.0]
    }


def test_an_untrusted_run_never_moves_a_baseline(store_url):
    store = open_store(store_url)
    for minute in range(5):
        _add(store, 1.0, minutes=minute)
    before = store.baselines("tests/e2e/test_a.py", "cpu", "stage-b-cpu", [C], k=20)
    _add(store, 1000.0, minutes=10, trusted=False)
    assert store.baselines("tests/e2e/test_a.py", "cpu", "stage-b-cpu", [C], k=20) == before


def test_a_run_marked_untrusted_leaves_the_baseline(store_url):
    store = open_store(store_url)
    _add(store, 1.0, minutes=1)
    bad = _add(store, 50.0, minutes=2)
    assert store.mark_untrusted(run_id=bad, reason="bad node") == 1
    assert store.baselines("tests/e2e/test_a.py", "cpu", "stage-b-cpu", [C], k=20) == {C: [1.0]}
    (run,) = [r for r in store.runs() if r.id == bad]
    assert (run.trusted, run.untrusted_reason) == (False, "bad node")


def test_every_run_of_a_commit_can_be_untrusted_by_prefix(store_url):
    store = open_store(store_url)
    _add(store, 1.0, minutes=1, commit="aaaaaaa111")
    _add(store, 2.0, minutes=2, commit="BBBBBBB222", backend="rocm", suite="nightly-stage-c-4-gpu-mi350")
    _add(store, 3.0, minutes=3, commit="bbbbbbb222")
    assert store.mark_untrusted(commit="bbbbbbb", reason="reverted") == 2
    assert [r.trusted for r in store.runs()] == [False, False, True]


@pytest.mark.parametrize("commit", ["abc", "not-a-sha", "%%%%%%%"])
def test_untrusting_by_commit_needs_seven_hex_digits(store_url, commit):
    with pytest.raises(StoreError, match="give at least 7 hex digits"):
        open_store(store_url).mark_untrusted(commit=commit, reason="x")


def test_a_retried_write_of_the_same_run_lands_once(store_url):
    store = open_store(store_url)
    entry = _run()
    first = store.add_run(entry, [MetricValue(C, 1.0)])
    assert store.add_run(entry, [MetricValue(C, 1.0)]) == first
    assert len(store.runs()) == 1 and len(store.values([first])[first]) == 1


def test_durations_round_trip_newest_first_per_file(store_url):
    store = open_store(store_url)
    store.add_durations(
        [DurationRecord("tests/e2e/test_a.py", "cpu", "stage-b-cpu", float(s), "passed", "cpu", 60.0,
                        created_at=T0 + timedelta(minutes=s)) for s in range(5)]
        + [DurationRecord("tests/e2e/test_a.py", "rocm", "stage-c-4-gpu-mi350", 99.0, "passed")]
    )  # fmt: skip
    found = store.durations("cpu", per_file=3)
    assert [d.elapsed_s for d in found] == [4.0, 3.0, 2.0]
    assert found[0].est_time == 60.0 and found[0].created_at == T0 + timedelta(minutes=4)
    assert [d.elapsed_s for d in store.durations("rocm", "stage-c-4-gpu-mi350")] == [99.0]


_WRITER = """
import sys, time
from miles.metrics.spec import Coordinate
from miles.metrics.store import MetricValue, RunEntry, open_store

url, worker, runs, start_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
while time.time() < start_at:  # start together, so schema creation and writes really race
    time.sleep(0.002)
store = open_store(url)
for i in range(runs):
    values = [MetricValue(Coordinate("m", "all", "{}", step), worker * 1000.0 + i) for step in range(5)]
    store.add_run(RunEntry(f"tests/e2e/test_w{worker}.py", "cpu", "stage-b-cpu", "cpu", "nightly", True,
                           uid=f"w{worker}-{i}"), values)
"""


def test_eight_writer_processes_at_once_lose_nothing(store_url, tmp_path):
    writers, runs = 8, 8
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    start_at = str(time.time() + 1.0)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), store_url, str(w), str(runs), start_at], stderr=subprocess.PIPE
        )
        for w in range(writers)
    ]
    errors = [p.communicate(timeout=120)[1].decode() for p in procs]
    assert [p.returncode for p in procs] == [0] * writers, errors
    store = open_store(store_url)
    stored = store.runs()
    assert sorted(r.uid for r in stored) == sorted(f"w{w}-{i}" for w in range(writers) for i in range(runs))
    values = store.values([r.id for r in stored])
    assert sum(len(v) for v in values.values()) == writers * runs * 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_postgres_is_reported_with_the_password_masked():
    url = f"postgresql://miles:s3cret-pw@127.0.0.1:{_free_port()}/nothing"
    with pytest.raises(StoreUnreachable) as info:
        open_store(url)
    message = str(info.value)
    assert message.startswith("history store unreachable: postgresql://miles:***@127.0.0.1:")
    assert "s3cret-pw" not in message and "after 3 attempts" in message


def test_a_password_given_as_a_query_parameter_is_masked_too():
    url = f"postgresql://127.0.0.1:{_free_port()}/nothing?user=miles&password=s3cret%21pw"
    with pytest.raises(StoreUnreachable) as info:
        open_store(url)
    assert "s3cret" not in str(info.value) and "password=***" in str(info.value)


def test_an_unusable_sqlite_path_is_reported_as_unreachable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(StoreUnreachable, match="history store unreachable: sqlite:///"):
        open_store(f"sqlite:///{blocker / 'history.sqlite'}")


def test_the_default_store_is_sqlite_under_dot_miles(tmp_path, monkeypatch):
    monkeypatch.delenv("MILES_HISTORY_URL", raising=False)
    store = open_store(root=tmp_path)
    assert store.url == f"sqlite:///{tmp_path / '.miles' / 'history.sqlite'}"
    assert (tmp_path / ".miles" / "history.sqlite").is_file()


def test_the_history_url_variable_selects_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_HISTORY_URL", f"sqlite:///{tmp_path / 'elsewhere.sqlite'}")
    assert open_store(root=tmp_path).url.endswith("elsewhere.sqlite")


def test_an_unknown_url_scheme_is_refused_with_the_accepted_forms():
    with pytest.raises(StoreError, match="unknown scheme 'mysql'.*postgresql://"):
        open_store("mysql://u:pw@host/db")


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://miles:hunter2@db.example:5432/h", "postgresql://miles:***@db.example:5432/h"),
        ("postgresql://miles@db/h", "postgresql://miles@db/h"),
        ("postgresql://u:p@[::1]:5433/h?sslmode=require", "postgresql://u:***@[::1]:5433/h?sslmode=require"),
        (
            "postgresql://db/h?user=u&password=s%40cret&sslmode=disable",
            "postgresql://db/h?user=u&password=***&sslmode=disable",
        ),
    ],
)
def test_urls_are_shown_with_the_password_masked(url, shown):
    assert mask_url(url) == shown


def test_a_schema_version_that_is_not_a_number_is_refused_in_one_line(store_url):
    open_store(store_url)
    _raw(store_url, "UPDATE miles_meta SET value = 'abc' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="schema_version is 'abc', not a number") as info:
        open_store(store_url)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("limit", [-1, 0])
def test_a_limit_below_one_is_refused_the_same_way_by_both_stores(store_url, limit):
    store = open_store(store_url)
    _add(store, 1.0)
    with pytest.raises(StoreError, match=f"limit {limit} must be at least 1"):
        store.runs(limit=limit)
    assert len(store.runs(limit=None)) == 1
