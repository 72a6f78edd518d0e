"""A PostgreSQL history store that goes away in the middle of a run.

The test starts a private PostgreSQL server of its own (initdb + pg_ctl from the installed
server packages), so stopping it harms nothing else. Without the server binaries it skips,
except under MILES_REQUIRE_POSTGRES=1 (CI), where that is a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry.registration import GateDeclaration
from miles.metrics.capture import MetricRecorder
from miles.metrics.gating import GateRun, gate_attempt
from miles.metrics.spec import gate_spec
from miles.metrics.store import MetricValue, RunEntry, open_store

register_cpu_ci(est_time=5, suite="stage-a-cpu")

PASSWORD = "outage-test-pw"
TEST = "tests/e2e/test_toy.py"
GRAD = GateDeclaration(TEST, 3, "train/grad_norm")


def _bindir() -> Path | None:
    try:
        out = subprocess.run(
            ["pg_config", "--bindir"], capture_output=True, text=True, check=True
        ).stdout.strip()
        if (Path(out) / "initdb").exists():
            return Path(out)
    except (OSError, subprocess.CalledProcessError):
        pass
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


class PrivateServer:
    """A throwaway PostgreSQL cluster on a free port, owned by the postgres user when run as root."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.home = Path(tempfile.mkdtemp(prefix="miles-pg-"))
        self.data = self.home / "data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://miles:{PASSWORD}@127.0.0.1:{self.port}/postgres"
        self._as = []
        if os.geteuid() == 0:  # initdb refuses to run as root
            shutil.chown(self.home, "postgres")
            self._as = ["runuser", "-u", "postgres", "--"]

    def _pg(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._as, str(self.bindir / tool), *args], check=True, capture_output=True, timeout=60
        )

    def init_and_start(self) -> None:
        pwfile = self.home / "pw"
        pwfile.write_text(PASSWORD)
        if self._as:
            shutil.chown(pwfile, "postgres")
        self._pg("initdb", "-D", str(self.data), "-U", "miles", f"--pwfile={pwfile}", "--auth=scram-sha-256",
                 "--no-sync", "-E", "UTF8")  # fmt: skip
        self.start()

    def start(self) -> None:
        options = f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._pg("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.home / "log"), "-w", "start")

    def running(self) -> bool:
        status = [*self._as, str(self.bindir / "pg_ctl"), "-D", str(self.data), "status"]
        return subprocess.run(status, capture_output=True, timeout=60).returncode == 0

    def stop(self) -> None:
        self._pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        subprocess.run([*self._as, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)  # fmt: skip
        shutil.rmtree(self.home, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster() -> Iterator[PrivateServer]:
    bindir = _bindir()
    if bindir is None:
        reason = "PostgreSQL server binaries (initdb, pg_ctl) are not installed; .ci/run installs them"
        if os.environ.get("MILES_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    cluster = PrivateServer(bindir)
    try:
        cluster.init_and_start()
        yield cluster
    finally:
        cluster.remove()


@pytest.fixture
def url(cluster: PrivateServer) -> str:
    """The running cluster's URL, pointing into a schema of this test's own."""
    import psycopg

    if not cluster.running():
        cluster.start()  # a previous test stopped it
    schema = f"outage_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(cluster.url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    return f"{cluster.url}?options=-csearch_path%3D{schema}"


def _start_of_run(url: str, tmp_path: Path):
    """A store with a five-run baseline, and a run that has logged its metrics."""
    store = open_store(url)
    for i in range(5):
        entry = RunEntry(TEST, "cpu", "stage-b-cpu", "cpu", "nightly", True,
                         created_at=datetime(2026, 1, 1, tzinfo=UTC) + timedelta(days=i))  # fmt: skip
        store.add_run(entry, [MetricValue(gate_spec(GRAD).coordinate(-1), 1.0)])
    recorder = MetricRecorder(tmp_path / "records")
    for step in range(3):
        recorder.log(step, {"train/grad_norm": 1.1})
    return store, recorder.directory


def _gate(store, records: Path, *, enforce: bool):
    run = GateRun(TEST, "cpu", "stage-b-cpu", "cpu", "nightly", enforce)
    return gate_attempt(records, [GRAD], run, write_baseline=True, store=store)


def test_postgres_stopped_mid_run_leaves_a_shadow_lane_green_with_a_warning(cluster, url, tmp_path):
    store, records = _start_of_run(url, tmp_path)
    cluster.stop()
    outcome = _gate(store, records, enforce=False)
    assert not outcome.failed and outcome.trusted is None and outcome.baseline_run_id is None
    (warning,) = outcome.warnings
    assert warning.startswith(
        f"warning: history store unreachable: postgresql://miles:***@127.0.0.1:{cluster.port}/"
    )
    assert PASSWORD not in warning


def test_postgres_stopped_mid_run_fails_an_enforced_gate_with_the_reason(cluster, url, tmp_path):
    store, records = _start_of_run(url, tmp_path)
    cluster.stop()
    outcome = _gate(store, records, enforce=True)
    assert outcome.failed and outcome.message.startswith("history store unreachable: postgresql://miles:***@")


def test_the_store_answers_again_once_postgres_is_back(cluster, url, tmp_path):
    store, records = _start_of_run(url, tmp_path)
    cluster.stop()
    cluster.start()
    outcome = _gate(store, records, enforce=True)
    assert (outcome.failed, outcome.trusted, outcome.verdicts[0].status) == (False, True, "PASS")
