"""Gate one finished test attempt end to end: records -> history -> verdicts -> baseline.

This is what the CI runner's gate step and the CI's `gate` command both call. It never
raises for a bad record or an unreachable store: those become verdicts and messages, and
the outcome says whether the test must fail (only gates in enforce mode can fail it).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.metrics.gate import GatePolicy, GateVerdict, error_verdict, evaluate, is_trusted, observed_values
from miles.metrics.records import RecordError, merge_records
from miles.metrics.spec import Declaration, GateSpec, gate_spec
from miles.metrics.store import HistoryStore, MetricValue, RunEntry, StoreError, open_store, writes_baseline

_PR_REF = re.compile(r"refs/pull/(\d+)/")


@dataclass(frozen=True)
class GateRun:
    """Which history an attempt belongs to and how its gates are applied."""

    test: str  # the test file, relative to the project root
    backend: str
    suite: str
    lane: str
    cadence: str
    lane_enforces: bool  # the lane's gate_mode is "enforce"
    commit: str | None = None
    pr: str | None = None
    ci_run_id: str | None = None

    def enforces(self, spec: GateSpec) -> bool:
        """Whether the gate can fail the test: the lane enforces, or the declaration asks to."""
        return self.lane_enforces or spec.enforce


@dataclass(frozen=True)
class GateOutcome:
    verdicts: tuple[GateVerdict, ...]
    trusted: bool | None  # None when the history could not be read, so trust is undecided
    failed: bool  # an enforced gate failed, or enforced gates could not reach the store
    message: str  # the line a person reads first; "" when there is nothing to say
    warnings: tuple[str, ...] = ()
    baseline_run_id: int | None = None

    @property
    def verdict_line(self) -> str:
        if not self.verdicts:
            return ""
        trust = {True: "TRUSTED", False: "NOT TRUSTED", None: "UNDECIDED"}[self.trusted]
        return f"{trust}: " + "; ".join(f"{v.metric} {v.status}" for v in self.verdicts)


NO_GATES = GateOutcome(verdicts=(), trusted=True, failed=False, message="")


def ci_identity(env: dict[str, str] | None = None) -> tuple[str | None, str | None]:
    """(PR number, CI run id) from the CI environment (GitHub Actions names), if any."""
    env = os.environ if env is None else env
    match = _PR_REF.match(env.get("GITHUB_REF", ""))
    return (match.group(1) if match else None), (env.get("GITHUB_RUN_ID") or None)


def gate_attempt(
    record_dir: Path | str,
    gates: Sequence[Declaration],
    run: GateRun,
    *,
    write_baseline: bool,
    store_url: str | None = None,
    root: Path | str = ".",
    store: HistoryStore | None = None,
) -> GateOutcome:
    """Gate the records in `record_dir` against the history of (test, backend, suite).

    `write_baseline` says the attempt passed and its run may store history (the caller asked
    the CI's policy, `stores_history`); the run is stored only then and when the cadence is one
    that writes baselines (nightly, weekly), trusted or not, so a run that failed its gates is
    visible in the history but never moves a baseline.
    """
    if not gates:
        return NO_GATES
    policy = GatePolicy()
    specs = [gate_spec(g) for g in gates]
    try:
        series = merge_records(record_dir)
    except RecordError as exc:
        verdicts = tuple(
            error_verdict(s, f"metric record refused: {exc}", enforce=run.enforces(s)) for s in specs
        )
        return _outcome(verdicts, trusted=False, store_error="", run_id=None)

    coordinates = [c for s in specs for c, _, _ in observed_values(s, series.get(s.metric))[0]]
    store_error, history = "", {}
    try:
        store = store or open_store(store_url, root=root)
        history = store.baselines(run.test, run.backend, run.suite, coordinates, policy.k)
    except StoreError as exc:
        store_error = str(exc)
    note = "history not checked: store unreachable" if store_error else ""
    verdicts = tuple(
        evaluate(s, series.get(s.metric), history, policy, enforce=run.enforces(s), history_note=note)
        for s in specs
    )
    trusted = is_trusted(verdicts)
    run_id = None
    if store_error:
        trusted = False if not trusted else None
    elif write_baseline and writes_baseline(run.cadence):
        try:
            run_id = store.add_run(_entry(run, trusted), _values(verdicts))
        except StoreError as exc:
            store_error = str(exc)
    return _outcome(verdicts, trusted=trusted, store_error=store_error, run_id=run_id)


def _outcome(
    verdicts: tuple[GateVerdict, ...], *, trusted: bool | None, store_error: str, run_id: int | None
) -> GateOutcome:
    failing = [v for v in verdicts if v.enforce and v.failed]
    store_failed = bool(store_error) and any(v.enforce for v in verdicts)
    warnings = ()
    if store_error and not store_failed:
        warnings = (f"warning: {store_error}; metric gates are in shadow mode, so the test is not failed",)
    if store_failed:
        message = store_error
    elif failing:
        message = f"metric gate failed: {failing[0].summary()}"
    else:
        message = next((f"metric gate (shadow): {v.summary()}" for v in verdicts if v.failed), "")
    return GateOutcome(verdicts, trusted, bool(failing) or store_failed, message, warnings, run_id)


def _entry(run: GateRun, trusted: bool) -> RunEntry:
    return RunEntry(
        test=run.test,
        backend=run.backend,
        suite=run.suite,
        lane=run.lane,
        cadence=run.cadence,
        trusted=trusted,
        commit=run.commit or None,
        pr=run.pr,
        ci_run_id=run.ci_run_id,
    )


def _values(verdicts: Sequence[GateVerdict]) -> list[MetricValue]:
    return [
        MetricValue(c.coordinate, c.value, c.status, c.ref, c.low, c.high)
        for v in verdicts
        for c in v.checks
        if c.value is not None
    ]
