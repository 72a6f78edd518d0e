"""`python -m miles.ci run`: plan a lane's suites into shards, run this invocation's shard
test file by test file, retry infrastructure failures, gate, report.

    options -> build_plan() -> RunPlan -> format_plan()        (--plan stops here; miles.ci.running.plan)
                                       -> execute_plan() -> RunRecord -> reports, durations

A SIGTERM or SIGINT to the runner stops the running
test's whole process group, marks what did not finish `cancelled`, still writes every
report, and exits 1, within the grace period whatever step it is in: the gate step and the
duration store run on a helper thread the runner stops waiting for.

The runner writes only inside the report folder's files and the attempts/ folder it makes
afresh for each run (miles.ci.reports.report.claim_report_dir), each file created exclusively.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TypeVar

from miles.ci.registry.catalog import Catalog, Lane
from miles.ci.registry.registration import GateDeclaration
from miles.ci.reports.phases import text_table as phase_table
from miles.ci.reports.record import CANCELLED, FAILED, FLAKY, PASSED, SKIPPED, Attempt, RunRecord
from miles.ci.reports.report import ReportDirError, claim_report_dir, write_reports
from miles.ci.running.claims import Claims
from miles.ci.running.execute import POLL_S, CancelToken, TestRun, run_attempt
from miles.ci.running.outcome import is_retryable
from miles.ci.running.plan import (
    PlanError,
    PlannedTest,
    RunOptions,
    RunPlan,
    attempt_name,
    build_plan,
    format_plan,
    test_run,
)
from miles.ci.running.progress import Progress
from miles.files import Folder
from miles.text import printable

T = TypeVar("T")


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


def _not_run(
    plan: RunPlan, test: PlannedTest, status: str, message: str, commit: str, shard: str | None = None
) -> Attempt:
    classification = "cancelled" if status == CANCELLED else "fast-fail"
    run = test_run(plan, test, 1, None, commit)
    run = run if shard is None else dataclasses.replace(run, shard=shard)
    return run.record(status, classification, message=message)


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


class Abandoned(Exception):
    """A step the runner stopped waiting for: the run was cancelled and it did not end in time."""


def call_bounded(fn: Callable[[], T], cancel: CancelToken, grace: float) -> T:
    """fn() on a helper thread. Once the run is cancelled, fn gets `grace` more seconds (none
    after a second signal), then the runner goes on without it (Abandoned); the thread is a
    daemon and ends with the runner. fn's own exception is re-raised here."""
    box: dict[str, object] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=target, name="miles-ci-step", daemon=True).start()
    while not done.wait(POLL_S):
        if cancel.cancelled:
            deadline = time.monotonic() + grace
            while not done.wait(POLL_S):
                if cancel.hurry or time.monotonic() >= deadline:
                    raise Abandoned
            break
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def _gate_bounded(attempt: Attempt, plan: RunPlan, test: PlannedTest, catalog: Catalog, cancel) -> Attempt:
    try:
        return call_bounded(lambda: _gate_safely(attempt, plan, test, catalog), cancel, plan.settings.grace)
    except Abandoned:
        return attempt.replace(
            status=CANCELLED,
            classification="cancelled",
            message=f"the test passed, but its metric gate had not finished when {cancel.name} "
            f"arrived (waited {plan.settings.grace:g} s more)",
        )


def execute_plan(
    plan: RunPlan,
    catalog: Catalog,
    cancel: CancelToken,
    out: IO[str] | None = None,
    checkpoint: Callable[[RunRecord], None] | None = None,
    folders: tuple[Folder, Folder] | None = None,
    fold: bool = True,
    claims: Claims | None = None,
) -> RunRecord:
    """Run the plan's tests in order; always returns a complete record (cancellation included).
    With `claims` (a job of a run with jobs) only the tests this job takes from the run's queue
    run and are recorded, under the job's label as their shard; the others are another job's.

    `checkpoint` receives an incomplete record before each attempt starts (the running test
    and the rest marked as not finished) and again the moment a cancel arrives, so reports
    on disk always describe the run even if the runner is killed without warning.
    `folders` is (report folder, attempts folder) from claim_report_dir; without it the
    report folder is claimed here (PlanError when it holds what no run of miles made).
    `fold=False` keeps GitHub's `::group::` folds out of the output (a job of a run with jobs:
    its lines are relayed with a prefix, beside another job's)."""
    out = out if out is not None else sys.stdout
    owned = folders is None
    report_folder, attempts = _claim(plan.report_dir) if folders is None else folders
    try:
        return _execute(plan, catalog, cancel, out, checkpoint, attempts, fold, claims)
    finally:
        if owned:
            attempts.close()
            report_folder.close()


