"""JUnit, Markdown and JSON: renderers of one RunRecord.

`render_junit`, `render_markdown` and `render_json` each take the same RunRecord and
nothing else; `write_reports` writes all three atomically (temp file, rename) and
appends the Markdown to `$GITHUB_STEP_SUMMARY` when it is set.
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from miles.ci.record import (
    CANCELLED,
    ERROR,
    FAILED,
    PASSED,
    SKIPPED,
    TIMEOUT,
    Attempt,
    RunRecord,
)
from miles.metrics import gate

REPORT_FILES = ("junit.xml", "summary.md", "run.json")
FAILING_VERDICTS = frozenset({gate.FAIL, gate.ERROR})  # the gate statuses that can fail a test


# ---------------------------------------------------------------- JUnit out


def render_junit(run: RunRecord) -> str:
    """xunit1 JUnit: one <testsuite> per test file (its final attempt's cases, with the
    `file` attribute kept), earlier attempts and gate verdicts alongside, and the tests this
    run excluded as skipped cases."""
    root = ET.Element("testsuites", name=f"miles ci {run_title(run)}")
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    attempts_of: dict[tuple[str, str], list[Attempt]] = {}
    for a in run.attempts:
        attempts_of.setdefault((a.suite, a.file), []).append(a)
    for final in run.final_attempts:
        history = attempts_of[(final.suite, final.file)]
        suite_el = _junit_suite(final, history)
        for key in totals:
            totals[key] += int(suite_el.get(key, "0"))
        root.append(suite_el)
    if run.excluded:
        ex = ET.SubElement(root, "testsuite", name="excluded", tests=str(len(run.excluded)), failures="0")
        ex.set("errors", "0")
        ex.set("skipped", str(len(run.excluded)))
        for e in run.excluded:
            case = ET.SubElement(
                ex, "testcase", classname=_dotted(e.file), name=f"{e.file} [{e.suite}]", file=e.file
            )
            ET.SubElement(case, "skipped", type=e.kind, message=f"{e.kind}: {e.reason}")
        totals["tests"] += len(run.excluded)
        totals["skipped"] += len(run.excluded)
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("time", f"{run.finished_at - run.started_at:.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _junit_suite(final: Attempt, history: list[Attempt]) -> ET.Element:
    el = ET.Element("testsuite", name=f"{final.suite}:{final.file}", file=final.file)
    el.set("time", f"{final.elapsed:.3f}")
    props = ET.SubElement(el, "properties")
    for name, value in (
        ("backend", final.backend),
        ("suite", final.suite),
        ("lane", final.lane),
        ("shard", final.shard),
        ("attempts", str(final.attempt)),
        ("status", final.status),
        ("classification", final.classification),
        ("est_time", f"{final.est_time:g}"),
        ("commit", final.commit),
    ):
        ET.SubElement(props, "property", name=name, value=value)
    cases = list(final.cases)
    bad_case = any(c.outcome in ("failed", "error") for c in cases)
    for c in cases:
        case = ET.SubElement(el, "testcase", classname=c.classname, name=c.name, file=c.file or final.file)
        if c.line is not None:
            case.set("line", str(c.line))
        case.set("time", f"{c.time:.3f}")
        if c.outcome in ("failed", "error"):
            ET.SubElement(
                case, "failure" if c.outcome == "failed" else "error", message=c.message, type=c.kind
            )
        elif c.outcome == "skipped":
            ET.SubElement(case, "skipped", message=c.message)
    failing_gate = final.status == FAILED and any(
        v["status"] in FAILING_VERDICTS for v in final.gate_verdicts
    )
    # A failure neither the cases nor the gates show (timeout, crash, no JUnit, cancelled)
    # gets a case of its own, and so does a file that never ran or reported no case at all.
    if (
        final.status == SKIPPED
        or (not final.ok and not (bad_case or failing_gate))
        or (final.ok and not cases)
    ):
        case = ET.SubElement(el, "testcase", classname=_dotted(final.file), name=f"{final.file} [runner]")
        case.set("file", final.file)
        case.set("time", f"{final.elapsed:.3f}")
        if final.status in (FAILED, TIMEOUT):
            child = ET.SubElement(case, "failure", message=final.message, type=final.classification)
            child.text = final.output_tail
        elif final.status in (ERROR, CANCELLED):
            child = ET.SubElement(case, "error", message=final.message, type=final.classification)
            child.text = final.output_tail
        elif final.status == SKIPPED:
            ET.SubElement(case, "skipped", message=final.message)
    for verdict in final.gate_verdicts:
        metric, status, message = verdict["metric"], verdict["status"], verdict["message"]
        case = ET.SubElement(
            el, "testcase", classname="metric-gates", name=f"gate[{metric}]", file=final.file
        )
        if status in FAILING_VERDICTS and final.status == FAILED:
            ET.SubElement(case, "failure", message=f"{status}: {message}", type="gate")
        else:
            ET.SubElement(case, "system-out").text = f"{status}: {message}"
    if len(history) > 1:
        lines = [
            f"attempt {a.attempt}: {a.status} ({a.classification}) in {a.elapsed:.1f}s"
            + (f"; retried because {a.retry_reason}" if a.retry_reason else "")
            for a in history
        ]
        ET.SubElement(el, "system-out").text = "\n".join(lines)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for case in el.iter("testcase"):
        counts["tests"] += 1
        for tag, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                counts[key] += 1
    for key, value in counts.items():
        el.set(key, str(value))
    return el


def _dotted(file: str) -> str:
    return file.removesuffix(".py").replace("/", ".")


# ---------------------------------------------------------------- Markdown


STATUS_ICON = {PASSED: "✅", FAILED: "❌", TIMEOUT: "⏱️", ERROR: "💥", CANCELLED: "🛑", SKIPPED: "⏭️"}


def run_title(run: RunRecord) -> str:
    return f"{run.lane or run.backend} shard {run.shard}"


def render_markdown(run: RunRecord) -> str:
    """The step summary: counts, then failed, retried, gate, disabled and passed tables,
    then a mermaid gantt of the shard's timeline."""
    counts = run.counts()
    verdict = "✅ passed" if run.passed else ("🛑 cancelled" if run.cancelled_by else "❌ failed")
    wall = run.finished_at - run.started_at
    predicted = sum(a.est_time for a in run.final_attempts)
    labels = "(not given: all labels admitted)" if run.labels is None else (" ".join(run.labels) or "(none)")
    out = [
        f"## miles CI · {run_title(run)} · {verdict}",
        "",
        f"suites {', '.join(run.suites) or '-'} · backend {run.backend} · cadence {run.cadence} · "
        f"labels {labels} · commit `{run.commit[:12] or 'unknown'}` · "
        f"wall {_duration(wall)} (predicted {_duration(predicted)})",
        "",
    ]
    if run.cancelled_by:
        out += [
            f"**The run was cancelled by {run.cancelled_by}**; unfinished tests are marked cancelled.",
            "",
        ]
    out += [
        "| passed | failed | timed out | errors | cancelled | not run | retried | disabled |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {counts[PASSED]} | {counts[FAILED]} | {counts[TIMEOUT]} | {counts[ERROR]} | {counts[CANCELLED]} "
        f"| {counts[SKIPPED]} | {counts['retried']} | {counts['disabled']} |",
        "",
    ]
    bad = [a for a in run.final_attempts if not a.ok]
    if bad:
        out += [
            "### Failed",
            "",
            "| file | suite | status | why | attempts | elapsed / est |",
            "| --- | --- | --- | --- | ---: | --- |",
        ]
        out += [
            f"| `{a.file}` | {a.suite} | {STATUS_ICON[a.status]} {a.status} ({a.classification}) | "
            f"{_cell(a.message)} | {a.attempt} | {a.elapsed:.1f}s / {a.est_time:g}s |"
            for a in bad
        ]
        out.append("")
        for a in bad:
            if a.output_tail.strip():
                fence = "`" * max(3, _longest_backtick_run(a.output_tail) + 1)
                out += [
                    f"<details><summary>output tail of <code>{a.file}</code></summary>",
                    "",
                    fence,
                    a.output_tail.rstrip("\n")[-4000:],
                    fence,
                    "",
                    "</details>",
                    "",
                ]
    if run.retried:
        out += [
            "### Retried",
            "",
            "| file | attempt | result | why it was retried |",
            "| --- | ---: | --- | --- |",
        ]
        out += [
            f"| `{a.file}` | {a.attempt} | {a.status} ({a.classification}) | {_cell(a.retry_reason or '')} |"
            for a in run.retried
        ]
        out.append("")
    gated = [(a, v) for a in run.final_attempts for v in a.gate_verdicts]
    if gated:
        out += ["### Metric gates", "", "| file | metric | status | message |", "| --- | --- | --- | --- |"]
        for a, v in gated:
            metric, status, message = v["metric"], v["status"], v["message"]
            out.append(f"| `{a.file}` | `{metric}` | {status} | {_cell(message)} |")
        out.append("")
    disabled = [e for e in run.excluded if e.kind == "disabled"]
    if disabled:
        out += ["### Disabled", "", "| file | suite | reason |", "| --- | --- | --- |"]
        out += [f"| `{e.file}` | {e.suite} | {_cell(e.reason)} |" for e in disabled]
        out.append("")
    not_run = [a for a in run.final_attempts if a.status == SKIPPED]
    if not_run:
        out += ["### Not run", "", "| file | suite | why |", "| --- | --- | --- |"]
        out += [f"| `{a.file}` | {a.suite} | {_cell(a.message)} |" for a in not_run]
        out.append("")
    other = [e for e in run.excluded if e.kind != "disabled"]
    if other:
        out += ["### Not selected", "", "| file | suite | why |", "| --- | --- | --- |"]
        out += [f"| `{e.file}` | {e.suite} | {_cell(e.reason)} |" for e in other]
        out.append("")
    passed = [a for a in run.final_attempts if a.status == PASSED]
    if passed:
        out += [
            "### Passed",
            "",
            "| file | suite | elapsed | est_time | tests |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        out += [
            f"| `{a.file}` | {a.suite} | {a.elapsed:.1f}s | {a.est_time:g}s | {len(a.cases)} |"
            for a in passed
        ]
        out.append("")
    out += _gantt(run)
    return "\n".join(out) + "\n"


