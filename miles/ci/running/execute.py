"""Run one test file once: its own `python -m pytest <file>` process in its own session and
process group, its own JUnit file, a timeout, and nothing of it left alive afterwards.

Every process the test starts is tracked (miles.ci.running.processes: a cgroup where one can be
made, always a subreaper and a walk of /proc), so a `setsid` daemon or a server in a new
session is found too. On timeout or cancellation they all get SIGTERM, a grace period, then
SIGKILL; the same sweep runs after a normal exit, so a server a test forgot to stop cannot
hold a port or a GPU for the next one. The attempt's record names every process stopped.
What happened is read and classified by miles.ci.running.outcome.
"""

from __future__ import annotations

import codecs
import os
import resource
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

from miles.ci.reports.phases import attempt_phases
from miles.ci.reports.record import CANCELLED, FAILED, Attempt
from miles.ci.running.outcome import classify_attempt, read_junit, signal_name
from miles.ci.running.processes import Containment
from miles.ci.running.warm import Warm, WarmProcess, fork_server_for, warm_for
from miles.files import Folder
from miles.load import LoadClock
from miles.phases import DIR_ENV as PHASE_DIR_ENV

TAIL_LINES = 80
TAIL_CHARS = 12_000
TAIL_BYTES = 64 << 10  # what the tail keeps in memory: enough bytes for TAIL_CHARS of UTF-8
PUMP_CHUNK = 64 << 10
POLL_S = 0.25  # how often the wait loop looks at the cancel flag and the progress display


