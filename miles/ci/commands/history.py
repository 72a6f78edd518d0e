"""`python -m miles.ci history show|untrust|plot` and `python -m miles.ci gate`: the metric
history and its gates, driven from the CI's catalog, policy and discovery.

Only argparse is imported at parser-build time; each handler imports what it uses, so the
other commands of `python -m miles.ci` stay bare-Python.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from miles.ci.commands.usage import UsageError


def add_history(history: argparse.ArgumentParser) -> None:
    hsub = history.add_subparsers(dest="history_command", required=True, metavar="ACTION")

    p = hsub.add_parser("show", help="stored runs of a test with their values, bands and verdicts")
    _store_arguments(p)
    _coordinate_arguments(p)
    p.add_argument("--metric", help="only this metric (default: all)")
    p.add_argument("--limit", type=int, default=20, help="newest runs to show (default: 20)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_history_show)

    p = hsub.add_parser("untrust", help="exclude a run, or every run of a commit, from baselines")
    _store_arguments(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--run", type=int, help="run id (see 'history show')")
    which.add_argument("--commit", help="commit id or a prefix of 7+ hex digits")
    p.add_argument("--reason", default="marked untrusted by hand", help="why, kept with the run")
    p.set_defaults(handler=cmd_history_untrust)

    p = hsub.add_parser("plot", help="plot a metric's history with its baseline band and verdicts")
    _store_arguments(p)
    _coordinate_arguments(p)
    p.add_argument("--metric", required=True)
    p.add_argument(
        "-o", "--output", type=Path, required=True, help="image file to write (e.g. grad_norm.png)"
    )
    p.add_argument("--limit", type=int, default=100, help="newest runs to plot (default: 100)")
    p.set_defaults(handler=cmd_history_plot)


def add_gate(p: argparse.ArgumentParser) -> None:
    _store_arguments(p)
    p.add_argument("--record", type=Path, required=True, help="directory holding the run's *.jsonl records")
    p.add_argument("--test", required=True, help="the test file whose register_ci_gate(...) calls apply")
    p.add_argument("--backend", choices=("cpu", "cuda", "rocm"), help="default: the file's only backend")
    p.add_argument("--suite", help="default: the file's only suite on that backend")
    p.add_argument("--cadence", help="default: the cadence of the suite's lane")
    p.add_argument("--write", action="store_true", help="store the run (nightly/weekly cadence only)")
    p.add_argument("--commit", help="commit id stored with the run")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_gate)


def _store_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=Path("."), help="project root (default: .)")
    p.add_argument("--store", help="store URL (default: $MILES_HISTORY_URL, else .miles/history.sqlite)")


def _coordinate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--test", required=True, help="test file, relative to the project root")
    p.add_argument("--backend", choices=("cpu", "cuda", "rocm"))
    p.add_argument("--suite")


def _store_errors_exit_1(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """A store that refuses or cannot be reached ends the command with its reason and exit 1."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from miles.metrics.store import StoreError

        try:
            return handler(args)
        except StoreError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1

    return run


def _store_url(args: argparse.Namespace) -> str:
    """The store URL in effect (--store, else $MILES_HISTORY_URL, else the SQLite file),
    checked with $MILES_HISTORY_TIMEOUT: a malformed one is bad input (exit 2), not a store that
    failed (exit 1)."""
    from miles.metrics.store import (
        HISTORY_URL_ENV,
        StoreError,
        check_store_url,
        resolve_url,
        statement_timeout,
    )

    name = "--store" if args.store is not None else HISTORY_URL_ENV
    try:
        statement_timeout()  # $MILES_HISTORY_TIMEOUT, read by every store: bad input too
        return check_store_url(resolve_url(args.store, root=args.root), name=name)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def _open(args: argparse.Namespace):
    from miles.metrics.store import open_store

    return open_store(_store_url(args), root=args.root)


MAX_LIMIT = 1_000_000


def _check_limit(limit: int) -> None:
    # the stores would read -1 differently (SQLite: no limit; PostgreSQL: error), and neither
    # holds a number past 64 bits
    if not 1 <= limit <= MAX_LIMIT:
        raise UsageError(f"--limit {limit} must be at least 1 and at most {MAX_LIMIT}")


def _test_path(root: Path, test: str) -> str:
    path = Path(test)
    if path.is_absolute():
        try:
            path = path.resolve().relative_to(Path(root).resolve())
        except ValueError as exc:
            raise UsageError(f"--test {test}: not inside the project root {root}") from exc
    return path.as_posix().removeprefix("./")


