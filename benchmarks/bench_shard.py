"""Shard balance and runner overhead, measured side by side in one invocation.

    python benchmarks/bench_shard.py [--seeds 5] [--files 12] [--skip-overhead] [--large 10000]

1. Balance: makespan / lower bound (max(total/N, longest test)) of plain LPT and of
   miles.ci.selection.shard.balanced_partition on synthetic suites with heavy-tailed est_times
   (Pareto, 10-300 tests, 2-8 shards), on "planted" suites where a perfect partition exists
   by construction (so 1.000 is reachable), and on this repository's own suites.
   "optimal" means the exact search proved no partition is shorter.
2. Scale: a synthetic suite of 10,000 tests with float est_times on 64 shards, partitioned by
   LPT and by balanced_partition side by side, then planned whole (selection, shards,
   timeouts, the printed plan) by miles.ci.running.plan; the times are printed (target: under 1 s).
3. Overhead: the same pytest command per test file, run directly (subprocess, output
   captured) and through the runner's executor (own session, output tee, JUnit parse,
   group sweep), interleaved so machine load hits both alike; plus a whole runner pass
   (plan, execution, three reports, durations) against the direct loop.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from miles.ci.selection.shard import Job, balanced_partition, lpt_partition  # noqa: E402

SIZES = (10, 30, 100, 300)
SHARDS = (2, 3, 4, 6, 8)


def heavy_tailed(rng: random.Random, n: int) -> list[float]:
    """Pareto(1.2) seconds, 5 s to one hour, whole seconds: a few long recipes, many short tests."""
    return [float(min(3600, max(5, round(rng.paretovariate(1.2) * 20)))) for _ in range(n)]


def planted(rng: random.Random, n_tests: int, n_shards: int) -> list[float]:
    """Heavy-tailed tests dealt into shards of exactly equal totals (one filler per shard)."""
    weights = heavy_tailed(rng, n_tests - n_shards)
    shards = [[] for _ in range(n_shards)]
    for w in weights:
        shards[rng.randrange(n_shards)].append(w)
    top = max(sum(s) for s in shards) + rng.randint(1, 60)
    return [w for s in shards for w in s] + [top - sum(s) for s in shards]


def compare(weights: list[float], n: int) -> tuple[float, float, bool, float]:
    jobs = [Job(f"t{i:03d}", w) for i, w in enumerate(weights)]
    lpt = lpt_partition(jobs, n)
    start = time.perf_counter()
    ours = balanced_partition(jobs, n)
    return lpt.ratio, ours.ratio, ours.optimal, time.perf_counter() - start


def balance_table(title: str, make, seeds: int) -> list[tuple[float, float, bool]]:
    print(f"\n## {title}")
    print(
        f"{'tests':>5} {'shards':>6} {'LPT/LB worst':>13} {'ours/LB worst':>14} {'ours/LB mean':>13} "
        f"{'optimal':>8} {'ms max':>7}"
    )
    rows = []
    for size in SIZES:
        for n in SHARDS:
            if size < 2 * n:
                continue
            results = [
                compare(make(random.Random(1000 * size + 10 * n + s), size, n), n) for s in range(seeds)
            ]
            rows += [(lpt, ours, opt) for lpt, ours, opt, _ in results]
            print(
                f"{size:>5} {n:>6} {max(r[0] for r in results):>13.4f} {max(r[1] for r in results):>14.4f} "
                f"{statistics.mean(r[1] for r in results):>13.4f} {sum(r[2] for r in results):>5}/{seeds:<2} "
                f"{max(r[3] for r in results) * 1000:>7.0f}"
            )
    worse = sum(1 for lpt, ours, _ in rows if ours > lpt + 1e-9)
    over = [(lpt, ours, opt) for lpt, ours, opt in rows if ours > 1.01]
    print(
        f"instances {len(rows)}; ours worse than LPT: {worse}; ours above 1.01: {len(over)} "
        f"(of which proven optimal, i.e. nothing within 1.01 exists: {sum(1 for o in over if o[2])}); "
        f"LPT above 1.01: {sum(1 for lpt, _, _ in rows if lpt > 1.01)}"
    )
    return rows


def repository_suites() -> None:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.running.plan import shard_count

    catalog = load_catalog()
    discovery = discover(ROOT, catalog=catalog)
    print("\n## This repository's suites (enabled registrations, catalog shard counts)")
    print(f"{'suite':<30} {'tests':>5} {'shards':>6} {'LB s':>8} {'LPT/LB':>8} {'ours/LB':>8} optimal")
    for suite in catalog.suites.values():
        regs = [r for r in discovery.registrations if r.suite == suite.name and r.enabled]
        jobs = [Job(r.file, r.est_time) for r in regs]
        if not jobs:
            print(f"{suite.name:<30} {0:>5}      -        -        -        -   (no tests registered yet)")
            continue
        for n in sorted({shard_count(suite, jobs, None, False)[0], 2, 4}):
            lpt, ours = lpt_partition(jobs, n), balanced_partition(jobs, n)
            print(
                f"{suite.name:<30} {len(jobs):>5} {n:>6} {ours.lower_bound:>8.0f} {lpt.ratio:>8.4f} "
                f"{ours.ratio:>8.4f} {'yes' if ours.optimal else 'no'}"
            )


def large_suite(tests: int, shards: int = 64) -> None:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import Discovery, Registration, TestFile
    from miles.ci.running.plan import RunOptions, build_plan, format_plan

    rng = random.Random(tests)
    # float est_times (as `calibrate` writes them), heavy-tailed: 5 s to an hour
    weights = [min(3600.0, 5.0 + rng.paretovariate(1.2) * 20.0 + rng.random()) for _ in range(tests)]
    jobs = [Job(f"tests/e2e/test_{i:05d}.py", w) for i, w in enumerate(weights)]
    print(f"\n## A synthetic suite: {tests} tests with float est_times on {shards} shards")
    start = time.perf_counter()
    lpt = lpt_partition(jobs, shards)
    lpt_s = time.perf_counter() - start
    start = time.perf_counter()
    ours = balanced_partition(jobs, shards)
    ours_s = time.perf_counter() - start
    print(f"LPT                  {lpt_s * 1000:8.1f} ms   makespan/LB {lpt.ratio:.6f}")
    print(
        f"balanced_partition   {ours_s * 1000:8.1f} ms   makespan/LB {ours.ratio:.6f} ({ours.method}); "
        f"{'not worse than LPT' if ours.makespan <= lpt.makespan + 1e-9 else 'WORSE THAN LPT'}; "
        f"target under 1000 ms: {'met' if ours_s < 1.0 else 'MISSED'}"
    )
    catalog = load_catalog()
    files = tuple(
        TestFile(job.key, (Registration("cpu", job.key, 2, job.weight, "stage-b-cpu"),)) for job in jobs
    )
    discovery = Discovery(root=ROOT, files=files, problems=())
    with tempfile.TemporaryDirectory() as tmp:
        options = RunOptions(root=ROOT, suites=("stage-b-cpu",), shards=str(shards), report_dir=Path(tmp))
        start = time.perf_counter()
        plan = build_plan(options, catalog, discovery)
        text = format_plan(plan)
        plan_s = time.perf_counter() - start
    print(
        f"whole plan (select, partition, timeouts, {len(text.splitlines())} printed lines) "
        f"{plan_s * 1000:8.1f} ms; {len(plan.tests)} tests in {plan.suites[0].n_shards} shards"
    )


def overhead(files: int) -> None:
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.reports.durations import record_durations
    from miles.ci.reports.report import write_reports
    from miles.ci.running.execute import CancelToken, Settings, TestRun, pytest_command, run_attempt
    from miles.ci.running.plan import RunOptions, build_plan
    from miles.ci.running.runner import execute_plan

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "tests").mkdir()
        names = []
        for i in range(files):
            name = f"tests/test_{i:02d}.py"
            (root / name).write_text(
                "from miles.ci.register import register_cpu_ci\n"
                f'register_cpu_ci(est_time={10 + i}, suite="stage-b-cpu")\n'
                "def test_ok():\n    assert sum(range(10)) == 45\n"
            )
            names.append(name)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MILES_CI_", "GITHUB_"))}
        settings = Settings(root=root, grace=1.0, base_env=env)
        direct, runner, runner_cpu = [], [], []
        for round_ in range(2):
            for i, name in enumerate(names):
                junit = root / f"direct-{round_}-{i}.xml"
                start = time.perf_counter()
                subprocess.run(
                    pytest_command(settings, name, junit), cwd=root, env=env, capture_output=True, check=True
                )
                direct.append(time.perf_counter() - start)
                test = TestRun(name, "cpu", "stage-b-cpu", "cpu", "1/1", 10.0, 120.0)
                start, cpu = time.perf_counter(), time.process_time()
                attempt = run_attempt(test, root / f"runner-{round_}-{i}", settings, CancelToken())
                runner.append(time.perf_counter() - start)
                runner_cpu.append(time.process_time() - cpu)
                assert attempt.status == "passed", attempt.message
        delta = [r - d for r, d in zip(runner, direct, strict=True)]
        print(f"\n## Runner overhead per test file ({len(direct)} files each way, interleaved)")
        print(f"direct pytest        median {statistics.median(direct) * 1000:7.1f} ms")
        print(f"through run_attempt  median {statistics.median(runner) * 1000:7.1f} ms")
        print(
            f"overhead per file    median {statistics.median(delta) * 1000:+7.1f} ms  "
            f"(ratio {statistics.median(runner) / statistics.median(direct):.3f}; target <= 50 ms)"
        )
        print(
            f"runner's own CPU per file (process time, insensitive to machine load) "
            f"median {statistics.median(runner_cpu) * 1000:.1f} ms, max {max(runner_cpu) * 1000:.1f} ms"
        )

        os.environ["MILES_DURATIONS_PATH"] = str(root / "durations.sqlite")
        catalog = load_catalog()
        loops, wholes, outside = [], [], []
        for rep in range(3):  # alternate, so a change in machine load hits both sides
            start = time.perf_counter()
            for i, name in enumerate(names):
                junit = root / f"loop-{rep}-{i}.xml"
                subprocess.run(
                    pytest_command(settings, name, junit), cwd=root, env=env, capture_output=True, check=True
                )
            loops.append(time.perf_counter() - start)
            start = time.perf_counter()
            plan = build_plan(
                RunOptions(root=root, suites=("stage-b-cpu",), report_dir=root / "reports"),
                catalog,
                discover(root, catalog=catalog),
            )
            record = execute_plan(plan, catalog, CancelToken(), out=io.StringIO())
            write_reports(record, plan.report_dir)
            record_durations(record.attempts)
            wholes.append(time.perf_counter() - start)
            outside.append(wholes[-1] - sum(a.elapsed for a in record.attempts))
            assert record.passed
        per_file = [(w - d) / files * 1000 for w, d in zip(wholes, loops, strict=True)]
        print(
            f"whole run (plan + {files} files + 3 reports + durations) vs direct loop, 3 alternations: "
            f"median {statistics.median(wholes):.2f} s vs {statistics.median(loops):.2f} s, "
            f"{statistics.median(per_file):+.1f} ms per file "
            f"(ratio {statistics.median(wholes) / statistics.median(loops):.3f})"
        )
        print(
            "whole run, wall time outside the test processes (plan, gates, reports, durations) "
            f"median {statistics.median(outside) / files * 1000:.1f} ms per file"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="instances per (size, shards) cell")
    parser.add_argument("--files", type=int, default=8, help="test files for the overhead measurement")
    parser.add_argument("--skip-overhead", action="store_true")
    parser.add_argument("--large", type=int, default=10_000, help="tests in the synthetic scale suite")
    args = parser.parse_args()
    print("# Shard balance: makespan / lower bound (1.000 is the best any partition can do)")
    balance_table("Synthetic heavy-tailed suites", lambda rng, size, n: heavy_tailed(rng, size), args.seeds)
    balance_table("Planted suites (a perfect partition exists)", planted, args.seeds)
    repository_suites()
    large_suite(args.large)
    if not args.skip_overhead:
        overhead(args.files)


if __name__ == "__main__":
    main()
