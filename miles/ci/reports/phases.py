"""Where each attempt's wall time went, from the phase records its processes wrote (miles.phases).

Every instant of an attempt, from its start to its end, is charged to exactly one phase: the
first in PRECEDENCE of the phases some process of the attempt was in at that instant, or
`other` when none was (a test's own work, waiting on a launcher). So a file's row adds up to its
elapsed time, and the lane's table to the lane's. Two ranks in the same phase count once.

The records are the test's own writing: read bounded (MAX_FILES files, MAX_BYTES each, lines that
do not parse skipped), never followed through a link, clipped to the attempt's own time.
"""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from miles.phases import CHECKPOINT, INIT, PHASES, ROLLOUT, START, TEARDOWN, TRAIN

OTHER = "other"
COLUMNS = (*PHASES, OTHER)
# Which phase an instant belongs to when processes were in several: imports and teardown are
# what they are whatever else runs; a conversion inside a model build is the conversion's.
PRECEDENCE = (START, TEARDOWN, CHECKPOINT, INIT, TRAIN, ROLLOUT)
MAX_FILES = 256
MAX_BYTES = 4 << 20


def read_intervals(folder: Path | str) -> list[tuple[str, float, float | None]]:
    """(phase, start, end) of every well-formed line of the folder's `*.jsonl` files."""
    out: list[tuple[str, float, float | None]] = []
    try:
        with os.scandir(folder) as entries:
            names = sorted(
                e.name for e in entries if e.name.endswith(".jsonl") and not e.name.startswith(".")
            )
    except OSError:
        return out
    for name in names[:MAX_FILES]:
        out.extend(_parse(_read(Path(folder) / name)))
    return out


def _read(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return ""
        return os.read(fd, MAX_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def _parse(text: str) -> Iterable[tuple[str, float, float | None]]:
    for line in text.splitlines():
        try:
            row = json.loads(line)
            name, start, end = row["phase"], float(row["start"]), row["end"]
            end = None if end is None else float(end)
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        if name in PHASES and math.isfinite(start) and (end is None or math.isfinite(end)):
            yield name, start, end


def attribute(
    intervals: Sequence[tuple[str, float, float | None]], start: float, end: float
) -> dict[str, float]:
    """Seconds of [start, end] charged to each phase of COLUMNS (see the module's docstring)."""
    events: list[tuple[float, int, str]] = []  # (time, +1 opens / -1 closes, phase)
    for name, a, b in intervals:
        a, b = max(a, start), min(end if b is None else b, end)
        if b > a:
            events += [(a, 1, name), (b, -1, name)]
    events.sort(key=lambda e: (e[0], e[1]))
    open_count = dict.fromkeys(PHASES, 0)
    seconds = dict.fromkeys(COLUMNS, 0.0)
    last = start
    for when, delta, name in events:
        seconds[_current(open_count)] += when - last
        open_count[name] += delta
        last = when
    seconds[_current(open_count)] += max(0.0, end - last)
    return seconds


def _current(open_count: Mapping[str, int]) -> str:
    return next((p for p in PRECEDENCE if open_count[p] > 0), OTHER)


def attempt_phases(folder: Path | str, started_at: float, elapsed: float) -> tuple[tuple[str, float], ...]:
    """The attempt's seconds per column, rounded to 0.1 s (an empty tuple when nothing was recorded)."""
    intervals = read_intervals(folder)
    if not intervals:
        return ()
    seconds = attribute(intervals, started_at, started_at + elapsed)
    return tuple((name, round(seconds[name], 1)) for name in COLUMNS)


def totals(rows: Iterable[Mapping[str, float]]) -> dict[str, float]:
    out = dict.fromkeys(COLUMNS, 0.0)
    for row in rows:
        for name in COLUMNS:
            out[name] += row.get(name, 0.0)
    return out


TOP_FILES = 15  # the slowest files a table names


def slowest(attempts) -> list[tuple[str, float, float, dict[str, float]]]:
    """(file, elapsed, CPU seconds, seconds per column) of each attempt that recorded phases,
    slowest first."""
    rows = [(a.file, a.elapsed, a.cpu, dict(a.phases)) for a in attempts if a.phases]
    return sorted(rows, key=lambda r: -r[1])


def text_table(attempts) -> list[str]:
    """The run's seconds per phase, then its slowest files', in aligned columns for the console."""
    rows = slowest(attempts)
    if not rows:
        return []
    total = totals(r[3] for r in rows)
    wall, cpu = sum(r[1] for r in rows), sum(r[2] for r in rows)
    width = max(len(f"all {len(rows)} files"), *(len(r[0]) for r in rows[:TOP_FILES]))
    head = f"{'':<{width}}  {'elapsed':>8}{'cpu':>8}" + "".join(f"{c:>11}" for c in COLUMNS)
    out = ["where the time went (seconds per phase; cpu: the file's processes' CPU seconds):", head]
    out.append(
        f"{f'all {len(rows)} files':<{width}}  {wall:>8.0f}{cpu:>8.0f}"
        + "".join(f"{total[c]:>11.0f}" for c in COLUMNS)
    )
    for file, elapsed, used, seconds in rows[:TOP_FILES]:
        out.append(
            f"{file:<{width}}  {elapsed:>8.1f}{used:>8.1f}"
            + "".join(f"{seconds.get(c, 0.0):>11.1f}" for c in COLUMNS)
        )
    return out
