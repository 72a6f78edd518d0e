"""`python -m miles.ci list|audit|manifest|recipes`: what is registered where, what is off, what no lane
runs, and what the lanes say about the recipes."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from miles.ci.commands.usage import add_root_argument
from miles.ci.registry.catalog import load_catalog
from miles.text import printable


def add_list(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--backend", choices=("cpu", "cuda", "rocm"))
    p.add_argument("--suite")
    p.add_argument("--lane")
    p.add_argument("--label")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_list)


def add_audit(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--strict", action="store_true", help="exit 1 on error-class findings")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=cmd_audit)


def add_manifest(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument("--json", action="store_true", required=True, help="print JSON (the only format)")
    p.set_defaults(handler=cmd_manifest)


def _discover(root: Path):
    from miles.ci.registry.discover import discover

    return discover(root, catalog=load_catalog())


def cmd_list(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    suites = None
    if args.suite:
        suites = {catalog.suite(args.suite, args.backend).name}
    if args.lane:
        lane_suites = {s.name for s in catalog.suites_of_lane(catalog.lane(args.lane).name)}
        suites = lane_suites if suites is None else suites & lane_suites
    if args.label:
        catalog.check_label(args.label)
    discovery = _discover(args.root)
    regs = [
        r
        for r in discovery.registrations
        if (args.backend is None or r.backend == args.backend)
        and (suites is None or r.suite in suites)
        and (args.label is None or args.label in r.labels)
    ]
    refused = _refusals(discovery.problems, args.backend, suites)
    if args.json:
        payload = {
            "registrations": [{**r.to_json(), "status": _status(r)} for r in regs] + refused,
            "problems": [str(p) for p in discovery.problems],
        }
        print(json.dumps(payload, indent=2))
    else:
        _print_table(regs, refused)
    for problem in discovery.problems:
        print(problem, file=sys.stderr)
    return 1 if discovery.problems else 0


def _status(r) -> str:
    return "disabled" if r.disabled else "enabled"


def _refusals(problems, backend: str | None, suites: set[str] | None) -> list[dict]:
    """Registrations a rule refused, one entry per call, so they stay visible."""
    seen: dict[tuple[str, int], dict] = {}
    for p in problems:
        if not p.refused or (backend is not None and backend not in p.backends):
            continue
        if suites is not None and p.suite not in suites:
            continue
        entry = seen.setdefault((p.file, p.line), p.refusal_json())
        if p.message not in entry["rule"]:
            entry["rule"] += "; " + p.message
    return list(seen.values())


def _print_table(regs, refused=()) -> None:
    rows = [("BACKEND", "SUITE", "EST(s)", "FILE", "LABELS", "STATUS")]
    for r in sorted(regs, key=lambda r: (r.backend, r.suite, r.file)):
        status = "disabled: " + r.disabled if r.disabled else ("nightly" if r.nightly else "enabled")
        where = r.file if r.implicit else f"{r.file}:{r.line}"
        rows.append((r.backend, r.suite, f"{r.est_time:g}", where, ",".join(r.labels) or "-", status))
    for x in refused:
        rows.append(
            (
                x["backend"] or "-",
                x["suite"] or "-",
                "-",
                f"{x['file']}:{x['line']}",
                "-",
                f"refused: {x['rule']}",
            )
        )
    rows = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)) + "  " + row[-1])
    print(f"{len(rows) - 1} registration(s)")


def cmd_audit(args: argparse.Namespace) -> int:
    from miles.ci.reports.audit import audit

    catalog = load_catalog()
    report = audit(catalog, _discover(args.root), root=args.root)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.to_markdown(), end="")
    for finding in report.errors:
        print(f"error: {printable(finding.message)}", file=sys.stderr)
    return 1 if args.strict and report.errors else 0


def cmd_manifest(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    discovery = _discover(args.root)
    suites = {}
    for suite in catalog.suites.values():
        regs = [r for r in discovery.registrations if r.suite == suite.name]
        suites[suite.name] = {
            "backend": suite.backend,
            "gpus": suite.gpus,
            "lane": suite.lane,
            "cadence": suite.cadence,
            "runner_labels": list(suite.runner_labels),
            "consumers": [str(c) for c in suite.consumers],
            "enabled": [
                {"file": r.file, "est_time": r.est_time, "labels": list(r.labels), "nightly": r.nightly}
                for r in regs
                if r.enabled
            ],
            "disabled": [{"file": r.file, "reason": r.disabled} for r in regs if not r.enabled],
            "refused": _refusals(discovery.problems, suite.backend, {suite.name}),
        }
    placed = {(x["file"], x["line"]) for s in suites.values() for x in s["refused"]}
    elsewhere = [x for x in _refusals(discovery.problems, None, None) if (x["file"], x["line"]) not in placed]
    print(json.dumps({"schema": 1, "suites": suites, "refused": elsewhere}, indent=2))
    for problem in discovery.problems:
        print(problem, file=sys.stderr)
    return 1 if discovery.problems else 0


def add_recipes(p: argparse.ArgumentParser) -> None:
    add_root_argument(p)
    p.add_argument(
        "--write",
        action="store_true",
        help="rewrite miles/recipes/runs/cpu-lane.json from the cpu-lane tests",
    )
    p.set_defaults(handler=cmd_recipes)


def cmd_recipes(args: argparse.Namespace) -> int:
    """Which cpu-lane tests train each recipe (the evidence miles.recipes reads), and every GPU
    profile's suite against the catalog; exit 1 on a stale evidence file or a wrong suite."""
    from miles.ci.reports.recipes import (
        cpu_lane_trainings,
        every_form,
        evidence_drift,
        evidence_text,
        profile_suite_problems,
    )
    from miles.files import replace_file
    from miles.recipes.status import CPU_LANE_EVIDENCE, ROOT

    evidence = args.root / CPU_LANE_EVIDENCE.relative_to(ROOT)  # the tree whose tests are read
    catalog = load_catalog()
    trainings = cpu_lane_trainings(args.root, catalog, _discover(args.root))
    for recipe, pairs in trainings.items():
        print(f"{recipe}: trained on the cpu lane by {', '.join(f'{f} ({s})' for f, s in pairs)}")
    problems = profile_suite_problems(every_form(), catalog)
    if args.write:
        evidence.parent.mkdir(parents=True, exist_ok=True)
        replace_file(evidence, evidence_text(trainings).encode())
        print(f"wrote {evidence}")
    else:
        drift = evidence_drift(evidence, trainings)
        problems += [drift] if drift else []
    for problem in problems:
        print(f"error: {printable(problem)}", file=sys.stderr)
    return 1 if problems else 0
