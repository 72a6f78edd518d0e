"""`python -m miles.ci run`: plan a lane's suites into shards, run this invocation's shard
test file by test file, retry infrastructure failures, gate, report.

    options -> build_plan() -> RunPlan -> format_plan()        (--plan stops here)
                                       -> execute_plan() -> RunRecord -> reports, durations

Planning reads only the catalog and the tests' syntax trees, so `--plan` works on any
machine with nothing heavy installed. A SIGTERM or SIGINT to the runner stops the running
test's whole process group, marks what did not finish `cancelled`, still writes every
report, and exits 1.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from miles.ci.catalog import Catalog, Lane, Suite
from miles.ci.discover import Discovery
from miles.ci.execute import (
    CancelToken,
    Settings,
    TestRun,
    format_command,
    is_retryable,
    pytest_command,
    run_attempt,
)
from miles.ci.policy import effective_cadence, parse_labels
from miles.ci.record import CANCELLED, FAILED, PASSED, SKIPPED, Attempt, RunRecord
from miles.ci.registration import Registration
from miles.ci.select import Selection, default_cadence, resolve_scope, select
from miles.ci.shard import Job, Partition, balanced_partition, shards_for_budget

DEFAULT_TIMEOUT_FLOOR = 60.0  # seconds; short tests still get time to import torch
DEFAULT_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
TIMEOUT_FACTOR = 1.25


class PlanError(ValueError):
    """The run cannot be planned from this input (exit 2)."""


@dataclass(frozen=True)
class RunOptions:
    root: Path = Path(".")
    lane: str | None = None
    backend: str | None = None
    suites: tuple[str, ...] = ()
    cadence: str | None = None
    labels: str | None = None  # raw PR labels; None = not given (every label admitted)
    shard: str | None = None  # "k/N" or "k/auto"
    shards: str | None = None  # "N" or "auto": how many shards the plan splits each suite into
    max_attempts: int | None = None  # default: the lane's
    continue_on_error: bool = False
    timeout_floor: float = DEFAULT_TIMEOUT_FLOOR
    grace: float = DEFAULT_GRACE
    report_dir: Path | None = None
    stream: bool | None = None  # echo test output live; default: on under GitHub Actions
    pytest_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlannedTest:
    registration: Registration
    lane: str
    shard: int
    n_shards: int
    timeout: float

    @property
    def shard_label(self) -> str:
        return f"{self.shard}/{self.n_shards}"


@dataclass(frozen=True)
class SuitePlan:
    suite: Suite
    n_shards: int
    how: str  # where the shard count came from
    partition: Partition
    run_shards: tuple[int, ...]  # 1-based shards this invocation runs


@dataclass(frozen=True)
class RunPlan:
    selection: Selection
    suites: tuple[SuitePlan, ...]
    tests: tuple[PlannedTest, ...]  # what this invocation runs, in order
    shard: str  # "k/N", or "all"
    report_dir: Path
    max_attempts: int
    continue_on_error: bool
    settings: Settings = field(repr=False)
    timeout_floor: float = DEFAULT_TIMEOUT_FLOOR


def timeout_for(est_time: float, floor: float) -> float:
    """The per-file limit: est_time x 1.25, but never below the floor."""
    return max(floor, TIMEOUT_FACTOR * est_time)


def parse_shard(text: str) -> tuple[int, int | None]:
    """ "k/N" -> (k, N); "k/auto" -> (k, None). Raises PlanError."""
    k_text, sep, n_text = text.partition("/")
    try:
        k = int(k_text)
        n = None if n_text == "auto" else int(n_text)
    except ValueError:
        raise PlanError(f"--shard {text!r} must look like k/N (1-based, e.g. 2/3) or k/auto") from None
    if not sep or k < 1 or (n is not None and not 1 <= k <= n):
        raise PlanError(f"--shard {text!r}: need 1 <= k <= N")
    return k, n


def parse_shards(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise PlanError(f"--shards {text!r} must be a positive number or 'auto'") from None
    if n < 1:
        raise PlanError(f"--shards {text!r} must be >= 1")
    return n


def _shard_count(suite: Suite, jobs: list[Job], requested: int | None, explicit: bool) -> tuple[int, str]:
    if explicit and requested is not None:
        return requested, "requested"
    if suite.budget_s is not None:
        return shards_for_budget(jobs, suite.budget_s), f"auto: budget {suite.budget_s:g}s per shard"
    return suite.shards or 1, "catalog"


def build_plan(options: RunOptions, catalog: Catalog, discovery: Discovery) -> RunPlan:
    """Everything the run will do, computed without running anything."""
    if discovery.problems:
        lines = "\n".join(f"  {p}" for p in discovery.problems)
        raise PlanError(f"{len(discovery.problems)} registration problem(s); fix them first:\n{lines}")
    scope = resolve_scope(catalog, lane=options.lane, backend=options.backend, suites=options.suites)
    labels = parse_labels(options.labels, catalog) if options.labels is not None else None
    cadence = effective_cadence(options.cadence or default_cadence(scope), labels)
    selection = select(discovery, scope, cadence=cadence, labels=labels)

    k, n_requested, explicit = None, None, False
    if options.shard is not None:
        k, n_requested = parse_shard(options.shard)
        explicit = n_requested is not None
        if options.shards is not None and parse_shards(options.shards) != n_requested:
            raise PlanError(f"--shard {options.shard} and --shards {options.shards} disagree; give one")
    elif options.shards is not None:
        n_requested = parse_shards(options.shards)
        explicit = n_requested is not None

    suite_plans, tests = [], []
    for suite in scope.suites:
        regs = {r.file: r for r in selection.of_suite(suite.name)}
        jobs = [Job(r.file, r.est_time) for r in regs.values()]
        n, how = _shard_count(suite, jobs, n_requested, explicit)
        partition = balanced_partition(jobs, n)
        run_shards = tuple(range(1, n + 1)) if k is None else ((k,) if k <= n else ())
        suite_plans.append(SuitePlan(suite, n, how, partition, run_shards))
        for index in run_shards:
            # Shortest first: quick feedback, and fast-fail spares the expensive tests.
            for job in sorted(partition.shards[index - 1], key=lambda j: (j.weight, j.key)):
                reg = regs[job.key]
                tests.append(
                    PlannedTest(
                        reg, scope.lane_of(suite), index, n, timeout_for(reg.est_time, options.timeout_floor)
                    )
                )

    if options.shard is not None:
        shard = options.shard
    elif all(p.n_shards == 1 for p in suite_plans):
        shard = "1/1"
    else:
        shard = "all"
    tag = shard.replace("/", "of")
    root = options.root.resolve()
    report_dir = options.report_dir or Path(".miles") / "reports" / f"{scope.name}-{tag}"
    report_dir = report_dir if report_dir.is_absolute() else root / report_dir
    lane_attempts = (
        scope.lane.max_attempts
        if scope.lane
        else max((catalog.lanes[s.lane].max_attempts for s in scope.suites), default=1)
    )
    max_attempts = options.max_attempts if options.max_attempts is not None else lane_attempts
    if max_attempts < 1:
        raise PlanError(f"--max-attempts {max_attempts} must be >= 1")
    continue_on_error = options.continue_on_error or bool(labels and labels.bypass_fastfail)
    stream = options.stream if options.stream is not None else os.environ.get("GITHUB_ACTIONS") == "true"
    settings = Settings(
        root=root,
        grace=options.grace,
        pytest_args=options.pytest_args,
        echo=sys.stdout if stream else None,
    )
    return RunPlan(
        selection,
        tuple(suite_plans),
        tuple(tests),
        shard,
        report_dir,
        max_attempts,
        continue_on_error,
        settings,
        options.timeout_floor,
    )


def attempt_dir(plan: RunPlan, test: PlannedTest, attempt: int) -> Path:
    slug = test.registration.file.replace("/", "__").removesuffix(".py")
    return plan.report_dir / "attempts" / test.registration.suite / slug / str(attempt)


def _test_run(
    plan: RunPlan, test: PlannedTest, attempt: int, retry_reason: str | None, commit: str
) -> TestRun:
    reg = test.registration
    return TestRun(
        file=reg.file,
        backend=reg.backend,
        suite=reg.suite,
        lane=test.lane,
        shard=test.shard_label,
        est_time=reg.est_time,
        timeout=test.timeout,
        attempt=attempt,
        retry_reason=retry_reason,
        commit=commit,
    )


def format_plan(plan: RunPlan) -> str:
    """The plan as people read it: shards, predicted totals, bounds, timeouts, commands."""
    sel = plan.selection
    labels = "(not given: every label admitted)" if sel.labels is None else str(sel.labels)
    out = [
        f"plan · {sel.scope.name} · backend {sel.scope.backend} · cadence {sel.cadence} · labels {labels} · "
        f"shard {plan.shard} · max attempts {plan.max_attempts} · "
        f"{'continue on error' if plan.continue_on_error else 'fast-fail'}"
    ]
    for sp in plan.suites:
        p = sp.partition
        total = sum(p.loads)
        longest = max((j.weight for s in p.shards for j in s), default=0.0)
        n_tests = sum(len(s) for s in p.shards)
        out.append("")
        out.append(
            f"suite {sp.suite.name}: {n_tests} test(s), {sp.n_shards} shard(s) ({sp.how}), total est {total:g}s"
        )
        if n_tests:
            out.append(
                f"  lower bound {p.lower_bound:.0f}s = max(total/N {total / sp.n_shards:.0f}s, longest {longest:g}s); "
                f"predicted makespan {p.makespan:.0f}s; ratio {p.ratio:.3f} ({p.method}"
                f"{', optimal' if p.optimal else ''})"
            )
        for index, shard in enumerate(p.shards, start=1):
            here = " ← this run" if index in sp.run_shards else ""
            out.append(
                f"  shard {index}/{sp.n_shards}: {len(shard)} test(s), predicted {p.loads[index - 1]:g}s{here}"
            )
            for job in sorted(shard, key=lambda j: (j.weight, j.key)):
                limit = timeout_for(job.weight, plan.timeout_floor)
                out.append(f"    est {job.weight:>6g}s  timeout {limit:>6g}s  {job.key}")
        if not sp.run_shards and plan.shard != "all":
            out.append(
                f"  shard {plan.shard} asked, but this suite has {sp.n_shards}: nothing of it runs here"
            )
        for e in (e for e in sel.excluded if e.suite == sp.suite.name):
            out.append(f"  not run ({e.kind}): {e.file}: {e.reason}")
    if plan.tests:
        out += ["", "commands (attempt 1; cwd = project root):"]
        for test in plan.tests:
            run = _test_run(plan, test, 1, None, "")
            junit = attempt_dir(plan, test, 1) / "junit.xml"
            env = run.env(attempt_dir(plan, test, 1) / "metrics")
            out.append(f"  {format_command(pytest_command(plan.settings, run.file, junit), env)}")
    else:
        out += ["", "nothing to run in this shard."]
    out.append(f"reports: {plan.report_dir}/{{junit.xml,summary.md,run.json}}")
    return "\n".join(out) + "\n"


def apply_gates(
    attempt: Attempt,
    registration: Registration,
    lane: Lane,
    *,
    cadence: str | None = None,
    root: Path = Path("."),
) -> Attempt:
    """The metric-gate step for a passing attempt: gate its metric records (in
    `attempt.record_dir`) against the history store and return it with `gate_verdicts`
    filled, and with status `failed` when an enforced gate (enforce lane, or a declaration
    with enforce=True) fails or cannot reach the store. A nightly/weekly `cadence` stores the
    run as history. Files without register_ci_gate(...) are returned unchanged."""
    from miles.ci.catalog import load_catalog
    from miles.ci.discover import parse_test_file
    from miles.metrics.gating import GateRun, ci_identity, gate_attempt

    test_file, _ = parse_test_file(Path(root) / registration.file, registration.file, load_catalog())
    if not test_file.gates:
        return attempt
    pr, ci_run_id = ci_identity()
    run = GateRun(
        attempt.file, attempt.backend, attempt.suite, lane.name, cadence or lane.cadence,
        lane.gate_mode == "enforce", attempt.commit or None, pr, ci_run_id,
    )  # fmt: skip
    outcome = gate_attempt(
        attempt.record_dir, test_file.gates, run, write_baseline=attempt.status == PASSED, root=root
    )
    for warning in outcome.warnings:
        print(f"{attempt.file}: {warning}", file=sys.stderr)
    if outcome.failed:
        return attempt.replace(
            gate_verdicts=outcome.verdicts, status=FAILED, classification="gate", message=outcome.message
        )
    return attempt.replace(gate_verdicts=outcome.verdicts)


def current_commit(root: Path) -> str:
    if os.environ.get("GITHUB_SHA"):
        return os.environ["GITHUB_SHA"]
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _not_run(plan: RunPlan, test: PlannedTest, status: str, message: str, commit: str) -> Attempt:
    run = _test_run(plan, test, 1, None, commit)
    return Attempt(
        file=run.file,
        backend=run.backend,
        suite=run.suite,
        lane=run.lane,
        shard=run.shard,
        attempt=1,
        status=status,
        exit_code=None,
        signal=None,
        elapsed=0.0,
        est_time=run.est_time,
        retry_reason=None,
        classification="cancelled" if status == CANCELLED else "fast-fail",
        commit=commit,
        started_at=time.time(),
        timeout=test.timeout,
        message=message,
    )


def execute_plan(
    plan: RunPlan, catalog: Catalog, cancel: CancelToken, out: IO[str] | None = None
) -> RunRecord:
    """Run the plan's tests in order; always returns a complete record (cancellation included)."""
    out = out if out is not None else sys.stdout
    for name in ("attempts", "junit.xml", "summary.md", "run.json"):  # a rerun starts clean
        path = plan.report_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    commit = current_commit(plan.settings.root)
    started = time.time()
    github = os.environ.get("GITHUB_ACTIONS") == "true"
    progress = Progress(plan.tests, out, github=github, streaming=plan.settings.echo is not None)
    attempts: list[Attempt] = []
    stop: str | None = None
    for index, test in enumerate(plan.tests):
        if cancel.cancelled:
            attempts.append(
                _not_run(plan, test, CANCELLED, f"not started: run cancelled by {cancel.name}", commit)
            )
            continue
        if stop is not None:
            attempts.append(_not_run(plan, test, SKIPPED, stop, commit))
            continue
        retry_reason = None
        for number in range(1, plan.max_attempts + 1):
            run = _test_run(plan, test, number, retry_reason, commit)
            progress.start(index, run)
            attempt = run_attempt(run, attempt_dir(plan, test, number), plan.settings, cancel, progress.tick)
            if attempt.status == PASSED:
                attempt = apply_gates(
                    attempt,
                    test.registration,
                    catalog.lanes[test.lane],
                    cadence=plan.selection.cadence,
                    root=plan.settings.root,
                )
            progress.finish(index, attempt)
            attempts.append(attempt)
            if attempt.ok or cancel.cancelled or not is_retryable(attempt.classification):
                break
            retry_reason = f"attempt {number} failed with {attempt.classification}: {attempt.message}"
            if number < plan.max_attempts:
                out.write(f"retrying {run.file}: {attempt.classification} counts as infrastructure\n")
        if not attempt.ok and not cancel.cancelled and not plan.continue_on_error:
            stop = f"not run: fast-fail after {test.registration.file} ended {attempt.status}"
    sel = plan.selection
    lanes = {sel.scope.lane_of(s) for s in sel.scope.suites}
    return RunRecord(
        lane=lanes.pop() if len(lanes) == 1 else "",
        backend=sel.scope.backend,
        suites=tuple(sp.suite.name for sp in plan.suites),
        shard=plan.shard,
        cadence=sel.cadence,
        labels=None if sel.labels is None else sel.labels.raw,
        commit=commit,
        started_at=started,
        finished_at=time.time(),
        attempts=tuple(attempts),
        excluded=sel.excluded,
        cancelled_by=cancel.name or None,
        report_dir=str(plan.report_dir),
    )


