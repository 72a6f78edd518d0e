"""The maintainer's report: what is registered where, what is off and since when, what
nothing runs. `python -m miles.ci audit [--strict]`.
"""

from __future__ import annotations

import subprocess
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from miles.ci.registry.catalog import Catalog
from miles.ci.registry.discover import Discovery, Registration
from miles.ci.registry.registration import Problem
from miles.ci.reports.summary import cell, printable
from miles.metrics.store import BASELINE_CADENCES

ERROR, WARNING, INFO = "error", "warning", "info"
GPU_BACKENDS = ("cuda", "rocm")


@dataclass(frozen=True)
class Finding:
    severity: str  # error | warning | info; --strict fails on errors
    kind: str
    message: str

    def to_json(self) -> dict:
        return {"severity": self.severity, "kind": self.kind, "message": self.message}


@dataclass(frozen=True)
class DisabledEntry:
    registration: Registration
    since: str | None  # YYYY-MM-DD the line was last changed, None when not committed
    age_days: int | None

    def to_json(self) -> dict:
        r = self.registration
        return {
            "backend": r.backend,
            "suite": r.suite,
            "file": r.file,
            "line": r.line,
            "reason": r.disabled,
            "since": self.since,
            "age_days": self.age_days,
        }


@dataclass(frozen=True)
class CoverageRow:
    file: str
    cuda: str  # "enabled" | "disabled" | "-"
    rocm: str


@dataclass(frozen=True)
class AuditReport:
    findings: tuple[Finding, ...]
    disabled: tuple[DisabledEntry, ...]
    coverage: tuple[CoverageRow, ...]
    suite_counts: tuple[tuple[str, int, int], ...]  # suite, enabled, disabled
    # registration problems, each the failing row its test file gets in the runs of its suites
    refused: tuple[Problem, ...] = ()

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == ERROR)

    def to_json(self) -> dict:
        return {
            "errors": len(self.errors),
            "findings": [f.to_json() for f in self.findings],
            "disabled": [d.to_json() for d in self.disabled],
            "coverage": [{"file": c.file, "cuda": c.cuda, "rocm": c.rocm} for c in self.coverage],
            "suites": [{"suite": s, "enabled": e, "disabled": d} for s, e, d in self.suite_counts],
            "refused": [
                {"file": p.file, "line": p.line, "suites": list(_suites_of(p)), "rule": p.message}
                for p in self.refused
            ],
        }

    def to_markdown(self) -> str:
        out = ["# CI audit", "", "## Suites", "", "| suite | enabled | disabled |", "| --- | ---: | ---: |"]
        out += [f"| {s} | {e} | {d} |" for s, e, d in self.suite_counts]
        out += ["", "## Refused registrations (each fails its file's row in its suites' runs)", ""]
        if self.refused:
            out += ["| suite | file | rule |", "| --- | --- | --- |"]
            out += [
                f"| {cell(', '.join(_suites_of(p)) or '-')} | {cell(f'{p.file}:{p.line}')} | {cell(p.message)} |"
                for p in self.refused
            ]
        else:
            out.append("None.")
        out += ["", "## Disabled tests", ""]
        if self.disabled:
            out += [
                "| backend | suite | file | reason | since | age (days) |",
                "| --- | --- | --- | --- | --- | ---: |",
            ]
            for d in self.disabled:
                r = d.registration
                out.append(
                    f"| {r.backend} | {r.suite} | {cell(f'{r.file}:{r.line}')} | {cell(r.disabled or '')} | "
                    f"{d.since or 'uncommitted'} | {'' if d.age_days is None else d.age_days} |"
                )
        else:
            out.append("None.")
        out += ["", "## GPU coverage (CUDA vs ROCm)", ""]
        gaps = [c for c in self.coverage if "-" in (c.cuda, c.rocm) or c.cuda != c.rocm]
        if gaps:
            out += ["| file | cuda | rocm |", "| --- | --- | --- |"]
            out += [f"| {cell(c.file)} | {c.cuda} | {c.rocm} |" for c in gaps]
        else:
            out.append("Every GPU test runs on both backends.")
        out += ["", "## Findings", ""]
        if self.findings:
            out += [f"- **{f.severity}** [{f.kind}] {printable(f.message)}" for f in self.findings]
        else:
            out.append("None.")
        return "\n".join(out) + "\n"


