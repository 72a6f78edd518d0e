"""Cost of `capture.log` over a long run, against re-encoding every point on every call.

    python benchmarks/bench_metric_capture.py [--steps 1000] [--metrics 30] [--repeat 2]

The record must be rewritten whole and atomically on every call (a killed process leaves
a complete file), so each call costs at least writing the file. The baseline encodes
every stored point again on each call (json.dumps of the full series per metric); miles'
recorder encodes each point once and joins the cached text. Both write the same bytes to
the same kind of file in one process; the figures are CPU seconds (the machine is
shared), best of --repeat, with the per-call cost at the end of the run and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.metrics.capture import MetricRecorder, encode_value  # noqa: E402


class ReencodingRecorder:
    """The straightforward writer: every call encodes every point of every metric."""

    def __init__(self, directory: Path):
        self.path = directory / f"{os.getpid()}-{uuid.uuid4().hex}.jsonl"
        self._series: dict[str, dict[int, float]] = {}

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self._series.setdefault(key, {})[step] = float(value)
        lines = [
            json.dumps({"metric": k, "series": [[s, encode_value(v)] for s, v in sorted(p.items())]}) + "\n"
            for k, p in self._series.items()
        ]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(lines), encoding="utf-8")
        os.replace(tmp, self.path)


def run(recorder_cls, directory: Path, steps: int, metrics: int) -> tuple[float, float, bytes]:
    recorder = recorder_cls(directory)
    keys = [f"train/metric_{i}" for i in range(metrics)]
    tail_start = steps - max(1, steps // 20)
    start = time.process_time()
    tail = 0.0
    for step in range(steps):
        before = time.process_time()
        recorder.log(step, {k: 1.0 / (step + i + 1) for i, k in enumerate(keys)})
        if step >= tail_start:
            tail += time.process_time() - before
    total = time.process_time() - start
    return total, tail / (steps - tail_start), recorder.path.read_bytes()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--metrics", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(args.repeat):
            for name, cls in (
                ("re-encode every point", ReencodingRecorder),
                ("miles capture", MetricRecorder),
            ):
                directory = Path(tmp) / f"{attempt}-{name.replace(' ', '-')}"
                directory.mkdir()
                total, per_call, content = run(cls, directory, args.steps, args.metrics)
                if name not in best or total < best[name][0]:
                    best[name] = (total, per_call, content)
    base, ours = best["re-encode every point"], best["miles capture"]
    if base[2] != ours[2]:
        print("error: the two writers produced different records", file=sys.stderr)
        return 1
    print(f"{args.steps} steps x {args.metrics} metrics, record {len(ours[2]) / 1e6:.2f} MB at the end")
    for name, (total, per_call, _) in best.items():
        print(f"  {name:<22} total {total:7.2f} s CPU   per call at the end {per_call * 1e3:7.2f} ms")
    print(
        f"  ratio (re-encode / miles): total {base[0] / ours[0]:.2f}x, per call at the end {base[1] / ours[1]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
