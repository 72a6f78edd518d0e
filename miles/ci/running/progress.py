"""What a person watching a run sees: a live line with ETA in a terminal, `::group::`
folds per test under GitHub Actions, plain lines elsewhere."""

from __future__ import annotations

from typing import IO

from miles.ci.reports.record import Attempt
from miles.ci.reports.summary import printable
from miles.ci.running.execute import TestRun
from miles.ci.running.plan import PlannedTest


class Progress:
    """Draws the run as it goes; the ETA counts the est_times of the tests still to run, shared
    among `jobs` jobs taking them from one queue."""

    def __init__(
        self, tests: tuple[PlannedTest, ...], out: IO[str], *, github: bool, streaming: bool, jobs: int = 1
    ):
        self.tests = tests
        self.jobs = jobs
        self.out = out
        self.github = github
        self.streaming = streaming
        self.tty = not github and hasattr(out, "isatty") and out.isatty()
        self.total = sum(t.registration.est_time for t in tests)
        self.done = 0.0
        self.run: TestRun | None = None
        self.index = 0
        self.last_draw = -1

    def _eta(self, elapsed: float) -> str:
        current = self.run.est_time if self.run else 0.0
        left = max(0.0, self.total - self.done - min(elapsed, current))
        return _short(left / self.jobs)

    def start(self, index: int, run: TestRun) -> None:
        self.index, self.run = index, run
        self.done = sum(t.registration.est_time for t in self.tests[:index])
        again = f", attempt {run.attempt}" if run.attempt > 1 else ""
        head = (
            f"[{index + 1}/{len(self.tests)}] {run.file} ({run.suite}, shard {run.shard}, "
            f"est {run.est_time:g}s, timeout {run.timeout:g}s{again})"
        )
        if self.github:
            # a workflow command's value escapes %, CR and LF, so a file name cannot end the
            # group line and start a command of its own
            title = head.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
            self._write(f"::group::{title}\n")
        elif self.tty:
            self._draw(0.0)
        else:
            self._write(f"start  {printable(head)}\n")

    def tick(self, elapsed: float) -> None:
        if self.tty and int(elapsed) != self.last_draw:  # redraw once per displayed second
            self._draw(elapsed)

    def _draw(self, elapsed: float) -> None:
        self.last_draw = int(elapsed)
        run = self.run
        share = (self.done + min(elapsed, run.est_time)) / self.total if self.total else 1.0
        self._write(
            f"\r\x1b[K[{self.index + 1}/{len(self.tests)} · {share:4.0%} · ETA {self._eta(elapsed)}] "
            f"{run.file} {elapsed:.0f}s / est {run.est_time:g}s"
        )

    def finish(self, index: int, attempt: Attempt) -> None:
        if self.github:
            self._write("::endgroup::\n")
        elif self.tty:
            self._write("\r\x1b[K")
        icon = {"passed": "ok", "skipped": "skip"}.get(attempt.status, attempt.status.upper())
        why = f" · {attempt.classification}: {printable(attempt.message)}" if not attempt.ok else ""
        verdicts = f" · {len(attempt.gate_verdicts)} gate verdict(s)" if attempt.gate_verdicts else ""
        self._write(
            f"{icon:<9} {printable(attempt.file)} [{attempt.suite} {attempt.shard}] {attempt.elapsed:.1f}s "
            f"(est {attempt.est_time:g}s){why}{verdicts} · ETA {self._eta(attempt.est_time)}\n"
        )
        if not attempt.ok and not self.streaming and attempt.output_tail.strip():
            lines = attempt.output_tail.rstrip("\n").splitlines()[-30:]
            self._write("".join(f"    | {line}\n" for line in lines))

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def _short(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{sec:02d}s"
