"""Processes that leave the test's process group and session are still stopped.

A real test file starts three escapees: `setsid sleep` (a new session, still a child),
a `setsid -f` daemon (forked away: an orphan at once) and a server started with
`start_new_session=True` bound to a localhost port. Each scenario (the test passes, times
out, or the run is cancelled) must leave none of them alive, the port free, and the
attempt's record naming what was stopped. Both ways of tracking are exercised: a cgroup of
the attempt's own (where this machine lets one be made) and the subreaper with /proc alone.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.running.execute import CancelToken, Settings, TestRun, run_attempt
from miles.ci.running.processes import Cgroup

register_cpu_ci(est_time=50, suite="stage-a-cpu")

CI_ENV = ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL")

ESCAPEES = '''
import json, os, socket, subprocess, sys, time
from pathlib import Path
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-b-cpu")
ASKED = json.loads(Path(os.environ["ESCAPE_CONTROL"]).read_text())
OUT = Path(ASKED["out"])
SERVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen()
open(sys.argv[2], "w").write("listening")
time.sleep(600)
"""


def _start_escapees():
    (OUT / "preloaded").write_text(str("torch" in sys.modules))  # nothing here imports it
    a = subprocess.Popen(["setsid", "sleep", "600"])  # its own session, still our child
    (OUT / "setsid.pid").write_text(str(a.pid))
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {OUT}/daemon.pid; exec sleep 600"], check=True)
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(ASKED["port"]), str(OUT / "listening")],
        start_new_session=True,
    )
    (OUT / "server.pid").write_text(str(server.pid))
    deadline = time.monotonic() + 60
    while not ((OUT / "daemon.pid").exists() and (OUT / "listening").exists()):
        assert time.monotonic() < deadline, "the escapees never came up"
        time.sleep(0.02)
    (OUT / "ready").write_text("ready")


def test_escape():
    _start_escapees()
    if ASKED["mode"] == "hang":
        time.sleep(600)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _cgroup_or_skip() -> None:
    probe = Cgroup.create(f"miles-ci-probe-{os.getpid()}")
    if probe is None:
        pytest.skip("no writable cgroup v2 here; the subreaper mode covers this machine")
    probe.remove()


@pytest.fixture(autouse=True, scope="module")
def _end_the_warm_process():
    """The warm process a test here starts ends with the module, not with the pytest worker."""
    yield
    from miles.ci.running import warm

    warm.close()


@pytest.fixture(params=["cgroup", "subreaper", "warm"])
def mode(request) -> str:
    """How the test process is contained: its own cgroup, the runner as subreaper, or forked by
    the runner's warm process (miles.ci.running.warm; in the cgroup where there is one)."""
    if request.param == "cgroup":
        _cgroup_or_skip()
    return request.param


def _run(
    tmp_path: Path,
    mode: str,
    behaviour: str,
    *,
    timeout: float,
    cancel: CancelToken | None = None,
    attempt_dir: str = "attempt",
):
    out = tmp_path / "out"
    for stale in out.glob("*") if out.exists() else ():
        stale.unlink()
    out.mkdir(exist_ok=True)
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_escape.py").write_text(ESCAPEES)
    port = _free_port()
    # what this run asks of the test, in a file: the environment stays the same for every run of
    # this module, so one warm process serves them all (a changed environment starts another)
    control = tmp_path.parent / "escape-control.json"
    control.write_text(json.dumps({"out": str(out), "port": port, "mode": behaviour}))
    env = {k: v for k, v in os.environ.items() if k not in CI_ENV}
    env.update(ESCAPE_CONTROL=str(control))
    settings = Settings(
        root=tmp_path, grace=0.5, base_env=env, use_cgroup=mode != "subreaper", warm=mode == "warm"
    )
    test = TestRun("tests/test_escape.py", "cpu", "stage-b-cpu", "cpu", "1/1", 5.0, timeout)
    attempt = run_attempt(test, tmp_path / attempt_dir, settings, cancel or CancelToken())
    names = ("setsid", "daemon", "server")
    pids = {name: int((out / f"{name}.pid").read_text()) for name in names if (out / f"{name}.pid").exists()}
    if (out / "preloaded").exists():  # forked by the warm process exactly in the warm mode
        assert (out / "preloaded").read_text() == str(mode == "warm"), attempt.output_tail
    return attempt, pids, port


