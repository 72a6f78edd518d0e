"""The seed lane's GPU twins share one way to run: `seed_train(recipe, flags, ...)` (seed_runs.py)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("seed_runs", Path(__file__).with_name("seed_runs.py"))
seed_runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(seed_runs)


@pytest.fixture
def seed_train(tmp_path: Path):
    """`seed_train(recipe, flags, model=..., gpus=...)` prepares and trains in a fresh directory;
    returns (metric record directory, output)."""
    return functools.partial(seed_runs.full_train, workdir=tmp_path)


@pytest.fixture
def series():
    """`series(record_dir, key)`: one metric's {step: value} from a run's capture records."""
    from miles.metrics.capture import decode_value

    def read(record_dir: Path, key: str) -> dict[int, float]:
        import json

        points: dict[int, float] = {}
        for record in Path(record_dir).glob("*.jsonl"):
            for line in record.read_text().splitlines():
                row = json.loads(line)
                if row["metric"] == key:
                    points.update({int(s): decode_value(v) for s, v in row["series"]})
        return points

    return read
