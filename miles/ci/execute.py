"""Run one test file once: its own `python -m pytest <file>` process in its own session and
process group, its own JUnit file, a timeout, and nothing of it left alive afterwards.

On timeout or cancellation the whole group (and any member of the session that moved to
another group) gets SIGTERM, a grace period, then SIGKILL. The same sweep runs after a
normal exit, so a server a test forgot to stop cannot hold a port or a GPU for the next one.
What happened is read and classified by miles.ci.outcome.
"""

from __future__ import annotations

import collections
import os
import select
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from miles.ci.outcome import classify_attempt, read_junit, signal_name
from miles.ci.record import CANCELLED, FAILED, Attempt

TAIL_LINES = 80
TAIL_CHARS = 12_000
POLL_S = 0.25  # how often the wait loop looks at the cancel flag and the progress display


class CancelToken:
    """Set from a signal handler; the executor stops the running test when it sees it."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.count = 0

    def cancel(self, signum: int) -> None:
        self.signal = signum if self.signal is None else self.signal
        self.count += 1

    @property
    def cancelled(self) -> bool:
        return self.signal is not None

    @property
    def hurry(self) -> bool:
        """A second signal: skip the grace period."""
        return self.count > 1

    @property
    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""


@dataclass(frozen=True)
class TestRun:
    """Everything needed to start one attempt of one test file."""

    file: str  # relative to root
    backend: str
    suite: str
    lane: str
    shard: str
    est_time: float
    timeout: float
    attempt: int = 1
    retry_reason: str | None = None
    commit: str = ""

    __test__ = False  # not a pytest class

    def record(self, status: str, classification: str, **outcome: Any) -> Attempt:
        """An Attempt of this run, started now; `outcome` fills in what happened."""
        return Attempt(
            file=self.file,
            backend=self.backend,
            suite=self.suite,
            lane=self.lane,
            shard=self.shard,
            attempt=self.attempt,
            status=status,
            exit_code=None,
            signal=None,
            elapsed=0.0,
            est_time=self.est_time,
            retry_reason=self.retry_reason,
            classification=classification,
            commit=self.commit,
            started_at=time.time(),
            timeout=self.timeout,
            **outcome,
        )

    def env(self, record_dir: Path) -> dict[str, str]:
        """The variables every test process gets (the contract with tests and trainers)."""
        return {
            "MILES_CI_BACKEND": self.backend,
            "MILES_CI_SUITE": self.suite,
            "MILES_CI_LANE": self.lane,
            "MILES_CI_SHARD": self.shard,
            "MILES_CI_ATTEMPT": str(self.attempt),
            "MILES_CI_GATE_RECORD_DIR": str(record_dir),
        }


@dataclass(frozen=True)
class Settings:
    root: Path
    grace: float = 10.0
    python: str = sys.executable
    pytest_args: tuple[str, ...] = ()
    echo: IO[str] | None = None  # where to stream the test's output live, if anywhere
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def pytest_command(settings: Settings, file: str, junit_path: Path | str) -> list[str]:
    return [
        settings.python,
        "-m",
        "pytest",
        file,
        f"--junitxml={junit_path}",
        "-o",
        "junit_family=xunit1",
        "-p",
        "no:cacheprovider",
        *settings.pytest_args,
    ]


def format_command(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items())
    return (prefix + " " if prefix else "") + shlex.join(argv)


def run_attempt(
    test: TestRun,
    attempt_dir: Path,
    settings: Settings,
    cancel: CancelToken,
    tick: Callable[[float], None] | None = None,
) -> Attempt:
    """Run `test` once and return its record; never raises for anything the test does."""
    attempt_dir.mkdir(parents=True, exist_ok=True)
    record_dir = attempt_dir / "metrics"
    record_dir.mkdir(parents=True, exist_ok=True)
    junit_path = attempt_dir / "junit.xml"
    log_path = attempt_dir / "output.log"
    base = test.record(FAILED, "", record_dir=str(record_dir))
    if cancel.cancelled:
        return base.replace(
            status=CANCELLED,
            classification="cancelled",
            message=f"not started: run cancelled by {cancel.name}",
        )
    if not (settings.root / test.file).is_file():
        message = f"{test.file} does not exist (deleted or moved after the plan was made)"
        log_path.write_text(message + "\n", encoding="utf-8")
        return base.replace(classification="missing-file", message=message, output_tail=message)

    argv = pytest_command(settings, test.file, junit_path)
    env = {**settings.base_env, **test.env(record_dir)}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(
                argv,
                cwd=settings.root,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # own session and group: the unit we kill
            )
        except OSError as exc:
            message = f"could not start {argv[0]}: {exc}"
            return base.replace(classification="launch-error", message=message, output_tail=message)
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        reader = threading.Thread(target=_pump, args=(proc.stdout, log, tail, settings.echo), daemon=True)
        reader.start()
        outcome = _wait(proc, started + test.timeout, cancel, tick, started)
        elapsed = time.monotonic() - started
        if outcome != "exited":
            terminate_group(proc, settings.grace, cancel)
        else:
            sweep_group(proc, settings.grace, cancel)
        reader.join(timeout=5)
    returncode = proc.returncode
    text = "".join(tail)[-TAIL_CHARS:]
    parsed = read_junit(junit_path)
    status, classification, message = classify_attempt(
        returncode=returncode,
        timed_out=outcome == "timeout",
        cancelled_by=cancel.name if outcome == "cancelled" else None,
        junit=parsed,
        tail=text,
        timeout=test.timeout,
        est_time=test.est_time,
    )
    return base.replace(
        status=status,
        exit_code=returncode if returncode is not None and returncode >= 0 else None,
        signal=signal_name(returncode),
        elapsed=elapsed,
        classification=classification,
        message=message,
        output_tail=text,
        cases=parsed.cases if parsed.ok else (),
    )


def _pump(stream: IO[bytes], log: IO[bytes], tail: collections.deque, echo: IO[str] | None) -> None:
    """Copy the test's output to its log file, the tail buffer and (optionally) the console."""
    try:
        for raw in iter(stream.readline, b""):
            log.write(raw)
            line = raw.decode("utf-8", errors="replace")
            tail.append(line)
            if echo is not None:
                echo.write(line)
                echo.flush()
        log.flush()
    except (OSError, ValueError):
        pass  # the log was closed under us: a process outside the test's session held the pipe
    finally:
        stream.close()


