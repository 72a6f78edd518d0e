"""Discovery speed against pytest's own collection, on the same generated trees.

    python benchmarks/bench_discover.py [--sizes 1000 10000] [--repeat 3]

For each size it writes that many registered test files (two registrations, a gate and a
few test functions each, like this repository's e2e tests), then reports files/s for:
  - cold: every file parsed (no cache), the prefix shortcut on,
  - full: every file parsed in full (what the prefix shortcut saves),
  - warm: the discovery cache of unchanged files (what `list`, `audit` and the runner
    see on the second and later calls),
  - `pytest --collect-only -q` on the same tree,
and the ratios against pytest. Each figure is the best of --repeat runs, in CPU seconds of
the process that did the work (this machine is shared; wall seconds are printed too).
Targets: >= 20,000 files/s and >= 20x faster than pytest collection.
"""

from __future__ import annotations

import argparse
import ast
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.ci.registry import discover as discover_module  # noqa: E402
from miles.ci.registry.catalog import load_catalog  # noqa: E402

TEMPLATE = '''"""End-to-end case {i}: trains a tiny model and checks the rollout metrics."""

import os

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time={est}, suite="stage-c-4-gpu-h200", labels=["megatron", "long"])
register_rocm_ci(
    est_time={est_rocm},
    suite="nightly-stage-c-4-gpu-mi350",
    labels=["megatron", "amd"],
    nightly=True,
)
register_ci_gate(metric_key="train/grad_norm")

NUM_STEPS = 3


def _config(seed):
    return {{"seed": seed, "steps": NUM_STEPS, "lr": 1e-6, "world": int(os.environ.get("WORLD", "4"))}}


def test_trains_{i}():
    config = _config({i})
    for step in range(config["steps"]):
        assert step < config["steps"]


def test_config_is_stable_{i}():
    assert _config(1) == _config(1)


class TestGroup{i}:
    def test_world(self):
        assert _config(0)["world"] >= 1

    def test_lr(self):
        assert _config(0)["lr"] > 0
'''


def write_tree(root: Path, count: int) -> None:
    per_dir = 200
    for i in range(count):
        folder = root / "tests" / "e2e" / f"group_{i // per_dir:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"test_case_{i:05d}.py").write_text(
            TEMPLATE.format(i=i, est=300 + i % 97, est_rocm=390 + i % 89)
        )


def best_of(repeat: int, fn) -> tuple[float, float]:
    """Best (CPU seconds, wall seconds) of `repeat` calls."""
    cpu = wall = float("inf")
    for _ in range(repeat):
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
    return cpu, wall


def age_tree(root: Path) -> None:
    """Back-date the files so the cache does not treat them as just written."""
    old = time.time() - 3600
    for path in (root / "tests").rglob("test_*.py"):
        os.utime(path, (old, old))


def time_discovery(root: Path, count: int, repeat: int) -> dict[str, tuple[float, float]]:
    catalog = load_catalog()

    def run(cache: bool):
        result = discover_module.discover(root, catalog=catalog, cache=cache)
        assert len(result.files) == count and not result.problems, result.problems[:3]

    timings = {"cold": best_of(repeat, lambda: run(False))}
    run(True)  # fill the cache
    timings["warm"] = best_of(repeat, lambda: run(True))
    original = discover_module._parse_marker_region
    discover_module._parse_marker_region = lambda source, name: (ast.parse(source, name), -1)
    try:
        timings["full"] = best_of(repeat, lambda: run(False))
    finally:
        discover_module._parse_marker_region = original
    return timings


def time_pytest_collect(root: Path) -> tuple[float, float]:
    (root / "pytest.ini").write_text("[pytest]\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "--import-mode=importlib",
            "tests",
        ],
        cwd=root,
        capture_output=True,
        text=True,
        env=env,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"pytest collection failed:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    header = f"{'files':>6} {'mode':>7} {'files/s (cpu)':>14} {'files/s (wall)':>15} {'x pytest (cpu)':>15}"
    print(header)
    for count in args.sizes:
        with tempfile.TemporaryDirectory(prefix="miles-bench-discover-") as tmp:
            root = Path(tmp)
            write_tree(root, count)
            age_tree(root)
            timings = time_discovery(root, count, args.repeat)
            timings["pytest"] = time_pytest_collect(root)
            pytest_cpu = timings["pytest"][0]
            for mode in ("cold", "full", "warm", "pytest"):
                cpu, wall = timings[mode]
                print(
                    f"{count:>6} {mode:>7} {count / cpu:>14,.0f} {count / wall:>15,.0f} {pytest_cpu / cpu:>14.1f}x"
                )
    print("targets: discover >= 20,000 files/s; >= 20x faster than pytest --collect-only")


if __name__ == "__main__":
    main()
