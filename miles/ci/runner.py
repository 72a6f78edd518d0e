"""`python -m miles.ci run`: plan a lane's suites into shards, run this invocation's shard
test file by test file, retry infrastructure failures, gate, report.

    options -> build_plan() -> RunPlan -> format_plan()        (--plan stops here; miles.ci.plan)
                                       -> execute_plan() -> RunRecord -> reports, durations

A SIGTERM or SIGINT to the runner stops the running
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from miles.ci.catalog import Catalog, Lane
from miles.ci.execute import CancelToken, run_attempt
from miles.ci.outcome import is_retryable
from miles.ci.plan import (
    PlanError,
    PlannedTest,
    RunOptions,
    RunPlan,
    attempt_dir,
    build_plan,
    format_plan,
    test_run,
)
from miles.ci.progress import Progress
from miles.ci.record import CANCELLED, FAILED, FLAKY, PASSED, SKIPPED, Attempt, RunRecord
from miles.ci.registration import GateDeclaration
from miles.ci.report import REPORT_FILES, write_reports


def apply_gates(
    attempt: Attempt,
    gates: tuple[GateDeclaration, ...],
    lane: Lane,
    *,
    cadence: str | None = None,
    store_history: bool = False,
    root: Path = Path("."),
) -> Attempt:
    """The metric-gate step for a passing attempt: gate its metric records (in
    `attempt.record_dir`) against the history store and return it with `gate_verdicts`
    filled, and with status `failed` when an enforced gate (enforce lane, or a declaration
    with enforce=True) fails or cannot reach the store. The run is stored as history only
    with `store_history` (policy.stores_history said so for this run's event and cadence).
    An attempt of a file without register_ci_gate(...) is returned unchanged."""
    if not gates:
        return attempt
    from miles.metrics.gating import GateRun, ci_identity, gate_attempt

    pr, ci_run_id = ci_identity()
    run = GateRun(
        attempt.file, attempt.backend, attempt.suite, lane.name, cadence or lane.cadence,
        lane.gate_mode == "enforce", attempt.commit or None, pr, ci_run_id,
    )  # fmt: skip
    outcome = gate_attempt(attempt.record_dir, gates, run, write_baseline=store_history, root=root)
    for warning in outcome.warnings:
        print(f"{attempt.file}: {warning}", file=sys.stderr)
    verdicts = tuple(v.to_json() for v in outcome.verdicts)
    if outcome.failed:
        return attempt.replace(
            gate_verdicts=verdicts, status=FAILED, classification="gate", message=outcome.message
        )
    return attempt.replace(gate_verdicts=verdicts)


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
    classification = "cancelled" if status == CANCELLED else "fast-fail"
    return test_run(plan, test, 1, None, commit).record(status, classification, message=message)


UNFINISHED = "unfinished: the runner stopped (killed or interrupted) before this test ended"
NEVER_REACHED = "not started: the runner stopped before reaching this test"


def _gate_safely(attempt: Attempt, plan: RunPlan, test: PlannedTest, catalog: Catalog) -> Attempt:
    """The gate step; whatever goes wrong in it (a record no parser expected, a store driver's
    surprise) fails this attempt with the reason instead of ending the run."""
    try:
        return apply_gates(
            attempt,
            test.gates,
            catalog.lanes[test.lane],
            cadence=plan.selection.cadence,
            store_history=plan.store_history,
            root=plan.settings.root,
        )
    except Exception as exc:  # one test's gate must not stop the others
        from miles.metrics.store import resolve_url, scrub

        reason = scrub(f"{type(exc).__name__}: {exc}", resolve_url(None, root=plan.settings.root))
        reason = " ".join(reason.split())[:500]
        return attempt.replace(status=FAILED, classification="gate", message=f"metric gate error: {reason}")


def execute_plan(
    plan: RunPlan,
    catalog: Catalog,
    cancel: CancelToken,
    out: IO[str] | None = None,
    checkpoint: Callable[[RunRecord], None] | None = None,
) -> RunRecord:
    """Run the plan's tests in order; always returns a complete record (cancellation included).

    `checkpoint` receives an incomplete record before each attempt starts (the running test
    and the rest marked as not finished) and again the moment a cancel arrives, so reports
    on disk always describe the run even if the runner is killed without warning."""
    out = out if out is not None else sys.stdout
    for name in ("attempts", *REPORT_FILES):  # a rerun starts clean
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

    def record(done: list[Attempt], *, complete: bool = True) -> RunRecord:
        return _run_record(plan, done, started, commit, cancel.name or None, complete)

    def provisional(index: int, current: Attempt, rest_message: str) -> None:
        if checkpoint is None:
            return
        rest = [_not_run(plan, t, CANCELLED, rest_message, commit) for t in plan.tests[index + 1 :]]
        checkpoint(record([*attempts, current, *rest], complete=False))

    for index, test in enumerate(plan.tests):
        if cancel.cancelled:
            attempts.append(
                _not_run(plan, test, CANCELLED, f"not started: run cancelled by {cancel.name}", commit)
            )
            continue
        if stop is not None:
            attempts.append(_not_run(plan, test, SKIPPED, stop, commit))
            continue
        retry_reason, first_failure = None, ""
        for number in range(1, plan.max_attempts + 1):
            run = test_run(plan, test, number, retry_reason, commit)
            provisional(index, run.record(CANCELLED, "unfinished", message=UNFINISHED), NEVER_REACHED)
            progress.start(index, run)
            attempt = run_attempt(
                run,
                attempt_dir(plan, test, number),
                plan.settings,
                cancel,
                progress.tick,
                on_cancel=lambda a, i=index: provisional(
                    i, a, f"not started: run cancelled by {cancel.name}"
                ),
            )
            if attempt.status == PASSED:
                attempt = _gate_safely(attempt, plan, test, catalog)
            if attempt.status == PASSED and number > 1:
                # It failed as infrastructure and then passed: say so, it is not a plain pass.
                attempt = attempt.replace(
                    status=FLAKY,
                    classification="flaky",
                    message=f"passed on attempt {number} after {first_failure}",
                )
            progress.finish(index, attempt)
            attempts.append(attempt)
            if attempt.ok or cancel.cancelled or not is_retryable(attempt.classification):
                break
            first_failure = first_failure or f"{attempt.classification}: {attempt.message}"
            retry_reason = f"attempt {number} failed with {attempt.classification}: {attempt.message}"
            if number < plan.max_attempts:
                out.write(f"retrying {run.file}: {attempt.classification} counts as infrastructure\n")
        if not attempt.ok and not cancel.cancelled and not plan.continue_on_error:
            stop = f"not run: fast-fail after {test.registration.file} ended {attempt.status}"
    return record(attempts)


def _run_record(
    plan: RunPlan,
    attempts: list[Attempt],
    started: float,
    commit: str,
    cancelled_by: str | None,
    complete: bool,
) -> RunRecord:
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
        cancelled_by=cancelled_by,
        report_dir=str(plan.report_dir),
        complete=complete,
    )


@contextmanager
def cancel_on_signals(cancel: CancelToken) -> Iterator[None]:
    """SIGTERM/SIGINT set the token instead of killing the runner, so it can clean up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        cancel.cancel(signum)
        # os.write, not print: the handler may interrupt a print to the same stream
        name = signal.Signals(signum).name
        os.write(2, f"\nmiles ci: received {name}; stopping the running test\n".encode())

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
    from miles.ci.durations import check_store_settings
    from miles.metrics.store import StoreError

    try:  # a store setting that would leak its password or pick a wrong store stops here
        check_store_settings(options.root)
    except StoreError as exc:
        raise PlanError(str(exc)) from None
    catalog = load_catalog()
    plan = build_plan(options, catalog, discover(options.root, catalog=catalog))
    out.write(format_plan(plan))
    out.flush()
    if plan_only:
        return 0
    try:
        plan.report_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlanError(f"--report-dir {plan.report_dir}: cannot create it ({exc.strerror})") from None
    from miles.ci.durations import durations_path, record_durations

    cancel = CancelToken()
    with cancel_on_signals(cancel):
        record = execute_plan(
            plan,
            catalog,
            cancel,
            out,
            checkpoint=lambda partial: write_reports(partial, plan.report_dir, step_summary=False),
        )
        paths = write_reports(record, plan.report_dir)
        try:
            record_durations(record.attempts, durations_path(plan.settings.root))
        except (OSError, ValueError, TimeoutError, StoreError) as exc:
            print(f"warning: durations not stored: {exc}", file=sys.stderr)
    counts = record.counts()
    summary = ", ".join(
        f"{counts[k]} {k}"
        for k in ("passed", "flaky", "failed", "timeout", "error", "cancelled", "skipped")
        if counts[k]
    )
    out.write(f"\n{'PASSED' if record.passed else 'FAILED'}: {summary or 'nothing ran'}\n")
    for name, path in paths.items():
        out.write(f"{name:>10}: {path}\n")
    out.flush()
    return record.exit_code
