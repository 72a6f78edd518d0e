"""Read the metric records that training processes leave in a record directory.

A record is `<pid>-<uuid>.jsonl`, one complete line per metric (see capture.py). Every
line ends with a newline because the writer renames a finished file into place; a line
without one, or one that is not the expected JSON, means the file was cut short or written
by something else, and the record is refused with file:line and the reason.

The folder is the test's to write, so nothing in it is trusted to be what its name says:
only regular files are read (a FIFO, a device or a symlink is refused, never opened for a
blocking or endless read), each at most MAX_RECORD_BYTES, at most MAX_RECORD_FILES of them.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from miles.files import FileRefused, read_regular
from miles.metrics.capture import NON_FINITE, decode_value

MAX_RECORD_BYTES = 32 << 20  # a metric's line holds its whole series: ~30 bytes a step
MAX_RECORD_FILES = 1024  # one record per training process


class RecordError(ValueError):
    """A record that cannot be trusted to say what the run logged."""


@dataclass(frozen=True)
class MetricSeries:
    """One metric's values by step, in step order."""

    metric: str
    points: tuple[tuple[int, float], ...]

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(step for step, _ in self.points)

    def last(self) -> tuple[int, float]:
        return self.points[-1]

    def at(self, step: int) -> float | None:
        for s, value in self.points:
            if s == step:
                return value
        return None


def read_record(path: Path | str) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of one record file; RecordError if it is incomplete or malformed."""
    path = Path(path)
    try:
        text = read_regular(path, MAX_RECORD_BYTES, follow=False, what="record").decode("utf-8")
    except FileRefused as exc:
        raise RecordError(f"{exc}; a record is a file miles.metrics.capture renames into place") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: cannot read the record: {exc}") from exc
    series: dict[str, dict[int, float]] = {}
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        where = f"{path}:{number}"
        if not line.endswith("\n"):
            raise RecordError(
                f"{where}: the record ends mid-line, so the writing process was cut off; "
                "records from miles.metrics.capture are renamed into place complete, so "
                "rerun the test rather than trust a partial record"
            )
        metric, points = _parse_line(line, where)
        if metric in series:
            raise RecordError(
                f"{where}: metric '{metric}' appears twice in one record; each metric has one line"
            )
        series[metric] = points
    return series


def _parse_line(line: str, where: str) -> tuple[str, dict[int, float]]:
    expected = 'expected {"metric": "<key>", "series": [[step, value], ...]}'
    try:
        obj = json.loads(line, parse_constant=_bare_constant)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{where}: not valid JSON ({exc.msg}); {expected}") from None
    except RecursionError:
        raise RecordError(f"{where}: nested too deeply to be a record; {expected}") from None
    except ValueError as exc:  # a bare NaN/Infinity, or an integer too long to convert
        raise RecordError(f"{where}: {exc}; {expected}") from None
    if (
        not isinstance(obj, dict)
        or not isinstance(obj.get("metric"), str)
        or not isinstance(obj.get("series"), list)
    ):
        raise RecordError(f"{where}: {expected}")
    points: dict[int, float] = {}
    for point in obj["series"]:
        if (
            not isinstance(point, list)
            or len(point) != 2
            or not isinstance(point[0], int)
            or isinstance(point[0], bool)
            or not _is_value(point[1])
        ):
            raise RecordError(
                f"{where}: point {point!r} of '{obj['metric']}' is not [step, value] with an integer "
                f"step and a number or one of {', '.join(NON_FINITE)}"
            )
        if not 0 <= point[0] <= MAX_STEP:
            raise RecordError(
                f"{where}: step {_short(point[0])} of '{obj['metric']}' is not in 0..{MAX_STEP}"
            )
        try:
            value = decode_value(point[1])
        except OverflowError:
            value = math.nan
        if isinstance(point[1], int | float) and not math.isfinite(value):
            raise RecordError(
                f"{where}: value {_short(point[1])} of '{obj['metric']}' at step {point[0]} is out of range; "
                f"non-finite values are written as {', '.join(NON_FINITE)}"
            )
        points[point[0]] = value
    return obj["metric"], points


MAX_STEP = 2**53  # steps must survive a float and both stores' integer columns


def _bare_constant(name: str) -> float:
    raise ValueError(f'bare {name} is not a record value (write it as the string "{name}")')


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} characters)"


def _is_value(value: object) -> bool:
    if isinstance(value, str):
        return value in NON_FINITE
    return isinstance(value, int | float) and not isinstance(value, bool)


def merge_records(directory: Path | str) -> dict[str, MetricSeries]:
    """Merge every record in `directory` (all processes of one attempt) into one series per metric.

    Two processes may log the same metric at the same step (ranks of one job) only with
    the same value; different values would make the gate's input depend on file order.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise RecordError(f"{directory}: no such record directory")
    merged: dict[str, dict[int, float]] = {}
    source: dict[tuple[str, int], Path] = {}
    for path in _record_files(directory):
        for metric, points in read_record(path).items():
            into = merged.setdefault(metric, {})
            for step, value in points.items():
                if step in into and not _same(into[step], value):
                    raise RecordError(
                        f"{path}: '{metric}' at step {step} is {value!r} here but {into[step]!r} in "
                        f"{source[metric, step].name}; log gated metrics from one rank only"
                    )
                into[step] = value
                source.setdefault((metric, step), path)
    return {metric: MetricSeries(metric, tuple(sorted(points.items()))) for metric, points in merged.items()}


def _record_files(directory: Path) -> list[Path]:
    """The record files of `directory`, sorted; a RecordError past MAX_RECORD_FILES (the
    listing stops there, so a folder of millions of files costs no more than that)."""
    found = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.name.endswith(".jsonl") and not entry.name.startswith("."):
                    found.append(Path(entry.path))
                    if len(found) > MAX_RECORD_FILES:
                        raise RecordError(
                            f"{directory}: more than {MAX_RECORD_FILES} record files; one training "
                            "process writes one, so something else filled the folder"
                        )
    except OSError as exc:
        raise RecordError(f"{directory}: cannot list the record directory ({exc.strerror})") from None
    return sorted(found)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))
