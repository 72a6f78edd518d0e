"""Without a cgroup, a process that keeps forking and letting its parent exit must not outlive
the sweep.

A kill-what-you-see loop loses to it: between a scan of /proc and the signal, the process it
saw has already forked and exited. The sweep freezes instead (SIGSTOP until nothing of the
attempt can run), then kills. The escape used to succeed now and then, so one test run
tries it many times, with the hopper in one session or a new session per generation, and
with its environment wiped (no attempt token to find it by). The cgroup is switched off:
where one can be made the kernel contains everything anyway.

Whether any hopper is alive is read from a lock, not from /proc (a scan of /proc misses a
process that lives microseconds): every generation inherits a shared flock on a file, which
the kernel releases only when the last of them is gone.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.running.execute import CancelToken, Settings, TestRun, run_attempt

register_cpu_ci(est_time=5, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]

# Forks as fast as it can; each parent exits at once. It holds a shared lock on argv[2]
# (inherited by every generation), says so in argv[3], and stops by itself when argv[4]
# exists or after 30 s, so a hopper that escaped (before the fix) does not run for ever.
HOPPER = """
import fcntl, os, sys, time
mode, lock, ready, stop = sys.argv[1:5]
fd = os.open(lock, os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)
open(ready, "w").close()
end = time.monotonic() + 30
os.setsid()
n = 0
while time.monotonic() < end:
    n += 1
    if n % 256 == 0 and os.path.exists(stop):
        break
    if os.fork():
        os._exit(0)
    if mode == "session":
        os.setsid()
"""
# The test process: starts the hopper with a wiped environment, waits until it holds the
# lock, and exits.
LEAK = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], env={})
while not os.path.exists(sys.argv[4]):
    time.sleep(0.005)
"""


def _alive(lock: Path, wait: float = 2.0) -> bool:
    """Whether any hopper still holds the lock (killed ones get `wait` seconds to be gone)."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return False
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return True
                time.sleep(0.02)
    finally:
        os.close(fd)


def _files(tmp_path: Path, n: int) -> tuple[Path, Path, Path]:
    lock, ready, stop = (tmp_path / f"{name}-{n}" for name in ("lock", "ready", "stop"))
    lock.write_text("")
    return lock, ready, stop


def _stop_escaped(lock: Path, stop: Path) -> None:
    stop.write_text("")  # an escaped hopper sees it within 256 generations and ends
    assert not _alive(lock, wait=60), "an escaped hopper did not stop"


# Twelve sweeps in a fresh process, as the runner (`python -m miles.ci run`) holds them: the
# subreaper is a process that runs tests and nothing else, not this pytest process, which by now
# may host torch's and gloo's threads and whatever earlier tests left in it. Prints the number
# of sweeps the hopper outlived.
SWEEPS = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import test_runner_containment as t
from miles.ci.running.processes import Containment
mode, root = sys.argv[1], Path(sys.argv[2])
escaped = 0
for n in range(12):
    lock, ready, stop = t._files(root, n)
    containment = Containment(use_cgroup=False)
    argv = [sys.executable, "-c", t.LEAK, t.HOPPER, mode, str(lock), str(ready), str(stop)]
    proc = t.subprocess.Popen(argv, start_new_session=True)
    containment.started(proc.pid)
    proc.wait()
    containment.stop(0.1)
    containment.close()
    if t._alive(lock):
        escaped += 1
        t._stop_escaped(lock, stop)
print(escaped)
"""


@pytest.mark.parametrize("mode", ["session", "one-session"])
def test_a_fork_hopper_never_outlives_the_sweep(tmp_path, mode):
    done = subprocess.run(
        [sys.executable, "-c", SWEEPS, mode, str(tmp_path), str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    escaped = int(done.stdout.split()[-1])
    assert escaped == 0, f"the hopper escaped {escaped} of 12 sweeps"


HOPPING_TEST = """
import os, subprocess, sys, time
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=5, suite="stage-b-cpu")
HOPPER = {hopper!r}
def test_leaks_a_hopper():
    lock, ready, stop = os.environ["HOP_FILES"].split(":")
    subprocess.Popen([sys.executable, "-c", HOPPER, "session", lock, ready, stop], env={{}})
    while not os.path.exists(ready):
        time.sleep(0.005)
"""


def test_a_test_that_leaks_a_fork_hopper_passes_and_leaves_nothing_behind(tmp_path):
    lock, ready, stop = _files(tmp_path, 0)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_hop.py").write_text(HOPPING_TEST.format(hopper=HOPPER))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    env["HOP_FILES"] = f"{lock}:{ready}:{stop}"
    settings = Settings(root=tmp_path, grace=0.5, base_env=env, use_cgroup=False)
    test = TestRun("tests/test_hop.py", "cpu", "stage-b-cpu", "cpu", "1/1", 5.0, 120.0)
    attempt = run_attempt(test, tmp_path / "attempt", settings, CancelToken())
    escaped = _alive(lock)
    if escaped:
        _stop_escaped(lock, stop)
    assert attempt.status == "passed", attempt.output_tail
    assert not escaped, "the hopper outlived the attempt"
    assert attempt.killed, "the sweep names what it stopped"
