"""Propose est_time values from measured durations, and write them into the test files.

A proposal needs at least MIN_PASSED_RUNS passed runs of that file on that backend and
suite: est_time = the `quantile` (default 0.9, nearest rank) of the passed durations,
rounded up to a bucket (a second below 10 s, 5 s below a minute, 15 s below 5 minutes, a minute below half an
hour, 5 minutes above), so the numbers do not churn run to run. `--write` replaces only the
number inside the `register_*_ci(...)` call; every other byte of the file stays as it was. A
file that registers implicitly (a directory of the catalog's [implicit] table, tests/unit) gets
its own call instead, `register_cpu_ci(est_time=N, suite="<the directory's suite>")` after its
imports, and the marker's import among them: the same suite, its own measured est_time.
"""

from __future__ import annotations

import ast
import difflib
import io
import math
import os
import re
import stat
import tokenize
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles.ci.register import BACKEND_OF_MARKER
from miles.ci.registry.discover import Discovery
from miles.ci.registry.registration import Registration
from miles.ci.reports.durations import load_durations
from miles.files import read_regular, replace_file
from miles.text import printable

DEFAULT_QUANTILE = 0.9
MIN_PASSED_RUNS = 3
# est_time is what a file takes, so the plan predicts a run's wall time; the headroom is the
# timeout's (plan.TIMEOUT_FACTOR x est_time, counted at the machine's load: miles.load.LoadClock)
MARGIN = 1.0
BUCKETS = ((10.0, 1.0), (60.0, 5.0), (300.0, 15.0), (1800.0, 60.0), (math.inf, 300.0))  # (below, step)
MARKER_OF_BACKEND = {backend: name for name, backend in BACKEND_OF_MARKER.items()}
MAX_SOURCE_BYTES = 64 << 20


def nearest_rank_quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: a value that was actually measured."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def round_up_to_bucket(seconds: float) -> float:
    for below, step in BUCKETS:
        if seconds <= below:
            return max(step, math.ceil(seconds / step - 1e-9) * step)
    raise AssertionError("unreachable: the last bucket is unbounded")


@dataclass(frozen=True)
class Proposal:
    registration: Registration
    passed_runs: int
    measured: float | None  # the quantile of passed durations
    proposed: float | None  # None: not enough data, or cannot be written
    note: str = ""

    @property
    def changes(self) -> bool:
        return self.proposed is not None and self.proposed != self.registration.est_time


@dataclass(frozen=True)
class Proposals:
    rows: tuple[Proposal, ...]
    quantile: float

    @property
    def changes(self) -> tuple[Proposal, ...]:
        return tuple(p for p in self.rows if p.changes)

    def table(self) -> list[str]:
        q = f"p{self.quantile * 100:g}"
        lines = [f"{'BACKEND':<8}{'SUITE':<30}{'CURRENT':>9}{'PROPOSED':>10}{q:>9}{'RUNS':>6}  FILE"]
        for p in self.rows:
            r = p.registration
            proposed = f"{p.proposed:g}" if p.proposed is not None else "-"
            measured = f"{p.measured:.1f}" if p.measured is not None else "-"
            mark = "  *" if p.changes else ""
            note = f"  ({p.note})" if p.note else ""
            lines.append(
                f"{r.backend:<8}{r.suite:<30}{r.est_time:>9g}{proposed:>10}{measured:>9}{p.passed_runs:>6}  "
                f"{r.file}{mark}{note}"
            )
        lines.append(f"{len(self.changes)} change(s) proposed (* marks them); --write applies them")
        return [printable(line) for line in lines]


def propose(
    discovery: Discovery,
    durations: Path | str | None = None,
    *,
    backend: str | None = None,
    suite: str | None = None,
    quantile: float = DEFAULT_QUANTILE,
    min_runs: int = MIN_PASSED_RUNS,
) -> Proposals:
    """A proposal for every matching registration, from the stored durations."""
    cache: dict[tuple[str, str], dict] = {}
    rows = []
    for reg in sorted(discovery.registrations, key=lambda r: (r.backend, r.suite, r.file)):
        if (backend and reg.backend != backend) or (suite and reg.suite != suite):
            continue
        key = (reg.backend, reg.suite)
        if key not in cache:
            cache[key] = load_durations(reg.backend, reg.suite, durations)
        passed = [elapsed for elapsed, ok in cache[key].get(reg.file, []) if ok]
        if len(passed) < min_runs:
            rows.append(Proposal(reg, len(passed), None, None, f"needs {min_runs} passed runs"))
            continue
        measured = nearest_rank_quantile(passed, quantile)
        proposed = round_up_to_bucket(measured * MARGIN)
        note = f"implicit: --write adds {MARKER_OF_BACKEND[reg.backend]}(...)" if reg.implicit else ""
        rows.append(Proposal(reg, len(passed), measured, proposed, note))
    return Proposals(tuple(rows), quantile)


