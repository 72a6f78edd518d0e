"""Commands of the suite runner: run, plan, matrix, policy, affected, calibrate.

Each handler imports what it needs when it runs; nothing here pulls in a heavy package.
Bad input (unknown suite, lane or label, a refused label, a malformed shard) is a
UsageError: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from miles.ci.commands.usage import UsageError, add_root_argument
from miles.ci.registry.catalog import CADENCES

MATRIX_SETUP_MINUTES = {"cpu": 10, "gpu": 30}  # install, preflight, checkpoint staging


def add_run(p: argparse.ArgumentParser) -> None:
    _add_run_arguments(p)
    p.add_argument("--plan", action="store_true", help="print the plan and exit 0 without running anything")
    p.set_defaults(handler=cmd_run)


def add_plan(p: argparse.ArgumentParser) -> None:
    _add_run_arguments(p)
    p.set_defaults(handler=cmd_plan)


def add_matrix(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--lane", required=True)
    p.add_argument("--suite", action="append", default=[], help="only this suite (repeatable)")
    p.add_argument("--cadence", choices=CADENCES)
    p.add_argument("--labels", help="raw PR labels, as passed to run")
    p.add_argument("--shards", help="N or auto (default: the catalog's)")
    p.add_argument("--timeout-floor", type=float, default=None)
    p.set_defaults(handler=cmd_matrix)


def add_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--event", required=True, help="github.event_name")
    p.add_argument("--labels-json", default="", help="toJSON(github.event.pull_request.labels)")
    p.add_argument("--cadence", choices=CADENCES, help="cadence chosen for workflow_dispatch")
    p.add_argument("--ref", help="github.ref (default: $GITHUB_REF)")
    p.add_argument("--workflow", help="github.workflow_ref (default: $GITHUB_WORKFLOW_REF)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_policy)


def add_affected(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--diff", required=True, type=Path, help="file holding `git diff --name-status -z` output")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_affected)


def add_calibrate(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--backend", choices=("cpu", "cuda", "rocm"))
    p.add_argument("--suite")
    p.add_argument("--write", action="store_true", help="rewrite the est_time numbers and print the diff")
    p.add_argument("--quantile", type=float, default=None, help="quantile of passed durations (default 0.9)")
    p.add_argument("--min-runs", type=int, default=None, help="passed runs a proposal needs (default 3)")
    p.set_defaults(handler=cmd_calibrate)


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--lane", help="a lane (nox session) from the catalog")
    p.add_argument("--backend", choices=("cpu", "cuda", "rocm"))
    p.add_argument("--suite", action="append", default=[], help="limit to this suite (repeatable)")
    p.add_argument("--cadence", choices=CADENCES, help="default: the lane's")
    p.add_argument("--labels", help="raw PR labels, comma or space separated (run-ci-<label>, nightly, ...)")
    p.add_argument("--shard", help="k/N (1-based) or k/auto: run only that shard")
    p.add_argument("--shards", help="N or auto: how many shards to split each suite into")
    p.add_argument("--max-attempts", type=int, help="attempts per file for infrastructure failures")
    p.add_argument("--continue-on-error", action="store_true", help="run every test even after a failure")
    p.add_argument("--timeout-floor", type=float, default=None, help="minimum per-file timeout, seconds")
    p.add_argument("--grace", type=float, default=None, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--report-dir", type=Path, help="default .miles/reports/<lane or suite>-<k>of<N>")
    stream = p.add_mutually_exclusive_group()
    stream.add_argument(
        "--stream", dest="stream", action="store_true", default=None, help="echo test output live"
    )
    stream.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--pytest-arg", action="append", default=[], help="extra pytest argument (repeatable)")
    p.add_argument(
        "--jobs", help='runner processes side by side: N or "cores" (default: the lane\'s, in a --lane run)'
    )
    # set by a run with jobs for each job it starts: the plan and the final tables are the parent's
    p.add_argument("--job-of", help=argparse.SUPPRESS)
    # ... and the run's claims folder, from which each job takes the files it runs
    p.add_argument("--claims", type=Path, help=argparse.SUPPRESS)


def _options(args: argparse.Namespace):
    from miles.ci.running.plan import DEFAULT_GRACE, DEFAULT_TIMEOUT_FLOOR, RunOptions

    return RunOptions(
        root=args.root,
        lane=args.lane,
        backend=args.backend,
        suites=tuple(args.suite),
        cadence=args.cadence,
        labels=args.labels,
        shard=args.shard,
        shards=args.shards,
        max_attempts=args.max_attempts,
        continue_on_error=args.continue_on_error,
        timeout_floor=DEFAULT_TIMEOUT_FLOOR if args.timeout_floor is None else args.timeout_floor,
        grace=DEFAULT_GRACE if args.grace is None else args.grace,
        report_dir=args.report_dir,
        stream=args.stream,
        pytest_args=tuple(args.pytest_arg),
        jobs=args.jobs,
        claims=getattr(args, "claims", None),
    )


def _usage_errors():
    from miles.ci.running.plan import PlanError
    from miles.ci.selection.policy import PolicyError
    from miles.ci.selection.select import ScopeError

    return (PlanError, PolicyError, ScopeError)


def cmd_run(args: argparse.Namespace) -> int:
    from miles.ci.running.plan import EmptySuite
    from miles.ci.running.runner import run

    try:
        return run(_options(args), plan_only=args.plan, job_of=getattr(args, "job_of", None))
    except _usage_errors() as exc:
        raise UsageError(str(exc)) from None
    except (
        EmptySuite
    ) as exc:  # the lane fails in one line: a green run with nothing in it hides lost coverage
        print(f"error: {exc}", file=sys.stderr)
        return 1


def cmd_plan(args: argparse.Namespace) -> int:
    args.plan = True
    return cmd_run(args)


def cmd_matrix(args: argparse.Namespace) -> int:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.running.plan import DEFAULT_TIMEOUT_FLOOR, EmptySuite, RunOptions, build_plan
    from miles.ci.selection.policy import write_github_outputs

    catalog = load_catalog()
    options = RunOptions(
        root=args.root,
        lane=args.lane,
        suites=tuple(args.suite),
        cadence=args.cadence,
        labels=args.labels,
        shards=args.shards,
        timeout_floor=DEFAULT_TIMEOUT_FLOOR if args.timeout_floor is None else args.timeout_floor,
        jobs="1",  # the matrix lists machines; a lane's jobs share one
    )
    try:
        plan = build_plan(options, catalog, discover(args.root, catalog=catalog))
    except _usage_errors() as exc:
        raise UsageError(str(exc)) from None
    except EmptySuite as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    refused = {r.suite for r in plan.refused}
    timeouts = {(t.registration.suite, t.registration.file): t.timeout for t in plan.tests}
    include = []
    for sp in plan.suites:
        setup = MATRIX_SETUP_MINUTES["gpu" if sp.suite.is_gpu else "cpu"]
        for index, shard in enumerate(sp.partition.shards, start=1):
            # a refused registration is reported by its suite's first shard, which must then run
            if not shard and not (index == 1 and sp.suite.name in refused):
                continue
            limits = [timeouts[(sp.suite.name, job.key)] for job in shard]
            # every file at its limit, one retry of the longest, plus machine setup
            worst = sum(limits) + (plan.max_attempts - 1) * max(limits, default=0.0)
            include.append(
                {
                    "suite": sp.suite.name,
                    "shard": f"{index}/{sp.n_shards}",
                    "runner_labels": list(sp.suite.runner_labels),
                    "gpus": sp.suite.gpus,
                    "timeout_minutes": math.ceil(worst / 60) + setup,
                    "tests": len(shard),
                    "predicted_s": round(sum(job.weight for job in shard), 1),
                }
            )
    matrix = {"include": include}
    text = json.dumps(matrix, separators=(",", ":"))
    print(json.dumps(matrix, indent=2))
    write_github_outputs({"matrix": text, "empty": "true" if not include else "false"})
    return 0


def cmd_policy(args: argparse.Namespace) -> int:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.selection.policy import PolicyError, labels_from_json, resolve_policy, write_github_outputs

    ref = args.ref if args.ref is not None else os.environ.get("GITHUB_REF", "")
    workflow = args.workflow if args.workflow is not None else os.environ.get("GITHUB_WORKFLOW_REF", "")
    try:
        policy = resolve_policy(
            args.event,
            labels_from_json(args.labels_json),
            load_catalog(),
            cadence=args.cadence,
            ref=ref,
            workflow=workflow,
        )
        outputs = policy.outputs()
        written = write_github_outputs(outputs)
    except PolicyError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(
            json.dumps(
                {**outputs, "gpu_scope": policy.gpu_scope(), "ignored_labels": list(policy.ignored)}, indent=2
            )
        )
    else:
        for key, value in outputs.items():
            print(f"{key}={value}")
        print(f"# {args.event} runs {policy.gpu_scope()}", file=sys.stderr)
        if policy.ignored:
            # PR labels are anyone's text: quoted and escaped, so none can start a line that
            # GitHub would read as a workflow command (::warning::, ::add-mask::, ...)
            shown = ", ".join(json.dumps(label) for label in policy.ignored)
            print(f"# not CI labels, ignored: {shown}", file=sys.stderr)
    if written:
        print(f"# written to {written}", file=sys.stderr)
    return 0


def cmd_affected(args: argparse.Namespace) -> int:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.selection.affected import affected_suites
    from miles.ci.selection.policy import write_github_outputs

    catalog = load_catalog()
    try:
        raw = args.diff.read_bytes()
    except OSError as exc:
        raise UsageError(f"--diff {args.diff}: cannot read it ({exc.strerror})") from None
    result = affected_suites(raw, catalog, discover(args.root, catalog=catalog))
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(result.to_text(), end="")
    write_github_outputs(
        {"skip_suites": json.dumps(sorted(result.skip)), "run_suites": json.dumps(result.run)}
    )
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.reports.calibrate import DEFAULT_QUANTILE, MIN_PASSED_RUNS, apply_proposals, propose
    from miles.ci.reports.durations import durations_path

    catalog = load_catalog()
    if args.suite:
        catalog.suite(args.suite, args.backend)
    quantile = DEFAULT_QUANTILE if args.quantile is None else args.quantile
    if not 0 < quantile <= 1:
        raise UsageError(f"--quantile {quantile} must be in (0, 1]")
    min_runs = MIN_PASSED_RUNS if args.min_runs is None else args.min_runs
    if min_runs < 1:
        raise UsageError(f"--min-runs {min_runs} must be at least 1")
    discovery = discover(args.root, catalog=catalog)
    from miles.metrics.store import StoreError

    try:
        proposals = propose(
            discovery,
            durations_path(args.root),
            backend=args.backend,
            suite=args.suite,
            quantile=quantile,
            min_runs=min_runs,
        )
    except OSError as exc:  # the store is down: the reason, password masked, and exit 1
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, StoreError) as exc:
        raise UsageError(str(exc)) from None
    for line in proposals.table():
        print(line)
    if args.write:
        try:
            diff = apply_proposals(args.root, proposals.changes)
        except (OSError, ValueError, SyntaxError) as exc:  # FileRefused is a ValueError
            print(
                f"error: calibrate --write stopped: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr
            )
            return 1
        print(diff or "nothing to write: every est_time already matches its proposal")
    return 0
