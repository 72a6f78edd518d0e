"""JUnit, Markdown and JSON: renderers of one RunRecord.

`render_junit`, `render_markdown` (miles.ci.reports.summary) and `render_json` each take the same
RunRecord and nothing else; `write_reports` writes all three atomically (temp file, rename)
and appends the Markdown to `$GITHUB_STEP_SUMMARY` when it is set. The JUnit file is valid
XML 1.0 whatever the tests printed: colour codes are dropped and characters XML cannot hold
(the C0 controls but tab and newline) are written as visible `\\xNN` escapes.
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from miles.ci.reports.record import (
    CANCELLED,
    ERROR,
    FAILED,
    SKIPPED,
    TIMEOUT,
    Attempt,
    RunRecord,
)
from miles.ci.reports.summary import ANSI, escape_char, render_markdown, run_title
from miles.files import Folder, read_regular
from miles.metrics import gate

__all__ = ["REPORT_FILES", "render_json", "render_junit", "render_markdown", "write_reports", "xml_safe"]

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
    _make_xml_safe(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# XML 1.0 allows tab, newline, carriage return and everything from U+0020 except the
# surrogates and U+FFFE/U+FFFF; the rest makes lxml and ElementTree refuse the whole file.
_NOT_XML = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def xml_safe(text: str) -> str:
    """`text` without colour codes, with characters XML 1.0 cannot hold as visible escapes."""
    return _NOT_XML.sub(escape_char, ANSI.sub("", text))


def _make_xml_safe(root: ET.Element) -> None:
    for el in root.iter():
        if el.text:
            el.text = xml_safe(el.text)
        if el.tail:
            el.tail = xml_safe(el.tail)
        for key, value in el.attrib.items():
            el.attrib[key] = xml_safe(value)


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
    stopped = [f"attempt {a.attempt}: stopped {p}" for a in history for p in a.killed]
    if stopped:
        ET.SubElement(el, "system-err").text = "processes the runner stopped:\n" + "\n".join(stopped)
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


# ---------------------------------------------------------------- the report folder

ATTEMPTS = "attempts"
OWNER_FILE = ".miles-reports.json"  # which attempts/ folder a run of miles made here


class ReportDirError(ValueError):
    """The report folder cannot be claimed for a new run (the runner refuses the run: exit 2)."""


def claim_report_dir(report_dir: Path) -> tuple[Folder, Folder]:
    """Open the report folder for a new run and make its attempts/ folder afresh: (report
    folder, attempts folder), both held open by descriptor.

    The previous run's attempts/ is deleted only when it is the very folder (device, inode)
    that run recorded making; attempts/ or a report file that no miles run made there is never
    deleted or overwritten: ReportDirError before anything is written."""
    try:
        folder = Folder.open(report_dir, create=True)
    except OSError as exc:
        raise ReportDirError(f"--report-dir {report_dir}: cannot create it ({exc.strerror})") from None
    try:
        made = _recorded_attempts(folder)
        if made is not None:
            folder.remove_folder(ATTEMPTS, made)  # only the very folder that run made
        present = [name for name in (ATTEMPTS, *REPORT_FILES) if folder.lstat(name) is not None]
        # without a record nothing here is a run's; with one, its reports are (replaced later)
        foreign = present if made is None else [name for name in present if name == ATTEMPTS]
        if foreign:
            raise ReportDirError(
                f"--report-dir {report_dir} already holds {', '.join(foreign)}, which no miles run made "
                "there; the runner never deletes or overwrites what it did not write: move them away "
                "or choose another --report-dir"
            )
        attempts = folder.subfolder(ATTEMPTS, exclusive=True)
        identity = attempts.identity()
        folder.replace(OWNER_FILE, json.dumps({"attempts": list(identity)}).encode())
    except OSError as exc:
        folder.close()
        raise ReportDirError(
            f"--report-dir {report_dir}: cannot prepare it ({exc.strerror or exc})"
        ) from None
    except BaseException:
        folder.close()
        raise
    return folder, attempts


def _recorded_attempts(folder: Folder) -> tuple[int, int] | None:
    """The (device, inode) of the attempts/ folder the last run recorded making, if any."""
    try:
        data = json.loads(read_regular(folder.path / OWNER_FILE, 4096, follow=False))
        device, inode = data["attempts"]
        if isinstance(device, int) and isinstance(inode, int):
            return device, inode
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


# ---------------------------------------------------------------- JSON and writing


def render_json(run: RunRecord) -> str:
    return json.dumps(run.to_json(), indent=2) + "\n"


def write_reports(run: RunRecord, report_dir: Path | Folder, *, step_summary: bool = True) -> dict[str, Path]:
    """Write junit.xml, summary.md and run.json (each complete or absent, never half
    written); append the summary to $GITHUB_STEP_SUMMARY when set and `step_summary`.

    Each is a new file renamed over its name (miles.files.Folder.replace), so a link a test
    planted in the report folder, under the report's name or its temp file's, is replaced,
    never written through."""
    rendered = {
        "junit.xml": render_junit(run),
        "summary.md": render_markdown(run),
        "run.json": render_json(run),
    }
    folder = report_dir if isinstance(report_dir, Folder) else Folder.open(report_dir, create=True)
    try:
        paths = {
            name: folder.replace(name, text.encode("utf-8", errors="backslashreplace"))
            for name, text in rendered.items()
        }
    finally:
        if folder is not report_dir:
            folder.close()
    summary_path = os.environ.get("GITHUB_STEP_SUMMARY") if step_summary else None
    if summary_path:
        try:
            with open(summary_path, "a", encoding="utf-8", errors="backslashreplace") as fh:
                fh.write(rendered["summary.md"])
        except OSError as exc:  # the reports above are written; the run's verdict stands
            print(
                f"warning: the summary was not appended to $GITHUB_STEP_SUMMARY ({summary_path}): "
                f"{exc.strerror or exc}",
                file=sys.stderr,
            )
    return paths