def _claim(report_dir: Path) -> tuple[Folder, Folder]:
    """claim_report_dir, with a folder it refuses read as a run that cannot be planned."""
    try:
        return claim_report_dir(report_dir)
    except ReportDirError as exc:
        raise PlanError(str(exc)) from None


def _execute(
    plan, catalog, cancel, out, checkpoint, attempt_folders: Folder, fold: bool = True, claims=None
) -> RunRecord:
    commit = current_commit(plan.settings.root)
    started = time.time()
    github = fold and os.environ.get("GITHUB_ACTIONS") == "true"
    # a job of a run with jobs walks the run's queue from its own end (miles.ci.running.claims)
    tests = plan.tests if claims is None else claims.walk(plan.tests, both_ends=plan.continue_on_error)
    progress = Progress(
        tests,
        out,
        github=github,
        streaming=plan.settings.echo is not None,
        jobs=claims.jobs if claims else 1,
    )
    attempts: list[Attempt] = []
    stop: str | None = None

    def record(done: list[Attempt], *, complete: bool = True) -> RunRecord:
        return _run_record(plan, done, started, commit, cancel.name or None, complete)

    shard = claims.label if claims is not None else None

    def not_run(test: PlannedTest, status: str, message: str) -> Attempt:
        return _not_run(plan, test, status, message, commit, shard)

    def provisional(index: int, current: Attempt, rest_message: str) -> None:
        if checkpoint is None:
            return
        rest = [not_run(t, CANCELLED, rest_message) for t in tests[index + 1 :]]
        checkpoint(record([*attempts, current, *rest], complete=False))

    # a refused registration is its own test's failed row (the first job's, in a run with jobs);
    # the suite's other tests still run
    if claims is None or claims.job == 1:
        attempts += [r.record(plan.selection.scope.backend, commit) for r in plan.refused]
    for index, test in enumerate(tests):
        if claims is not None and not claims.take(test.registration.suite, test.registration.file):
            continue  # another job's
        if cancel.cancelled:
            attempts.append(not_run(test, CANCELLED, f"not started: run cancelled by {cancel.name}"))
            continue
        if stop is not None:
            attempts.append(not_run(test, SKIPPED, stop))
            continue
        retry_reason, first_failure = None, ""
        for number in range(1, plan.max_attempts + 1):
            run = test_run(plan, test, number, retry_reason, commit)
            run = run if shard is None else dataclasses.replace(run, shard=shard)
            provisional(index, run.record(CANCELLED, "unfinished", message=UNFINISHED), NEVER_REACHED)
            progress.start(index, run)
            attempt = _attempt_in_own_folder(
                run,
                attempt_folders,
                attempt_name(test, number),
                plan.settings,
                cancel,
                progress.tick,
                on_cancel=lambda a, i=index: provisional(
                    i, a, f"not started: run cancelled by {cancel.name}"
                ),
            )
            if attempt.status == PASSED:
                attempt = _gate_bounded(attempt, plan, test, catalog, cancel)
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


def _attempt_in_own_folder(
    run: TestRun, attempts: Folder, name: str, settings, cancel, tick, on_cancel
) -> Attempt:
    """run_attempt in a folder made for it alone: a name taken already, or a link a test
    planted in its place, fails this attempt (never the run) and is never followed."""
    try:
        folder = attempts.subfolder(name, exclusive=True)
    except (OSError, ValueError) as exc:  # FileRefused is a ValueError
        message = (
            f"cannot make the attempt folder {attempts.path / name}: {getattr(exc, 'strerror', None) or exc}"
        )
        return run.record(FAILED, "report-folder", message=message, output_tail=message)
    with folder:
        return run_attempt(run, folder, settings, cancel, tick, on_cancel=on_cancel)


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
        predicted=plan.predicted_wall,
    )


