"""The runner against real test processes: timeouts that leave nothing behind, crashes,
retries of infrastructure failures only, missing files and missing JUnit, SIGTERM.

One generated project holds a test file per behaviour; a single runner pass over it (module
fixture) produces the record the tests below read, so each behaviour costs one process.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.ci.running.execute import CancelToken, Settings, TestRun, run_attempt
from miles.ci.running.plan import RunOptions, build_plan
from miles.ci.running.runner import execute_plan

register_cpu_ci(est_time=15, suite="stage-a-cpu")

HEADER = """
import os, subprocess, sys, time
from pathlib import Path
from miles.ci.register import register_cpu_ci
OUT = Path(__file__).resolve().parents[1] / "out"
OUT.mkdir(exist_ok=True)
"""

# A child that ignores SIGTERM and a grandchild that moved to its own process group: only a
# SIGKILL to the whole session stops both.
STUBBORN_CHILD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
g = subprocess.Popen([sys.executable, "-c", "import os, time; os.setpgid(0, 0); time.sleep(600)"])
with open(sys.argv[1], "a") as fh:
    fh.write(f"{os.getpid()}\\n{g.pid}\\n")
time.sleep(600)
"""

TREE = {
    "tests/test_env.py": HEADER
    + """
register_cpu_ci(est_time=40, suite="stage-b-cpu")
def test_sees_the_runner_environment():
    keys = [k for k in os.environ if k.startswith("MILES_CI_")]
    (OUT / "env.json").write_text(__import__("json").dumps({k: os.environ[k] for k in keys}))
""",
    "tests/test_assert.py": HEADER
    + """
register_cpu_ci(est_time=40.5, suite="stage-b-cpu")
def test_logic_is_wrong():
    with open(OUT / "assert_runs.txt", "a") as fh:
        fh.write("ran\\n")
    assert 2 + 2 == 5
""",
    "tests/test_infra.py": HEADER
    + """
register_cpu_ci(est_time=41, suite="stage-b-cpu")
def test_fails_once_on_nccl_init():
    record_dir = Path(os.environ["MILES_CI_GATE_RECORD_DIR"])
    assert list(record_dir.iterdir()) == [], "the record dir must be fresh for every attempt"
    (record_dir / "leftover.jsonl").write_text("{}")
    if os.environ["MILES_CI_ATTEMPT"] == "1":
        raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")
""",
    "tests/test_segv.py": HEADER
    + """
register_cpu_ci(est_time=41.5, suite="stage-b-cpu")
def test_crashes():
    import ctypes
    ctypes.string_at(0)
""",
    "tests/test_no_junit.py": HEADER
    + """
register_cpu_ci(est_time=42, suite="stage-b-cpu")
def test_exits_before_pytest_can_write_junit():
    os._exit(0)
""",
    "tests/test_leaks.py": HEADER
    + """
register_cpu_ci(est_time=42.5, suite="stage-b-cpu")
def test_passes_but_leaves_a_server_running():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    (OUT / "leak.txt").write_text(str(p.pid))
""",
    "tests/test_gone.py": HEADER
    + """
register_cpu_ci(est_time=43, suite="stage-b-cpu")
def test_never_runs():
    pass
""",
}


HANG = (
    HEADER
    + f"""
register_cpu_ci(est_time=4, suite="stage-b-cpu")
CHILD = {STUBBORN_CHILD!r}
def test_hangs_with_grandchildren():
    subprocess.Popen([sys.executable, "-c", CHILD, str(OUT / "hang.txt")])
    time.sleep(600)
"""
)


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.lstrip("\n"))


CI_ENV = (
    "GITHUB_ACTIONS",
    "GITHUB_STEP_SUMMARY",
    "GITHUB_OUTPUT",
    "MILES_DURATIONS_PATH",
    "MILES_HISTORY_URL",
)