def _gantt(run: RunRecord) -> list[str]:
    ran = [a for a in run.attempts if a.elapsed > 0]
    if not ran:
        return []
    lines = ["### Timeline", "", "```mermaid", "gantt", "    dateFormat x", "    axisFormat %H:%M:%S"]
    finals = {id(a) for a in run.final_attempts}
    section = None
    for n, a in enumerate(ran):
        if a.suite != section:
            section = a.suite
            lines.append(f"    section {section}")
        # wall-clock milliseconds: the axis then shows when each test ran, in the reader's time zone
        start = int(a.started_at * 1000)
        end = max(start + 1, int(a.finished_at * 1000))
        tag = "done" if a.status == PASSED else ("active" if id(a) not in finals else "crit")
        name = re.sub(r"[:#;]", "_", a.file) + (f" (attempt {a.attempt})" if a.attempt > 1 else "")
        lines.append(f"    {name} :{tag}, t{n}, {start}, {end}")
    return [*lines, "```", ""]


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{sec:02d}s" if hours else f"{minutes}m{sec:02d}s"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ").strip()


def _longest_backtick_run(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)


# ---------------------------------------------------------------- JSON and writing


def render_json(run: RunRecord) -> str:
    return json.dumps(run.to_json(), indent=2) + "\n"


def write_reports(run: RunRecord, report_dir: Path) -> dict[str, Path]:
    """Write junit.xml, summary.md and run.json (each complete or absent, never half
    written); append the summary to $GITHUB_STEP_SUMMARY when set."""
    report_dir.mkdir(parents=True, exist_ok=True)
    rendered = {
        "junit.xml": render_junit(run),
        "summary.md": render_markdown(run),
        "run.json": render_json(run),
    }
    paths = {}
    for name, text in rendered.items():
        path = report_dir / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        paths[name] = path
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        try:
            with open(step_summary, "a", encoding="utf-8") as fh:
                fh.write(rendered["summary.md"])
        except OSError as exc:  # the reports above are written; the run's verdict stands
            print(
                f"warning: the summary was not appended to $GITHUB_STEP_SUMMARY ({step_summary}): "
                f"{exc.strerror or exc}",
                file=sys.stderr,
            )
    return paths