class CancelToken:
    """Set from a signal handler; the executor stops the running test when it sees it. The
    handler also writes to a pipe the wait loop selects on, so a cancel is seen at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self.count = 0
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)

    def cancel(self, signum: int) -> None:
        self.signal = signum if self.signal is None else self.signal
        self.count += 1
        try:
            os.write(self._write, b"x")
        except OSError:  # the pipe is full: the loop has been told already
            pass

    def fileno(self) -> int:
        return self._read

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass

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

    def env(self, record_dir: Path, phase_dir: Path | None = None) -> dict[str, str]:
        """The variables every test process gets (the contract with tests and trainers)."""
        env = {
            "MILES_CI_BACKEND": self.backend,
            "MILES_CI_SUITE": self.suite,
            "MILES_CI_LANE": self.lane,
            "MILES_CI_SHARD": self.shard,
            "MILES_CI_ATTEMPT": str(self.attempt),
            "MILES_CI_GATE_RECORD_DIR": str(record_dir),
        }
        if phase_dir is not None:
            env[PHASE_DIR_ENV] = str(phase_dir)
        return env


@dataclass(frozen=True)
class Settings:
    root: Path
    grace: float = 10.0
    python: str = sys.executable
    pytest_args: tuple[str, ...] = ()
    echo: IO[str] | None = None  # where to stream the test's output live, if anywhere
    base_env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    use_cgroup: bool = True  # track the test's processes in a cgroup of its own where possible
    # how far a timeout stretches while the machine is loaded (LoadClock); 1: never
    load_stretch: float = 1.0
    # fork each test's pytest process from a warm one that has imported the heavy libraries
    # (miles.ci.running.warm; the CPU lanes)
    warm: bool = False


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
    attempt_dir: Path | Folder,
    settings: Settings,
    cancel: CancelToken,
    tick: Callable[[float], None] | None = None,
    on_cancel: Callable[[Attempt], None] | None = None,
) -> Attempt:
    """Run `test` once and return its record; never raises for anything the test does.
    `on_cancel` gets the attempt as cancelled the moment a cancel is seen, before any
    waiting (the grace period, the output pipe), so reports can be written first.

    `attempt_dir` is the attempt's own folder (a Folder the runner made for it, or a path);
    the runner creates `metrics/` and `output.log` in it exclusively, never through a link."""
    folder = attempt_dir
    try:
        if not isinstance(folder, Folder):
            folder = Folder.open(attempt_dir, create=True)
        for name in ("metrics", "phases"):
            with folder.subfolder(name):
                pass
        log = folder.create("output.log")
    except (OSError, ValueError) as exc:  # FileRefused is a ValueError
        path = getattr(folder, "path", attempt_dir)
        message = f"cannot prepare the attempt folder {path}: {getattr(exc, 'strerror', None) or exc}"
        return test.record(FAILED, "report-folder", message=message, output_tail=message)
    finally:
        if folder is not attempt_dir and isinstance(folder, Folder):
            folder.close()
    try:
        return _run_in(test, folder.path, log, settings, cancel, tick, on_cancel)
    finally:
        try:
            log.close()
        except OSError as exc:  # a full disk costs the log's tail, never the attempt's record
            print(
                f"warning: {test.file}: its output.log could not be written out: {exc.strerror or exc}",
                file=sys.stderr,
            )


def _run_in(
    test: TestRun,
    attempt_dir: Path,
    log: IO[bytes],
    settings: Settings,
    cancel: CancelToken,
    tick: Callable[[float], None] | None,
    on_cancel: Callable[[Attempt], None] | None,
) -> Attempt:
    record_dir = attempt_dir / "metrics"
    phase_dir = attempt_dir / "phases"
    junit_path = attempt_dir / "junit.xml"
    base = test.record(FAILED, "", record_dir=str(record_dir))
    if cancel.cancelled:
        return base.replace(
            status=CANCELLED,
            classification="cancelled",
            message=f"not started: run cancelled by {cancel.name}",
        )
    if not (settings.root / test.file).is_file():
        message = f"{test.file} does not exist (deleted or moved after the plan was made)"
        log.write((message + "\n").encode("utf-8", "backslashreplace"))
        return base.replace(classification="missing-file", message=message, output_tail=message)

    argv = pytest_command(settings, test.file, junit_path)
    env = {**settings.base_env, **test.env(record_dir, phase_dir)}
    # before the containment: the warm process and the fork server are the runner's, not the attempt's
    server = fork_server_for(settings.python, env, settings.root) if settings.warm else None
    if server is not None:
        env[server.env_name] = server.path
    warm = warm_for(settings.python, env, settings.root) if settings.warm else None
    containment = Containment(use_cgroup=settings.use_cgroup)
    env.update(containment.env())
    started = time.monotonic()
    cpu_before = _children_cpu() + (server.usage() if server is not None else 0.0)
    try:
        try:
            proc = _start(argv, settings.root, env, containment, warm)
        except (OSError, subprocess.SubprocessError) as exc:
            message = f"could not start {argv[0]}: {exc}"
            return base.replace(classification="launch-error", message=message, output_tail=message)
        containment.started(proc.pid)
        tail = Tail()
        reader = threading.Thread(target=_pump, args=(proc.stdout, log, tail, settings.echo), daemon=True)
        reader.start()
        clock = LoadClock(test.timeout, settings.load_stretch, started)
        outcome = _wait(proc, clock, cancel, tick, started)
        elapsed = time.monotonic() - started
        if outcome == "cancelled" and on_cancel is not None:
            on_cancel(
                base.replace(
                    status=CANCELLED,
                    classification="cancelled",
                    elapsed=elapsed,
                    message=f"stopped: the run was cancelled by {cancel.name}",
                    output_tail=tail.text(),
                )
            )
        killed = containment.stop(settings.grace, hurry=lambda: cancel.hurry)
        if containment.escaped:  # said in the record and on the console: containment was partial
            killed += tuple(
                f"still running after the sweep (containment partial): {p}" for p in containment.escaped
            )
            print(
                f"warning: {test.file}: processes outlived the sweep: {'; '.join(containment.escaped)}",
                file=sys.stderr,
            )
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a hung GPU driver call); go on
            print(f"warning: test process {proc.pid} did not die within 30 s of SIGKILL", file=sys.stderr)
        # Every holder of the pipe is gone by now; the bound is for one stuck in the kernel.
        reader.join(timeout=1 if cancel.cancelled else 5)
    finally:
        containment.close()
    returncode = proc.returncode
    # a forked one's own, from wait4; the fork server's launches for it, from the server
    cpu_after = _children_cpu() + (server.usage() if server is not None else 0.0)
    cpu = cpu_after - cpu_before + getattr(proc, "cpu", 0.0)
    text = tail.text()
    parsed = read_junit(junit_path)
    status, classification, message = classify_attempt(
        returncode=returncode,
        timed_out=outcome == "timeout",
        cancelled_by=cancel.name if outcome == "cancelled" else None,
        junit=parsed,
        timeout=test.timeout,
        est_time=test.est_time,
    )
    if outcome == "timeout" and clock.stretched:
        message += f" of the machine's time: {elapsed:.0f}s of wall time at a load average up to {clock.peak:.1f} on {clock.cores} cores"
    return base.replace(
        phases=attempt_phases(phase_dir, base.started_at, elapsed),
        cpu=round(cpu, 1),
        status=status,
        exit_code=returncode if returncode is not None and returncode >= 0 else None,
        signal=signal_name(returncode),
        elapsed=elapsed,
        classification=classification,
        message=message,
        output_tail=text,
        cases=parsed.cases if parsed.ok else (),
        killed=killed,
    )


def _children_cpu() -> float:
    """User + system CPU seconds of this process's reaped descendants (the runner reaps the test's
    process, and as their subreaper its orphans; each process reaps its own children)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _start(
    argv: list[str], cwd: Path, env: dict[str, str], containment: Containment, warm: Warm | None = None
) -> subprocess.Popen | WarmProcess:
    """Forked by the warm process where it suits the command; else Popen in a new session, the
    child entering the attempt's cgroup (if any) before exec."""
    if warm is not None and warm.suits(argv, env):
        cgroup = containment.cgroup
        try:
            proc, entered = warm.start(argv, cwd, env, cgroup.fd if cgroup is not None else None)
        except OSError as exc:
            print(
                f"warning: {argv[3]}: the warm process failed ({exc}); a fresh interpreter instead",
                file=sys.stderr,
            )
        else:
            if not entered:
                containment.drop_cgroup()
            return proc
    kwargs: dict[str, Any] = dict(
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # own session and group
    )
    preexec = containment.preexec()
    if preexec is None:
        return subprocess.Popen(argv, **kwargs)
    try:
        return subprocess.Popen(argv, preexec_fn=preexec, **kwargs)
    except subprocess.SubprocessError:  # the cgroup refused the move: the other nets remain
        containment.drop_cgroup()
        return subprocess.Popen(argv, **kwargs)


