"""Without a cgroup, a process that keeps forking and letting its parent exit must not outlive
the sweep.

A kill-what-you-see loop loses to it: between a scan of /proc and the signal, the process it
saw has already forked and exited. The sweep freezes instead (SIGSTOP until nothing of the
attempt can run), then kills. The escape used to succeed now and then, so one test run
tries it many times, with the hopper in one session or a new session per generation, and
with its environment wiped (no attempt token to find it by). The cgroup is switched off:
where one can be made the kernel contains everything anyway.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

from miles.ci.execute import CancelToken, Settings, TestRun, run_attempt
from miles.ci.processes import Containment

# Forks as fast as it can; each parent exits at once. Bounded in time so that a hopper that
# did escape (before the fix) does not run for ever.
HOPPER = """
import os, sys, time
end = time.monotonic() + 60
new_session = sys.argv[1] == "session"
os.setsid()
while time.monotonic() < end:
    if os.fork():
        os._exit(0)
    if new_session:
        os.setsid()
"""


def _hoppers(mark: str) -> list[int]:
    """Live processes whose command line carries `mark`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read()
            with open(f"/proc/{entry}/stat", "rb") as fh:
                state = fh.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in cmdline and state not in (b"Z", b"X"):
            found.append(int(entry))
    return found


def _kill_all(mark: str) -> None:
    for _ in range(200):  # the cleanup of an escaped hopper races it the same way
        pids = _hoppers(mark)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:
                pass
        for pid in _hoppers(mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["session", "one-session"])
def test_a_fork_hopper_never_outlives_the_sweep(mode):
    escaped = []
    for _ in range(15):
        mark = f"hopper-{uuid.uuid4().hex}"
        containment = Containment(use_cgroup=False)
        # the test process leaks the hopper with a wiped environment and exits at once
        leak = (
            "import subprocess, sys; "
            f"subprocess.Popen([sys.executable, '-c', {HOPPER!r}, {mode!r}, {mark!r}], env={{}})"
        )
        proc = subprocess.Popen([sys.executable, "-c", leak], start_new_session=True)
        containment.started(proc.pid)
        proc.wait()
        time.sleep(0.05)  # the hopper is running by now
        containment.stop(0.1)
        containment.close()
        left = _hoppers(mark)
        if left:
            escaped.append((left, containment.escaped))
            _kill_all(mark)
    assert escaped == []


HOPPING_TEST = """
import os, subprocess, sys
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=5, suite="stage-b-cpu")
HOPPER = {hopper!r}
def test_leaks_a_hopper():
    subprocess.Popen([sys.executable, "-c", HOPPER, "session", os.environ["HOP_MARK"]], env={{}})
"""


def test_a_test_that_leaks_a_fork_hopper_passes_and_leaves_nothing_behind(tmp_path):
    mark = f"hopper-{uuid.uuid4().hex}"
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_hop.py").write_text(HOPPING_TEST.format(hopper=HOPPER))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    settings = Settings(root=tmp_path, grace=0.5, base_env={**env, "HOP_MARK": mark}, use_cgroup=False)
    test = TestRun("tests/test_hop.py", "cpu", "stage-b-cpu", "cpu", "1/1", 5.0, 120.0)
    try:
        attempt = run_attempt(test, tmp_path / "attempt", settings, CancelToken())
        assert attempt.status == "passed", attempt.output_tail
        assert _hoppers(mark) == []
        assert attempt.killed, "the sweep names what it stopped"
    finally:
        _kill_all(mark)