# Read by miles.ckpt.tiny_cache (which the CI package does not import): the folder of tiny
# checkpoints and torch_dist forms every file of a run shares (tests/unit/test_runner_phases.py
# holds the two names equal).
TINY_CACHE_ENV = "MILES_TINY_CACHE"


@contextmanager
def shared_tiny_cache(plan: RunPlan) -> Iterator[RunPlan]:
    """The plan with one fresh tiny-checkpoint cache for all its files, deleted when the run ends;
    a cache the caller's environment names already is used as it is (and kept)."""
    if plan.settings.base_env.get(TINY_CACHE_ENV):
        yield plan
        return
    with tempfile.TemporaryDirectory(prefix="miles-tiny-") as folder:
        env = {**plan.settings.base_env, TINY_CACHE_ENV: folder}
        yield dataclasses.replace(plan, settings=dataclasses.replace(plan.settings, base_env=env))


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


def run(
    options: RunOptions, *, plan_only: bool = False, out: IO[str] | None = None, job_of: str | None = None
) -> int:
    """Plan, print the plan, and (unless plan_only) run it; returns the exit code. `job_of`
    ("j/N") marks a job of a run with jobs (miles.ci.running.jobs): that run prints the plan and
    the totals, the job only its progress."""
    out = out if out is not None else sys.stdout
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.reports.durations import check_store_settings
    from miles.metrics.store import StoreError

    try:  # a store setting that would leak its password or pick a wrong store stops here
        check_store_settings(options.root)
    except StoreError as exc:
        raise PlanError(str(exc)) from None
    catalog = load_catalog()
    plan = build_plan(options, catalog, discover(options.root, catalog=catalog))
    if job_of is None:
        out.write(format_plan(plan))
        out.flush()
    if plan_only:
        return 0
    report_folder, attempts = _claim(plan.report_dir)
    cancel = CancelToken()
    with cancel_on_signals(cancel), report_folder, attempts, shared_tiny_cache(plan) as plan:
        if plan.jobs > 1:
            from miles.ci.running.jobs import run_jobs

            record = run_jobs(options, plan, attempts, cancel, out)  # each job stored its durations
            paths = write_reports(record, report_folder)
        else:
            claims = None
            if options.claims is not None:
                job, jobs = (int(x) for x in (job_of or "1/1").split("/"))
                claims = Claims(options.claims, job, jobs)
            record = execute_plan(
                plan,
                catalog,
                cancel,
                out,
                checkpoint=lambda partial: write_reports(partial, report_folder, step_summary=False),
                folders=(report_folder, attempts),
                fold=job_of is None,
                claims=claims,
            )
            paths = write_reports(record, report_folder, step_summary=job_of is None)
            _store_durations(record, plan, cancel)
    if job_of is None:
        _print_totals(record, paths, out)
    return record.exit_code


def _store_durations(record: RunRecord, plan: RunPlan, cancel: CancelToken) -> None:
    from miles.ci.reports.durations import durations_path, record_durations
    from miles.metrics.store import StoreError

    try:
        call_bounded(
            lambda: record_durations(record.attempts, durations_path(plan.settings.root)),
            cancel,
            plan.settings.grace,
        )
    except Abandoned:
        print(f"warning: durations not stored: {cancel.name} arrived while storing them", file=sys.stderr)
    except (OSError, ValueError, TimeoutError, StoreError) as exc:
        print(f"warning: durations not stored: {exc}", file=sys.stderr)


def _print_totals(record: RunRecord, paths: dict[str, Path], out: IO[str]) -> None:
    counts = record.counts()
    summary = ", ".join(
        f"{counts[k]} {k}"
        for k in ("passed", "flaky", "failed", "timeout", "error", "cancelled", "skipped")
        if counts[k]
    )
    table = phase_table(record.final_attempts)
    if table:
        out.write("\n" + "\n".join(printable(line) for line in table) + "\n")
    wall = record.finished_at - record.started_at
    out.write(f"\n{'PASSED' if record.passed else 'FAILED'}: {summary or 'nothing ran'} in {wall:.0f}s\n")
    for name, path in paths.items():
        out.write(f"{name:>10}: {path}\n")
    out.flush()
