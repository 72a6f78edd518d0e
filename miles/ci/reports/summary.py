"""The Markdown step summary of a RunRecord, and the text escaping every renderer shares.

File names, messages and output are anyone's text (a file may be called `a|b`, hold a
backtick or a newline; output carries terminal colours). `printable` makes them one visible
line, `code` and `cell` keep a Markdown table a table, `mermaid_name` keeps a gantt parsable.
"""

from __future__ import annotations

import html
import re

from miles.ci.reports.phases import COLUMNS, TOP_FILES, slowest, totals
from miles.ci.reports.record import CANCELLED, ERROR, FAILED, FLAKY, PASSED, SKIPPED, TIMEOUT, RunRecord
from miles.text import ANSI, CONTROL, escape_char, printable

__all__ = [
    "ANSI",
    "cell",
    "code",
    "escape_char",
    "mermaid_name",
    "printable",
    "printable_block",
    "render_markdown",
]

STATUS_ICON = {
    PASSED: "✅",
    FLAKY: "🔁",
    FAILED: "❌",
    TIMEOUT: "⏱️",
    ERROR: "💥",
    CANCELLED: "🛑",
    SKIPPED: "⏭️",
}
_MERMAID_UNSAFE = re.compile(r"[^\w ./()\[\]+=,@-]")


def printable_block(text: str) -> str:
    """Output for a fenced block: colour codes dropped, newlines and tabs kept, other
    control characters shown as \\xNN."""
    return CONTROL.sub(escape_char, ANSI.sub("", text.replace("\r\n", "\n")))


def code(text: str) -> str:
    """An inline code span that holds any text and stays inside one table cell."""
    shown = printable(text).replace("|", "\\|")
    fence = "`" * (_longest_backtick_run(shown) + 1)
    pad = " " if shown.startswith("`") or shown.endswith("`") else ""
    return f"{fence}{pad}{shown}{pad}{fence}"


def cell(text: str) -> str:
    """Plain text for a table cell: one line, no table-breaking '|', no raw HTML."""
    return html.escape(printable(text), quote=False).replace("|", "\\|").strip()


def mermaid_name(text: str) -> str:
    """A gantt task name: mermaid reads ':' '#' ';' and line breaks as syntax."""
    return _MERMAID_UNSAFE.sub("_", printable(text))


def _longest_backtick_run(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)


def run_title(run: RunRecord) -> str:
    return f"{run.lane or run.backend} shard {run.shard}"


def render_markdown(run: RunRecord) -> str:
    """The step summary: counts, then failed, flaky, retried, stopped-process, gate,
    disabled and passed tables, where the time went (per phase), then a mermaid gantt of the
    shard's timeline."""
    counts = run.counts()
    if not run.complete:
        verdict = "⚠️ incomplete"
    else:
        verdict = "✅ passed" if run.passed else ("🛑 cancelled" if run.cancelled_by else "❌ failed")
    wall = run.finished_at - run.started_at
    predicted = run.predicted if run.predicted is not None else sum(a.est_time for a in run.final_attempts)
    labels = "(not given: all labels admitted)" if run.labels is None else (" ".join(run.labels) or "(none)")
    out = [
        f"## miles CI · {run_title(run)} · {verdict}",
        "",
        f"suites {', '.join(run.suites) or '-'} · backend {run.backend} · cadence {run.cadence} · "
        f"labels {cell(labels)} · commit `{run.commit[:12] or 'unknown'}` · "
        f"wall {_duration(wall)} (predicted {_duration(predicted)})",
        "",
    ]
    if not run.complete:
        out += [
            "**The run has not finished** (it is still running, or the runner was stopped before "
            "it could finish); tests not yet ended are marked cancelled.",
            "",
        ]
    if run.cancelled_by:
        out += [
            f"**The run was cancelled by {run.cancelled_by}**; unfinished tests are marked cancelled.",
            "",
        ]
    out += [
        "| passed | flaky | failed | timed out | errors | cancelled | not run | retried | disabled |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {counts[PASSED]} | {counts[FLAKY]} | {counts[FAILED]} | {counts[TIMEOUT]} | {counts[ERROR]} "
        f"| {counts[CANCELLED]} | {counts[SKIPPED]} | {counts['retried']} | {counts['disabled']} |",
        "",
    ]
    out += _failed(run)
    out += _table(
        "Flaky (failed as infrastructure, then passed)",
        ("file", "suite", "attempts", "what failed first"),
        [(code(a.file), a.suite, str(a.attempt), cell(a.message)) for a in run.flaky],
    )
    out += _table(
        "Retried",
        ("file", "attempt", "result", "why it was retried"),
        [
            (code(a.file), str(a.attempt), f"{a.status} ({a.classification})", cell(a.retry_reason or ""))
            for a in run.retried
        ],  # fmt: skip
    )
    out += _table(
        "Processes the runner stopped",
        ("file", "attempt", "status", "processes"),
        [
            (code(a.file), str(a.attempt), a.status, cell("; ".join(a.killed)))
            for a in run.attempts
            if a.killed
        ],
    )
    out += _table(
        "Metric gates",
        ("file", "metric", "status", "message"),
        [
            (code(a.file), code(v["metric"]), v["status"], cell(v["message"]))
            for a in run.final_attempts
            for v in a.gate_verdicts
        ],  # fmt: skip
    )
    out += _table(
        "Disabled",
        ("file", "suite", "reason"),
        [(code(e.file), e.suite, cell(e.reason)) for e in run.excluded if e.kind == "disabled"],
    )
    out += _table(
        "Not run",
        ("file", "suite", "why"),
        [(code(a.file), a.suite, cell(a.message)) for a in run.final_attempts if a.status == SKIPPED],
    )
    out += _table(
        "Not selected",
        ("file", "suite", "why"),
        [(code(e.file), e.suite, cell(e.reason)) for e in run.excluded if e.kind != "disabled"],
    )
    out += _table(
        "Passed",
        ("file", "suite", "elapsed", "est_time", "tests"),
        [
            (code(a.file), a.suite, f"{a.elapsed:.1f}s", f"{a.est_time:g}s", str(len(a.cases)))
            for a in run.final_attempts
            if a.status == PASSED
        ],  # fmt: skip
        align=("---", "---", "---:", "---:", "---:"),
    )
    out += phase_table(run.final_attempts)
    out += _gantt(run)
    return "\n".join(out) + "\n"


