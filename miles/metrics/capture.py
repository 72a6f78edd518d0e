"""Record a training process's metrics for the CI gate.

When `MILES_CI_GATE_RECORD_DIR` is set, every `log(step, {key: value})` rewrites this
process's record `<dir>/<pid>-<uuid>.jsonl` atomically (temp file, then rename), one line
per metric: `{"metric": key, "series": [[step, value], ...]}`. Non-finite values are
written as the strings "NaN", "Infinity", "-Infinity". A process killed at any moment
leaves the last complete record behind. Without the variable, `log` does nothing.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import uuid
from collections.abc import Mapping
from pathlib import Path

RECORD_DIR_ENV = "MILES_CI_GATE_RECORD_DIR"
STANDARD_METRICS = (
    "train/grad_norm",
    "train/ppo_kl",
    "train/train_rollout_logprob_abs_diff",
    "train/train_rollout_kl",
    "rollout/raw_reward",
)


# JSON has no non-finite numbers; every miles output (records, store, reports) spells them so.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_value(value: float) -> float | str:
    """The value itself, or its NON_FINITE spelling when it is NaN or infinite."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def decode_value(value: float | int | str) -> float:
    """Inverse of encode_value; KeyError for a string that is not a NON_FINITE spelling."""
    if isinstance(value, str):
        return NON_FINITE[value]
    return float(value)


class MetricRecorder:
    """Accumulates series in memory and rewrites the record file on every log call.

    Every numeric value is kept, so whatever key a gate declares is in the record. Each
    point is encoded once: a new step appends its text to the metric's line, and only a
    step logged out of order or twice makes that metric's line be encoded again, so a long
    run does not pay for re-encoding its whole history on every step.
    """

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise _refused(self.directory, "is a file, not a folder") from None
        except OSError as exc:
            raise _refused(self.directory, f"cannot be made ({exc.strerror or exc})") from None
        self.path = self.directory / f"{os.getpid()}-{uuid.uuid4().hex}.jsonl"
        self._series: dict[str, dict[int, float]] = {}
        self._encoded: dict[str, list[str]] = {}  # the points' JSON text, in step order
        self._last_step: dict[str, int] = {}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        step = int(step)
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue  # strings and other non-numbers are not gateable
            points = self._series.setdefault(key, {})
            points[step] = number
            if key in self._last_step and step > self._last_step[key]:
                self._encoded[key].append(_point(step, number))
            else:  # first point, or a step out of order or logged again
                self._encoded[key] = [_point(s, v) for s, v in sorted(points.items())]
            self._last_step[key] = max(step, self._last_step.get(key, step))
        self._write()

    def _write(self) -> None:
        lines = [
            f'{{"metric": {json.dumps(key)}, "series": [{", ".join(points)}]}}\n'
            for key, points in self._encoded.items()
        ]
        # Same directory as the record, so the rename is atomic: a reader (or a process
        # killed mid-write) only ever sees the previous complete record or the new one.
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            tmp.write_text("".join(lines), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # the folder went away or filled up while the run went on
            raise _refused(self.directory, f"cannot take the record ({exc.strerror or exc})") from None


class RecordDirError(ValueError):
    """$MILES_CI_GATE_RECORD_DIR names no folder this process can write its record into; the same
    on every rank of a job, said once, before anything is loaded."""

    same_on_every_rank = True


def check_record_dir() -> Path | None:
    """The record folder of $MILES_CI_GATE_RECORD_DIR (made if missing), once a file can be
    written in it; None when the variable is unset. A RecordDirError names the folder and why."""
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory:
        return None
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except FileExistsError:
        raise _refused(path, "is a file, not a folder") from None
    except OSError as exc:
        raise _refused(path, f"cannot take a file ({exc.strerror or exc})") from None
    return path


def _refused(path: Path, why: str) -> RecordDirError:
    return RecordDirError(
        f"{RECORD_DIR_ENV}={path} {why}: the CI gate's metric record cannot be written there; point it "
        "at a folder this user can write (the runner sets it for each attempt), or unset it"
    )


def _point(step: int, value: float) -> str:
    return json.dumps([step, encode_value(value)])


_recorder: MetricRecorder | None = None
_recorder_key: tuple[str, int] | None = None


def log(step: int, metrics: Mapping[str, float]) -> None:
    """Record `metrics` at `step` if this process runs under the CI gate; else do nothing."""
    global _recorder, _recorder_key
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory:
        return
    # A forked child must not share its parent's file: the pid is part of the key.
    key = (directory, os.getpid())
    if _recorder is None or _recorder_key != key:
        _recorder, _recorder_key = MetricRecorder(directory), key
    _recorder.log(step, metrics)