@_store_errors_exit_1
def cmd_history_show(args: argparse.Namespace) -> int:
    from miles.metrics.report import history_rows, render_history

    _check_limit(args.limit)
    store = _open(args)
    test = _test_path(args.root, args.test)
    rows = history_rows(
        store, test, backend=args.backend, suite=args.suite, metric=args.metric, limit=args.limit
    )
    if args.json:
        print(json.dumps({"store": store.url, "test": test, "rows": [r.to_json() for r in rows]}, indent=2))
    else:
        print(render_history(rows, test=test, store_url=store.url, metric=args.metric), end="")
    return 0


@_store_errors_exit_1
def cmd_history_untrust(args: argparse.Namespace) -> int:
    store = _open(args)
    count = store.mark_untrusted(run_id=args.run, commit=args.commit, reason=args.reason)
    which = f"run {args.run}" if args.run is not None else f"commit {args.commit}"
    if not count:
        print(f"error: no stored run matches {which} in {store.url}", file=sys.stderr)
        return 1
    print(f"marked {count} run(s) of {which} untrusted in {store.url}; they no longer count toward baselines")
    return 0


@_store_errors_exit_1
def cmd_history_plot(args: argparse.Namespace) -> int:
    from miles.metrics.plot import plot_history

    _check_limit(args.limit)
    store = _open(args)
    test = _test_path(args.root, args.test)
    try:
        panels = plot_history(
            store, test, args.metric, args.output, backend=args.backend, suite=args.suite, limit=args.limit
        )
    except LookupError as exc:
        raise UsageError(str(exc.args[0])) from exc
    print(f"wrote {args.output} ({panels} panel(s))")
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.selection.policy import CiEvent, history_decision
    from miles.metrics.gating import GateRun, ci_identity, gate_attempt

    catalog = load_catalog()
    store_url = _store_url(args)
    test = _test_path(args.root, args.test)
    test_file = _read_test_file(args.root, test, catalog)
    if not args.record.is_dir():
        raise UsageError(f"--record {args.record}: no such directory")
    backend, suite = _pick_registration(test_file, args.backend, args.suite)
    lane = catalog.lane(catalog.suite(suite, backend).lane)
    cadence = args.cadence or lane.cadence
    if args.write:
        stores, why = history_decision(CiEvent.from_env(os.environ), cadence, catalog)
        if not stores:
            raise UsageError(f"--write: {why}")
    pr, ci_run_id = ci_identity()
    run = GateRun(
        test, backend, suite, lane.name, cadence, lane.gate_mode == "enforce", args.commit, pr, ci_run_id
    )
    outcome = gate_attempt(
        args.record, test_file.gates, run, write_baseline=args.write, store_url=store_url, root=args.root
    )
    if args.json:
        print(json.dumps(_outcome_json(outcome, run), indent=2))
    else:
        mode = "enforce" if run.lane_enforces else "shadow"
        print(f"gate {test} on {backend}/{suite} (lane {lane.name}: {mode}, cadence {cadence})")
        if not test_file.gates:
            print("no register_ci_gate(...) in this file; nothing to check")
        for verdict in outcome.verdicts:
            print("  " + verdict.summary())
        for line in outcome.warnings:
            print(line, file=sys.stderr)
        if outcome.verdicts:
            print(outcome.verdict_line.split(":", 1)[0])
        if outcome.baseline_run_id is not None:
            print(f"stored as run {outcome.baseline_run_id}")
        if outcome.message and outcome.failed:
            print(f"error: {outcome.message}", file=sys.stderr)
    return 0 if outcome.trusted is True and not outcome.failed else 1


def _read_test_file(root: Path, test: str, catalog):
    from miles.ci.registry.discover import parse_test_file

    path = Path(root) / test
    if not path.is_file():
        raise UsageError(f"--test {test}: no such file under {root}")
    test_file, problems = parse_test_file(path, test, catalog)
    if problems:
        raise UsageError("; ".join(str(p) for p in problems))
    return test_file


def _pick_registration(test_file, backend: str | None, suite: str | None) -> tuple[str, str]:
    regs = [r for r in test_file.registrations if (backend is None or r.backend == backend)]
    regs = [r for r in regs if suite is None or r.suite == suite]
    if len(regs) == 1:
        return regs[0].backend, regs[0].suite
    known = ", ".join(f"{r.backend}/{r.suite}" for r in test_file.registrations) or "none"
    if not regs:
        raise UsageError(
            f"{test_file.path} has no registration for {backend or '*'}/{suite or '*'}; registered: {known}"
        )
    raise UsageError(f"{test_file.path} is registered on {known}; choose one with --backend and --suite")


def _outcome_json(outcome, run) -> dict:
    return {
        "test": run.test,
        "backend": run.backend,
        "suite": run.suite,
        "lane": run.lane,
        "cadence": run.cadence,
        "trusted": outcome.trusted,
        "failed": outcome.failed,
        "message": outcome.message,
        "warnings": list(outcome.warnings),
        "baseline_run_id": outcome.baseline_run_id,
        "verdicts": [v.to_json() for v in outcome.verdicts],
    }
