"""Shard partitioning: deterministic, never worse than LPT, optimal where it can prove it."""

from __future__ import annotations

import random

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.selection.shard import Job, balanced_partition, lower_bound, lpt_partition, shards_for_budget

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def _jobs(weights: list[float]) -> list[Job]:
    return [Job(f"tests/e2e/test_{i:03d}.py", w) for i, w in enumerate(weights)]


def _heavy_tailed(rng: random.Random, n: int) -> list[float]:
    return [float(max(1, round(min(3600, rng.paretovariate(1.2) * 10)))) for _ in range(n)]


def test_every_job_lands_in_exactly_one_shard():
    jobs = _jobs(_heavy_tailed(random.Random(3), 57))
    partition = balanced_partition(jobs, 5)
    placed = [j.key for shard in partition.shards for j in shard]
    assert sorted(placed) == sorted(j.key for j in jobs)
    assert len(partition.shards) == 5


def test_partition_does_not_depend_on_input_order():
    jobs = _jobs(_heavy_tailed(random.Random(4), 40))
    shuffled = list(jobs)
    random.Random(9).shuffle(shuffled)
    assert balanced_partition(jobs, 4) == balanced_partition(shuffled, 4)


def test_never_worse_than_lpt_on_heavy_tailed_suites():
    rng = random.Random(11)
    for _ in range(25):
        jobs = _jobs(_heavy_tailed(rng, rng.choice([10, 25, 60])))
        n = rng.choice([2, 3, 4, 8])
        assert balanced_partition(jobs, n).makespan <= lpt_partition(jobs, n).makespan + 1e-9


def test_finds_the_perfect_split_that_lpt_misses():
    # LPT puts 3+3 with 2+2+2 ... and ends at 7; {3,3} / {2,2,2} is perfect at 6.
    jobs = _jobs([3, 3, 2, 2, 2])
    assert lpt_partition(jobs, 2).makespan == 7
    best = balanced_partition(jobs, 2)
    assert best.makespan == 6
    assert best.optimal


def test_lower_bound_is_the_larger_of_average_and_longest():
    assert lower_bound([10, 1, 1], 2) == 10
    assert lower_bound([4, 4, 4, 4], 2) == 8
    assert lower_bound([], 3) == 0


def test_more_shards_than_tests_gives_one_test_per_shard():
    partition = balanced_partition(_jobs([5, 7]), 4)
    assert sorted(len(s) for s in partition.shards) == [0, 0, 1, 1]
    assert partition.makespan == 7 and partition.optimal


def test_first_shard_is_the_longest():
    partition = balanced_partition(_jobs([9, 1, 1, 1, 5, 5]), 3)
    assert partition.loads[0] == max(partition.loads)


def test_rejects_duplicate_keys_and_bad_weights():
    with pytest.raises(ValueError, match="unique; repeated: a"):
        balanced_partition([Job("a", 1), Job("a", 2)], 2)
    with pytest.raises(ValueError, match="finite"):
        balanced_partition([Job("a", float("nan"))], 2)
    with pytest.raises(ValueError, match=">= 1"):
        balanced_partition([Job("a", 1)], 0)


def test_auto_shard_count_fits_the_budget():
    jobs = _jobs([600] * 10 + [30] * 40)  # 7200 s in all
    n = shards_for_budget(jobs, 1800)
    assert n == 4
    assert balanced_partition(jobs, n).makespan <= 1800


def test_auto_shard_count_stops_when_the_longest_test_sets_the_time():
    jobs = _jobs([5000, 10, 10, 10])
    assert shards_for_budget(jobs, 1800) == 2
    assert shards_for_budget([], 1800) == 1


def _float_est_times(n: int) -> list[float]:
    rng = random.Random(1)
    return [rng.uniform(5, 600) for _ in range(n)]


def _coarse_est_times(n: int) -> list[float]:
    rng = random.Random(2)
    return [float(rng.choice([60, 300, 600, 1800])) for _ in range(n)]


@pytest.mark.parametrize(
    "weights", [_float_est_times(1200), _coarse_est_times(1200)], ids=["float", "coarse"]
)
def test_a_suite_of_thousands_of_tests_is_partitioned_no_worse_than_lpt(weights):
    jobs = _jobs(weights)
    partition = balanced_partition(jobs, 8)
    assert sorted(j.key for shard in partition.shards for j in shard) == sorted(j.key for j in jobs)
    assert partition.makespan <= lpt_partition(jobs, 8).makespan + 1e-9


def test_planning_a_suite_of_twelve_hundred_files_prints_the_plan(make_tree, capsys):
    from miles.ci.cli import main

    line = (
        'from miles.ci.register import register_cpu_ci\nregister_cpu_ci(est_time={}, suite="stage-b-cpu")\n'
    )
    rng = random.Random(7)
    root = make_tree(
        {f"tests/e2e/test_{i:04d}.py": line.format(round(rng.uniform(5, 600), 2)) for i in range(1200)}
    )
    assert main(["plan", "--root", str(root), "--suite", "stage-b-cpu", "--shards", "8"]) == 0
    out = capsys.readouterr().out
    assert "suite stage-b-cpu: 1200 test(s), 8 shard(s)" in out


def test_a_partition_the_search_refuses_is_a_one_line_plan_error(tmp_path):
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import Discovery, Registration, TestFile
    from miles.ci.running.plan import PlanError, RunOptions, build_plan

    # records built in memory (a cache or another tool), not read by discovery's rules
    bad = Registration("cpu", "tests/e2e/test_nan.py", 2, float("nan"), "stage-b-cpu")
    discovery = Discovery(root=tmp_path, files=(TestFile(bad.file, (bad,)),), problems=())
    with pytest.raises(PlanError) as err:
        build_plan(RunOptions(root=tmp_path, suites=("stage-b-cpu",), shards="2"), load_catalog(), discovery)
    assert str(err.value).startswith(
        "suite stage-b-cpu cannot be sharded: job tests/e2e/test_nan.py has weight nan"
    )
    assert "\n" not in str(err.value)
