"""Time counted at the machine's load, for timeouts that a busy machine must not trip.

A shared 2-core machine runs a test several times slower than a quiet one, and that is not a
hang. A `LoadClock` counts each wall second as 1 / max(1, load average / cores) of its limit, so
its limit stretches while the machine is loaded, and at most `stretch` times the limit passes in
wall time whatever the load (a hung process still ends). Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Callable


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
