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


def encode_value(value: float) -> float | str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    return value


def decode_value(value: float | int | str) -> float:
    if isinstance(value, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[value]
    return float(value)


class MetricRecorder:
    """Accumulates series in memory and rewrites the record file on every log call."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{os.getpid()}-{uuid.uuid4().hex}.jsonl"
        self._series: dict[str, dict[int, float]] = {}

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue  # strings and other non-numbers are not gateable
            self._series.setdefault(key, {})[int(step)] = number
        self._write()

    def _write(self) -> None:
        lines = [
            json.dumps({"metric": key, "series": [[s, encode_value(v)] for s, v in sorted(points.items())]})
            for key, points in self._series.items()
        ]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        os.replace(tmp, self.path)


_recorder: MetricRecorder | None = None
_recorder_dir: str | None = None


def log(step: int, metrics: Mapping[str, float]) -> None:
    """Record `metrics` at `step` if this process runs under the CI gate; else do nothing."""
    global _recorder, _recorder_dir
    directory = os.environ.get(RECORD_DIR_ENV)
    if not directory:
        return
    if _recorder is None or _recorder_dir != directory:
        _recorder, _recorder_dir = MetricRecorder(directory), directory
    _recorder.log(step, metrics)