def _suites_of(problem: Problem) -> tuple[str, ...]:
    return (problem.suite,) if problem.suite is not None else problem.suites


def _empty_findings(catalog: Catalog, counts, discovery: Discovery) -> list[Finding]:
    """A suite with no enabled test fails its lane (error) unless the catalog declares it empty
    with a reason (info); a declaration the suite outgrew is a warning."""
    out = []
    charged = {s for p in discovery.problems for s in _suites_of(p)}
    for name, enabled, off in counts:
        declared = catalog.suites[name].empty
        if enabled and declared:
            out.append(Finding(WARNING, "stale-empty", f"suite '{name}' has {enabled} enabled test(s) but the "
                               "catalog declares it empty; remove its `empty` line"))  # fmt: skip
        elif not enabled and declared:
            out.append(Finding(INFO, "declared-empty", f"suite '{name}' is empty: {declared}"))
        elif not enabled and name not in charged:
            note = f" ({off} disabled)" if off else ""
            out.append(Finding(ERROR, "empty-suite", f"suite '{name}' has no enabled test{note}, so its lane "
                               f"'{catalog.suites[name].lane}' fails; register one, or declare it empty with "
                               "its reason in miles/ci/catalog.toml (empty = \"...\")"))  # fmt: skip
    return out


def audit(catalog: Catalog, discovery: Discovery, *, root: Path | None = None) -> AuditReport:
    root = root if root is not None else discovery.root
    findings: list[Finding] = [Finding(ERROR, "registration", str(p)) for p in discovery.problems]
    registrations = discovery.registrations

    disabled = tuple(
        DisabledEntry(r, *_line_date(root, r.file, r.line)) for r in registrations if not r.enabled
    )

    per_suite: dict[str, list[Registration]] = defaultdict(list)
    for r in registrations:
        per_suite[r.suite].append(r)
    suite_counts = tuple(
        (name, sum(r.enabled for r in per_suite[name]), sum(not r.enabled for r in per_suite[name]))
        for name in catalog.suites
    )
    findings.extend(_empty_findings(catalog, suite_counts, discovery))
    enabled_in = {name: enabled for name, enabled, _ in suite_counts}
    for lane in catalog.lanes.values():
        suites = catalog.suites_of_lane(lane.name)
        if not any(enabled_in[s.name] for s in suites) and all(s.empty for s in suites):
            findings.append(
                Finding(INFO, "empty-lane", f"lane '{lane.name}' runs no test: its suites are declared empty")
            )

    refused = tuple(p for p in discovery.problems if p.backends)
    # A suite without consumers never gets this far: the catalog refuses to load.
    for suite in catalog.suites.values():
        for consumer in suite.consumers:
            if consumer.kind == "workflow" and not (root / ".github" / "workflows" / consumer.name).is_file():
                # The workflows exist now, so a consumer naming a missing one is a broken promise.
                findings.append(
                    Finding(
                        ERROR,
                        "missing-workflow",
                        f"suite '{suite.name}' names consumer {consumer} but "
                        f".github/workflows/{consumer.name} does not exist; add the workflow "
                        "or fix the suite's consumers in miles/ci/catalog.toml",
                    )
                )

    findings.extend(_placeholder_findings(per_suite))
    findings.extend(_baseline_findings(catalog, discovery))

    used = {label for r in registrations for label in r.labels}
    for label in catalog.labels:
        if label not in used:
            findings.append(Finding(INFO, "unused-label", f"label '{label}' is used by no registration"))

    coverage = _coverage(discovery)
    for row in coverage:
        if row.cuda != "-" and row.rocm == "-":
            findings.append(
                Finding(INFO, "coverage", f"{row.file} runs on CUDA but has no ROCm registration")
            )
        elif row.rocm != "-" and row.cuda == "-":
            findings.append(
                Finding(INFO, "coverage", f"{row.file} runs on ROCm but has no CUDA registration")
            )

    order = {ERROR: 0, WARNING: 1, INFO: 2}
    findings.sort(key=lambda f: order[f.severity])
    return AuditReport(tuple(findings), disabled, coverage, suite_counts, refused)