def _wait(
    proc: subprocess.Popen,
    deadline: float,
    cancel: CancelToken,
    tick: Callable[[float], None] | None,
    started: float,
) -> str:
    """Block until the process exits ("exited"), the deadline passes ("timeout") or the run
    is cancelled ("cancelled"). A pidfd makes the exit visible at once; polling is the
    fallback where the kernel has none."""
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(proc.pid)
        except OSError:
            pidfd = None
    try:
        while True:
            if proc.poll() is not None:
                return "exited"
            if cancel.cancelled:
                return "cancelled"
            now = time.monotonic()
            if now >= deadline:
                return "timeout"
            step = min(deadline - now, POLL_S)
            if pidfd is not None:
                select.select([pidfd], [], [], step)
            else:
                time.sleep(min(step, 0.01))
            if tick is not None:
                tick(time.monotonic() - started)
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _members(pgid: int) -> list[tuple[int, int]]:
    """(pid, pgid) of live processes in process group or session `pgid` (which equal the
    test's pid, as it was started with a new session). Zombies do not count."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()
        state, pgrp, session = fields[0], int(fields[2]), int(fields[3])
        if state in (b"Z", b"X"):
            continue
        if pgrp == pgid or session == pgid:
            found.append((int(entry), pgrp))
    return found


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return bool(_members(pgid))  # a member may have moved to its own group
    except PermissionError:
        return True
    return bool(_members(pgid)) if os.path.isdir("/proc") else True


def _signal_all(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid, pgrp in _members(pgid):
        if pgrp != pgid:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def terminate_group(proc: subprocess.Popen, grace: float, cancel: CancelToken | None = None) -> None:
    """SIGTERM the test's group, wait up to `grace` seconds, SIGKILL what is left; returns
    when no process of the group is alive (or after a last few seconds of waiting)."""
    pgid = proc.pid
    _signal_all(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not (cancel is not None and cancel.hurry):
        proc.poll()
        if not _alive(pgid):
            break
        time.sleep(0.02)
    _signal_all(pgid, signal.SIGKILL)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a hung GPU driver call); go on
        print(f"warning: test process {pgid} did not die within 30 s of SIGKILL", file=sys.stderr)
    end = time.monotonic() + 5
    while _alive(pgid) and time.monotonic() < end:
        time.sleep(0.02)


def sweep_group(proc: subprocess.Popen, grace: float, cancel: CancelToken | None = None) -> None:
    """After a normal exit: stop whatever the test left running in its group."""
    if _alive(proc.pid):
        terminate_group(proc, grace, cancel)