class Tail:
    """The last TAIL_BYTES of the test's output: memory stays bounded whatever it prints,
    one 200 MB line included (it is read in chunks, never as a line)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._lock = threading.Lock()

    def add(self, chunk: bytes) -> None:
        with self._lock:
            self._buf += chunk
            if len(self._buf) > 2 * TAIL_BYTES:
                del self._buf[: len(self._buf) - TAIL_BYTES]

    def text(self) -> str:
        """The last TAIL_LINES lines, at most TAIL_CHARS characters."""
        with self._lock:
            raw = bytes(self._buf[-TAIL_BYTES:])
        text = raw.decode("utf-8", errors="replace")
        return "".join(text.splitlines(keepends=True)[-TAIL_LINES:])[-TAIL_CHARS:]


def _pump(stream: IO[bytes], log: IO[bytes], tail: Tail, echo: IO[str] | None) -> None:
    """Copy the test's output to its log file, the tail buffer and (optionally) the console,
    in chunks of at most PUMP_CHUNK bytes."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    try:
        fd = stream.fileno()
        while chunk := os.read(fd, PUMP_CHUNK):
            log.write(chunk)
            tail.add(chunk)
            if echo is not None:
                echo.write(decoder.decode(chunk))
                echo.flush()
        log.flush()
    except (OSError, ValueError):
        pass  # the log was closed under us: a process the sweep could not stop held the pipe
    finally:
        stream.close()


def _readable(fds: list, timeout: float) -> None:
    """Block until one of `fds` is readable or `timeout` seconds pass. poll(), not select(): a
    process holding over 1024 descriptors (a long pytest session) gets numbers select refuses."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(max(timeout, 0.0) * 1000)


def _wait(
    proc: subprocess.Popen,
    clock: LoadClock,
    cancel: CancelToken,
    tick: Callable[[float], None] | None,
    started: float,
) -> str:
    """Block until the process exits ("exited"), its time runs out ("timeout") or the run
    is cancelled ("cancelled"). A pidfd makes the exit visible at once and the cancel
    token's pipe the cancel; polling is the fallback where the kernel has no pidfd."""
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
            if clock.expired(now):
                return "timeout"
            step = min(clock.left(now), POLL_S)
            if pidfd is not None:
                _readable([pidfd, cancel], step)
            else:
                _readable([cancel], min(step, 0.01))
            if tick is not None:
                tick(time.monotonic() - started)
    finally:
        if pidfd is not None:
            os.close(pidfd)