def _coverage(discovery: Discovery) -> tuple[CoverageRow, ...]:
    rows = []
    for f in discovery.files:
        state = {}
        for backend in GPU_BACKENDS:
            regs = f.for_backend(backend)
            state[backend] = "-" if not regs else ("enabled" if any(r.enabled for r in regs) else "disabled")
        if state["cuda"] != "-" or state["rocm"] != "-":
            rows.append(CoverageRow(f.path, state["cuda"], state["rocm"]))
    return tuple(rows)


def _baseline_findings(catalog: Catalog, discovery: Discovery) -> list[Finding]:
    """A gate compares a run with the history of its (test, backend, suite), and only the
    scheduled runs of that suite store it (miles.ci.selection.policy). Name every gate none of them feeds:
    it would stay INACTIVE for ever."""
    findings = []
    for test_file in discovery.files:
        if not test_file.gates:
            continue
        metrics = ", ".join(g.metric_key for g in test_file.gates)
        for r in test_file.registrations:
            if not r.enabled or any(c in BASELINE_CADENCES for _, c in catalog.scheduled_runs(r.suite)):
                continue
            where = f"{test_file.path}:{test_file.gates[0].line}: gate {metrics} on ({r.backend}, {r.suite})"
            if r.backend == "cpu":  # the cpu lane gates on the local store, which a nightly run fills
                severity, message = (
                    INFO,
                    (
                        f"{where} has no baseline source in CI: no scheduled workflow runs {r.suite}; "
                        f"fill the local store with `python -m miles.ci run --suite {r.suite} --cadence nightly`"
                    ),
                )
            else:
                severity, message = (
                    WARNING,
                    (
                        f"{where} has no baseline source: no scheduled workflow runs {r.suite} at a nightly "
                        "or weekly cadence, so the gate stays INACTIVE; add one to the suite's consumers "
                        "and to [schedules] in miles/ci/catalog.toml"
                    ),
                )
            findings.append(Finding(severity, "no-baseline", message))
    return findings


def _placeholder_findings(per_suite: dict[str, list[Registration]]) -> list[Finding]:
    """Many identical round est_time values in one suite mean nobody measured them."""
    findings = []
    for suite, regs in per_suite.items():
        explicit = [r for r in regs if not r.implicit]
        if len(explicit) < 3:
            continue
        value, count = Counter(r.est_time for r in explicit).most_common(1)[0]
        round_number = value % 60 == 0 or value % 100 == 0
        if round_number and count >= 3 and count * 2 >= len(explicit):
            findings.append(
                Finding(
                    WARNING,
                    "placeholder-est-time",
                    f"suite '{suite}': {count} of {len(explicit)} tests have est_time={value:g}, "
                    "which looks like a placeholder; run `python -m miles.ci calibrate "
                    f"--suite {suite}` to measure them",
                )
            )
    return findings


def _line_date(root: Path, file: str, line: int) -> tuple[str | None, int | None]:
    """When the line was last changed according to git blame; (None, None) if uncommitted."""
    if line < 1:
        return None, None
    try:
        out = subprocess.run(
            ["git", "blame", "--porcelain", "-L", f"{line},{line}", "--", file],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    if out.returncode != 0 or out.stdout.startswith("0000000000000000000000000000000000000000"):
        return None, None
    for text in out.stdout.splitlines():
        if text.startswith("author-time "):
            stamp = int(text.split()[1])
            return time.strftime("%Y-%m-%d", time.gmtime(stamp)), int((time.time() - stamp) // 86400)
    return None, None