def phase_table(attempts) -> list[str]:
    """Where the time went: the run's seconds per phase, then its slowest files' (see
    miles.ci.reports.phases); nothing when no attempt recorded phases."""
    rows = slowest(attempts)
    if not rows:
        return []
    total, wall, cpu = totals(r[3] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows)
    share = " | ".join(f"{total[c]:.0f}s ({100 * total[c] / wall if wall else 0:.0f}%)" for c in COLUMNS)
    lines = [
        "### Where the time went",
        "",
        "Seconds per phase of each file's wall time; cpu: the CPU seconds its processes used.",
        "",
        f"| file | elapsed | cpu | {' | '.join(COLUMNS)} |",
        f"| --- | ---: | ---: | {' | '.join('---:' for _ in COLUMNS)} |",
        f"| all {len(rows)} files | {_duration(wall)} | {_duration(cpu)} | {share} |",
    ]
    for file, elapsed, used, seconds in rows[:TOP_FILES]:
        cells = " | ".join(f"{seconds.get(c, 0.0):.1f}s" for c in COLUMNS)
        lines.append(f"| {code(file)} | {elapsed:.1f}s | {used:.1f}s | {cells} |")
    return [*lines, ""]


def _table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]], align=None) -> list[str]:
    if not rows:
        return []
    align = align or tuple("---" for _ in header)
    lines = [f"### {title}", "", f"| {' | '.join(header)} |", f"| {' | '.join(align)} |"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return [*lines, ""]


def _failed(run: RunRecord) -> list[str]:
    bad = [a for a in run.final_attempts if not a.ok]
    out = _table(
        "Failed",
        ("file", "suite", "status", "why", "attempts", "elapsed / est"),
        [
            (
                code(a.file),
                a.suite,
                f"{STATUS_ICON[a.status]} {a.status} ({a.classification})",
                cell(a.message),
                str(a.attempt),
                f"{a.elapsed:.1f}s / {a.est_time:g}s",
            )
            for a in bad
        ],  # fmt: skip
        align=("---", "---", "---", "---", "---:", "---"),
    )
    for a in bad:
        tail = printable_block(a.output_tail).rstrip("\n")[-4000:]
        if tail.strip():
            fence = "`" * max(3, _longest_backtick_run(tail) + 1)
            out += [
                f"<details><summary>output tail of <code>{html.escape(printable(a.file))}</code></summary>",
                "",
                fence,
                tail,
                fence,
                "",
                "</details>",
                "",
            ]
    return out


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
            lines.append(f"    section {mermaid_name(section)}")
        # wall-clock milliseconds: the axis then shows when each test ran, in the reader's time zone
        start = int(a.started_at * 1000)
        end = max(start + 1, int(a.finished_at * 1000))
        tag = "done" if a.status in (PASSED, FLAKY) else ("active" if id(a) not in finals else "crit")
        name = mermaid_name(a.file) + (f" (attempt {a.attempt})" if a.attempt > 1 else "")
        lines.append(f"    {name} :{tag}, t{n}, {start}, {end}")
    return [*lines, "```", ""]


def _duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{sec:02d}s" if hours else f"{minutes}m{sec:02d}s"