def _assert_all_stopped(attempt, pids: dict[str, int], port: int) -> None:
    assert set(pids) == {"setsid", "daemon", "server"}, attempt.output_tail
    assert [name for name, pid in pids.items() if _alive(pid)] == []
    assert _port_is_free(port)
    stopped = " ".join(attempt.killed)
    for pid in pids.values():
        assert f"pid {pid} (" in stopped, (pids, attempt.killed)
    assert "sleep 600" in stopped


def test_escapees_of_a_passing_test_are_stopped_after_it_and_named(tmp_path, mode):
    attempt, pids, port = _run(tmp_path, mode, "pass", timeout=120)
    assert attempt.status == "passed", attempt.output_tail
    _assert_all_stopped(attempt, pids, port)


def test_escapees_of_a_test_that_times_out_are_stopped(tmp_path, mode):
    # The limit doubles until pytest got far enough to start them (a busy machine is slow).
    for timeout in (8.0, 16.0, 32.0, 64.0):  # each try in a folder of its own, as the runner's attempts are
        attempt, pids, port = _run(
            tmp_path, mode, "hang", timeout=timeout, attempt_dir=f"attempt-{timeout:g}"
        )
        if (tmp_path / "out" / "ready").exists():
            break
    assert (attempt.status, attempt.classification) == ("timeout", "timeout")
    _assert_all_stopped(attempt, pids, port)


def test_escapees_are_stopped_when_the_run_is_cancelled(tmp_path, mode):
    cancel = CancelToken()
    ready = tmp_path / "out" / "ready"

    def cancel_when_ready() -> None:
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        cancel.cancel(2)  # what SIGINT's handler does

    threading.Thread(target=cancel_when_ready, daemon=True).start()
    attempt, pids, port = _run(tmp_path, mode, "hang", timeout=300, cancel=cancel)
    assert (attempt.status, attempt.classification) == ("cancelled", "cancelled")
    _assert_all_stopped(attempt, pids, port)


def test_a_loaded_machine_stretches_a_timeout_and_a_quiet_one_does_not():
    from miles.load import LoadClock

    quiet = LoadClock(10.0, 10.0, 0.0, cores=2, load=lambda: 1.0)
    assert not quiet.expired(9.9) and quiet.expired(10.0)
    busy = LoadClock(10.0, 10.0, 0.0, cores=2, load=lambda: 8.0)  # 4 runnable per core: a second counts 1/4
    assert not busy.expired(39.0) and busy.expired(40.0) and busy.stretched
    swamped = LoadClock(10.0, 10.0, 0.0, cores=2, load=lambda: 1000.0)  # a hang still ends: at 10x the limit
    assert not swamped.expired(99.0) and swamped.expired(100.0)
    never = LoadClock(10.0, 1.0, 0.0, cores=2, load=lambda: 8.0)  # no stretch asked: wall time
    assert never.expired(10.0)


def test_a_counted_run_returns_the_output_and_a_hung_one_is_killed_with_what_it_printed():
    from miles.load import run_counted

    done = run_counted([sys.executable, "-c", "print('hello')"], 60)
    assert (done.returncode, done.stdout) == (0, "hello\n")
    hung = [sys.executable, "-u", "-c", "import time; print('started', flush=True); time.sleep(600)"]
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_counted(hung, 0.5, stretch=1.0)  # no stretch: the plain wall-clock limit
    assert err.value.output == "started\n"