@contextmanager
def cancel_on_signals(cancel: CancelToken) -> Iterator[None]:
    """SIGTERM/SIGINT set the token instead of killing the runner, so it can clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        cancel.cancel(signum)
        print(
            f"\nmiles ci: received {signal.Signals(signum).name}; stopping the running test", file=sys.stderr
        )

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def run(options: RunOptions, *, plan_only: bool = False, out: IO[str] | None = None) -> int:
    """Plan, print the plan, and (unless plan_only) run it; returns the exit code."""
    out = out if out is not None else sys.stdout
    from miles.ci.catalog import load_catalog
    from miles.ci.discover import discover

    catalog = load_catalog()
    plan = build_plan(options, catalog, discover(options.root, catalog=catalog))
    out.write(format_plan(plan))
    out.flush()
    if plan_only:
        return 0
    from miles.ci.durations import durations_path, record_durations
    from miles.ci.report import write_reports

    cancel = CancelToken()
    with cancel_on_signals(cancel):
        record = execute_plan(plan, catalog, cancel, out)
        paths = write_reports(record, plan.report_dir)
        try:
            record_durations(record.attempts, durations_path(plan.settings.root))
        except (OSError, ValueError, TimeoutError) as exc:
            print(f"warning: durations not stored: {exc}", file=sys.stderr)
    counts = record.counts()
    summary = ", ".join(
        f"{counts[k]} {k}"
        for k in ("passed", "failed", "timeout", "error", "cancelled", "skipped")
        if counts[k]
    )
    out.write(f"\n{'PASSED' if record.passed else 'FAILED'}: {summary or 'nothing ran'}\n")
    for name, path in paths.items():
        out.write(f"{name:>10}: {path}\n")
    out.flush()
    return record.exit_code


class Progress:
    """What a person watching the run sees: a live line with ETA (from est_times) in a
    terminal, `::group::` folds per test under GitHub Actions, plain lines elsewhere."""

    def __init__(self, tests: tuple[PlannedTest, ...], out: IO[str], *, github: bool, streaming: bool):
        self.tests = tests
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
        return _short(left)

    def start(self, index: int, run: TestRun) -> None:
        self.index, self.run = index, run
        self.done = sum(t.registration.est_time for t in self.tests[:index])
        again = f", attempt {run.attempt}" if run.attempt > 1 else ""
        head = (
            f"[{index + 1}/{len(self.tests)}] {run.file} ({run.suite}, shard {run.shard}, "
            f"est {run.est_time:g}s, timeout {run.timeout:g}s{again})"
        )
        if self.github:
            self._write(f"::group::{head}\n")
        elif self.tty:
            self._draw(0.0)
        else:
            self._write(f"start  {head}\n")

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
        why = f" · {attempt.classification}: {attempt.message}" if not attempt.ok else ""
        verdicts = f" · {len(attempt.gate_verdicts)} gate verdict(s)" if attempt.gate_verdicts else ""
        self._write(
            f"{icon:<9} {attempt.file} [{attempt.suite} {attempt.shard}] {attempt.elapsed:.1f}s "
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