def format_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")  # lines as the tokenizer counts them


def _est_time_span(text: str, reg: Registration) -> tuple[int, int]:
    """Character offsets of the est_time literal in `reg`'s register_*_ci call."""
    tree = ast.parse(text, reg.file)
    marker = MARKER_OF_BACKEND[reg.backend]
    for stmt in tree.body:
        call = stmt.value if isinstance(stmt, ast.Expr) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == marker):
            continue
        if call.lineno != reg.line:
            continue
        node = next(
            (k.value for k in call.keywords if k.arg == "est_time"), call.args[0] if call.args else None
        )
        if not isinstance(node, ast.Constant) or isinstance(node.value, bool):
            break
        lines = _LINE.findall(text)
        return _offset(lines, node.lineno, node.col_offset), _offset(
            lines, node.end_lineno, node.end_col_offset
        )
    raise ValueError(f"{reg.file}:{reg.line}: no {marker}(...) call with a literal est_time at this line")


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """Character offset in the text of (line, ast column); ast columns count UTF-8 bytes."""
    before = sum(len(line) for line in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode("utf-8")[:col].decode("utf-8"))


def registered(text: str, reg: Registration, est_time: float, rel: str) -> str:
    """`text` with its own registration for what `reg` (an implicit one) gave it: the marker's
    import among the file's imports, the call after them."""
    marker = MARKER_OF_BACKEND[reg.backend]
    tree = ast.parse(text, rel)
    body = list(tree.body)
    start = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    imports = []
    for stmt in body[start:]:
        if not isinstance(stmt, ast.Import | ast.ImportFrom):
            break
        imports.append(stmt)
    lines = _LINE.findall(text)
    call = f'{marker}(est_time={format_seconds(est_time)}, suite="{reg.suite}")'
    at_call = imports[-1].end_lineno if imports else (body[0].end_lineno if start else 0)
    has_marker = any(isinstance(s, ast.ImportFrom) and s.module == "miles.ci.register" for s in imports)
    import_line = None if has_marker else f"from miles.ci.register import {marker}"
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    ours = [i for i in imports if _module_of(i).split(".")[0] == "miles"]
    later = [i for i in ours if _module_of(i) > "miles.ci.register" and isinstance(i, ast.ImportFrom)]
    out = list(lines)
    if lines and not lines[-1].endswith(("\n", "\r")):
        out[-1] += newline
    out.insert(at_call, f"{newline}{call}{newline}")
    if import_line is not None:
        if later:
            out.insert(later[0].lineno - 1, import_line + newline)
        elif ours:
            out.insert(ours[-1].end_lineno, import_line + newline)
        else:
            out.insert(at_call, (newline if imports else "") + import_line + newline)
    return "".join(out)


def _module_of(stmt: ast.Import | ast.ImportFrom) -> str:
    return stmt.module or "" if isinstance(stmt, ast.ImportFrom) else stmt.names[0].name


def _replace_spans(source: str, edits: list[tuple[tuple[int, int], str]]) -> str:
    out = source
    for (start, end), text in sorted(edits, key=lambda e: e[0][0], reverse=True):
        out = out[:start] + text + out[end:]
    return out


def apply_proposals(root: Path | str, proposals: Sequence[Proposal]) -> str:
    """Write the proposed numbers into their files; returns the unified diff of what changed."""
    root = Path(root)
    by_file: dict[str, list[Proposal]] = {}
    for p in proposals:
        if p.changes:
            by_file.setdefault(p.registration.file, []).append(p)
    diffs = []
    for rel, items in sorted(by_file.items()):
        path = root / rel
        raw = read_regular(path, MAX_SOURCE_BYTES, what="test file")
        # the file's own encoding (a BOM, a PEP 263 cookie) in and out: only the number changes
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
        before = raw.decode(encoding)
        explicit = [p for p in items if not p.registration.implicit]
        after = _replace_spans(
            before, [(_est_time_span(before, p.registration), format_seconds(p.proposed)) for p in explicit]
        )
        for p in items:
            if p.registration.implicit:
                after = registered(after, p.registration, p.proposed, rel)
        ast.parse(after, rel)  # never leave a file that no longer parses
        # a new file renamed over the test file: a link planted at a temp name is never followed
        replace_file(path, after.encode(encoding), mode=stat.S_IMODE(os.stat(path).st_mode))
        diffs.extend(
            difflib.unified_diff(
                before.splitlines(keepends=True),
                after.splitlines(keepends=True),
                fromfile=f"a/{rel}",
                tofile=f"b/{rel}",
            )
        )
    return "".join(diffs)