@pytest.fixture(autouse=True)
def _no_ci_env(monkeypatch):
    for key in CI_ENV:
        monkeypatch.delenv(key, raising=False)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()] if path.exists() else []


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    _write(root, TREE)
    catalog = load_catalog()
    options = RunOptions(
        root=root,
        suites=("stage-b-cpu",),
        timeout_floor=0.5,
        grace=0.5,
        max_attempts=3,
        continue_on_error=True,
    )
    with pytest.MonkeyPatch.context() as mp:  # module scope: the autouse fixture is not active yet
        for key in CI_ENV:
            mp.delenv(key, raising=False)
        plan = build_plan(options, catalog, discover(root, catalog=catalog, cache=False))
        (root / "tests/test_gone.py").unlink()  # deleted between plan and run
        record = execute_plan(plan, catalog, CancelToken(), out=io.StringIO())
    by_file: dict[str, list] = {}
    for attempt in record.attempts:
        by_file.setdefault(attempt.file.removeprefix("tests/"), []).append(attempt)
    return root, record, by_file


def test_every_test_process_gets_the_contract_environment(outcome):
    root, record, by_file = outcome
    env = json.loads((root / "out/env.json").read_text())
    (attempt,) = by_file["test_env.py"]
    assert attempt.status == "passed"
    assert {
        k: env[k] for k in ("MILES_CI_BACKEND", "MILES_CI_SUITE", "MILES_CI_LANE", "MILES_CI_ATTEMPT")
    } == {
        "MILES_CI_BACKEND": "cpu",
        "MILES_CI_SUITE": "stage-b-cpu",
        "MILES_CI_LANE": "cpu",
        "MILES_CI_ATTEMPT": "1",
    }
    assert env["MILES_CI_GATE_RECORD_DIR"] == attempt.record_dir
    assert Path(attempt.record_dir).is_relative_to(root / ".miles" / "reports")


def test_timeout_kills_grandchildren_even_ones_that_ignore_sigterm(tmp_path):
    _write(tmp_path, {"tests/test_hang.py": HANG})
    settings = Settings(
        root=tmp_path, grace=0.5, base_env={k: v for k, v in os.environ.items() if k not in CI_ENV}
    )
    pids: list[int] = []
    # The children start only after pytest has started; on a very busy machine that can take
    # longer than a short timeout, so the limit doubles until the test got that far.
    for timeout in (5.0, 10.0, 20.0, 40.0):
        test = TestRun("tests/test_hang.py", "cpu", "stage-b-cpu", "cpu", "1/1", 4.0, timeout)
        attempt = run_attempt(test, tmp_path / f"attempt-{timeout:g}", settings, CancelToken())
        assert (attempt.status, attempt.classification) == ("timeout", "timeout")
        pids = _pids(tmp_path / "out/hang.txt")
        if len(pids) == 2:
            break
    assert len(pids) == 2, "the hanging test never got far enough to start its children"
    assert [p for p in pids if _alive(p)] == []


def test_processes_left_behind_by_a_passing_test_are_stopped(outcome):
    root, _, by_file = outcome
    assert [a.status for a in by_file["test_leaks.py"]] == ["passed"]
    assert not _alive(int((root / "out/leak.txt").read_text()))


def test_infrastructure_failure_is_retried_with_a_fresh_record_dir_and_reported_flaky(outcome):
    _, record, by_file = outcome
    first, second = by_file["test_infra.py"]
    assert (first.status, first.classification) == ("failed", "infra:nccl-init")
    assert (second.status, second.classification, second.attempt) == ("flaky", "flaky", 2)
    assert second.message.startswith("passed on attempt 2 after infra:nccl-init: ")
    assert record.counts()["flaky"] == 1 and second.ok
    assert "infra:nccl-init" in second.retry_reason
    assert first.record_dir != second.record_dir


def test_assertion_failure_is_not_retried(outcome):
    root, _, by_file = outcome
    (attempt,) = by_file["test_assert.py"]
    assert (attempt.status, attempt.classification) == ("failed", "assertion")
    assert "assert (2 + 2) == 5" in attempt.message or "assert 4 == 5" in attempt.message
    assert (root / "out/assert_runs.txt").read_text() == "ran\n"


def test_segfault_is_a_crash_with_its_signal(outcome):
    _, _, by_file = outcome
    (attempt,) = by_file["test_segv.py"]
    assert (attempt.status, attempt.classification, attempt.signal) == ("failed", "crash", "SIGSEGV")
    assert attempt.exit_code is None


def test_no_junit_is_an_error_with_the_output_tail(outcome):
    _, _, by_file = outcome
    (attempt,) = by_file["test_no_junit.py"]
    assert (attempt.status, attempt.classification) == ("error", "no-junit")
    assert "test_no_junit.py" in attempt.output_tail


