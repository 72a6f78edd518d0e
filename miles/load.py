"""Time counted at the machine's load, for timeouts that a busy machine must not trip.

A shared 2-core machine runs a test several times slower than a quiet one, and that is not a
hang. A `LoadClock` counts each wall second as 1 / max(1, load average / cores) of its limit, so
its limit stretches while the machine is loaded, and at most `stretch` times the limit passes in
wall time whatever the load (a hung process still ends). Standard library only.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence

_POLL_S = 2.0  # how often a counted wait looks at the load


def _cores() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


class LoadClock:
    """A limit of `limit` seconds counted at the machine's load, from `started` (monotonic time):
    each wall second counts 1 / max(1, load average / cores), and at most `stretch` x `limit`
    passes in wall time whatever the load. A quiet machine counts every second in full, and so
    does a clock with `stretch` 1."""

    def __init__(
        self,
        limit: float,
        stretch: float,
        started: float,
        cores: int | None = None,
        load: Callable[[], float] | None = None,
    ) -> None:
        self.limit, self.stretch = limit, max(1.0, stretch)
        self.load = load or load_average
        self.cores = cores or _cores()
        self.peak = 0.0
        self.restart(started)

    def restart(self, now: float) -> None:
        """Count the limit afresh from `now` (a watchdog that saw progress)."""
        self.started = self.last = now
        self.counted = 0.0

    def expired(self, now: float) -> bool:
        step, self.last = now - self.last, now
        if self.stretch == 1.0:
            self.counted += step
        else:
            load = self.load()
            self.peak = max(self.peak, load)
            self.counted += step / min(self.stretch, max(1.0, load / self.cores))
        return self.counted >= self.limit or now - self.started >= self.limit * self.stretch

    def left(self, now: float) -> float:
        return max(0.0, self.limit - self.counted)

    @property
    def stretched(self) -> bool:
        """Whether more wall time than the limit passed (the load stretched it)."""
        return self.last - self.started > self.limit + 1


def run_counted(
    cmd: Sequence[str],
    timeout: float,
    *,
    stretch: float = 10.0,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) with `timeout` counted at the machine's
    load (at most `stretch` x `timeout` in wall time): subprocess.TimeoutExpired, with the output
    so far, when it runs out; the process is killed first."""
    clock = LoadClock(timeout, stretch, time.monotonic())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    while True:
        try:
            out, err = proc.communicate(timeout=_POLL_S)
            return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        except subprocess.TimeoutExpired:
            if clock.expired(time.monotonic()):
                proc.kill()
                out, err = proc.communicate()
                raise subprocess.TimeoutExpired(cmd, clock.last - clock.started, out, err) from None