def test_file_deleted_after_planning_fails_and_the_rest_still_run(outcome):
    _, record, by_file = outcome
    (attempt,) = by_file["test_gone.py"]
    assert (attempt.status, attempt.classification) == ("failed", "missing-file")
    assert "does not exist" in attempt.message
    assert len(record.final_attempts) == len(TREE)


def test_fast_fail_stops_after_the_first_failure(tmp_path):
    _write(
        tmp_path,
        {
            "tests/test_a_fails.py": HEADER + 'register_cpu_ci(est_time=1, suite="stage-b-cpu")\n'
            "def test_x():\n    assert False\n",
            "tests/test_b_later.py": HEADER + 'register_cpu_ci(est_time=2, suite="stage-b-cpu")\n'
            "def test_y():\n    pass\n",
        },
    )
    catalog = load_catalog()
    plan = build_plan(
        RunOptions(root=tmp_path, suites=("stage-b-cpu",), timeout_floor=60),
        catalog,
        discover(tmp_path, catalog=catalog),
    )
    record = execute_plan(plan, catalog, CancelToken(), out=io.StringIO())
    assert [(a.file, a.status) for a in record.attempts] == [
        ("tests/test_a_fails.py", "failed"),
        ("tests/test_b_later.py", "skipped"),
    ]
    assert "fast-fail after tests/test_a_fails.py" in record.attempts[1].message


def test_sigterm_to_the_runner_still_writes_complete_reports(tmp_path):
    _write(
        tmp_path,
        {
            "tests/test_1_quick.py": HEADER + 'register_cpu_ci(est_time=1, suite="stage-b-cpu")\n'
            "def test_q():\n    pass\n",
            "tests/test_2_hang.py": HEADER
            + f'register_cpu_ci(est_time=60, suite="stage-b-cpu")\nCHILD = {STUBBORN_CHILD!r}\n'
            "def test_h():\n"
            '    subprocess.Popen([sys.executable, "-c", CHILD, str(OUT / "hang.txt")])\n'
            "    time.sleep(600)\n",
            "tests/test_3_never.py": HEADER + 'register_cpu_ci(est_time=120, suite="stage-b-cpu")\n'
            "def test_n():\n    pass\n",
        },
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    runner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "miles.ci",
            "run",
            "--root",
            str(tmp_path),
            "--suite",
            "stage-b-cpu",
            "--grace",
            "0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    hang = tmp_path / "out/hang.txt"
    deadline = time.monotonic() + 60
    while len(_pids(hang)) < 2 and time.monotonic() < deadline and runner.poll() is None:
        time.sleep(0.05)
    runner.send_signal(signal.SIGTERM)
    output, _ = runner.communicate(timeout=60)
    assert runner.returncode == 1, output
    reports = tmp_path / ".miles/reports/stage-b-cpu-1of1"
    run = json.loads((reports / "run.json").read_text())
    assert run["cancelled_by"] == "SIGTERM"
    assert [(a["file"], a["status"]) for a in run["attempts"]] == [
        ("tests/test_1_quick.py", "passed"),
        ("tests/test_2_hang.py", "cancelled"),
        ("tests/test_3_never.py", "cancelled"),
    ]
    assert "cancelled by SIGTERM" in (reports / "summary.md").read_text()
    assert 'errors="2"' in (reports / "junit.xml").read_text()
    assert f"junit.xml: {reports / 'junit.xml'}" in output
    assert [p for p in _pids(hang) if _alive(p)] == []


def test_waiting_works_in_a_process_holding_over_a_thousand_descriptors():
    # a long pytest session (two xdist workers over the whole suite) held more than 1024 open
    # descriptors, and select() refused the runner's pidfd: "filedescriptor out of range"
    import resource

    from miles.ci.running.execute import _readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"this machine allows {hard} open descriptors per process")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = [os.dup(0) for _ in range(1100)]
    read, write = os.pipe()
    try:
        assert read > 1024
        os.write(write, b"x")
        _readable([read], 5.0)  # returns at once: the pipe has a byte
        assert os.read(read, 1) == b"x"
    finally:
        for fd in (*held, read, write):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
