"""Fully asynchronous training on the CPU: the qwen3_4b recipe's tiny profile (rendered for FSDP,
two trainer ranks) with one built-in engine process and `--fully-async --max-weight-staleness 1
--use-tis`, evaluating every second rollout on the same engine. The persistent worker generates
the next rollout while the current one trains, so after the cold start the trainer drains a
warm buffer, and groups in flight at a weight sync finish with the new weights.

Asserted from the run's own metrics: every rollout trained only groups within the staleness
bound, and some were one version behind (the overlap happened); those rollouts' samples carry
the behaviour policy's logprobs (they differ from the trainer's, which the loss's truncated
importance ratio corrects: train/tis_weight moves off 1), while fresh ones agree with the
trainer; evaluation ran inside the asynchronous run; --ci-test's checks held (the engine's
weights equal the trainer's after every sync, the first step's ratio is 1).

The CPU twin of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_fully_async.py,
tests/e2e/megatron/test_qwen3_4b_fully_async_eval.py, tests/e2e/short/test_qwen2.5_0.5B_fully_async_eval.py
and tests/e2e/long/test_qwen2.5_0.5B_gsm8k_async.py.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=9, suite="stage-b-cpu")


ROLLOUTS = 6
BOUND = 1


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fully-async")
    plan = runs.tiny_plan(
        "qwen3_4b", workdir,
        "--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "6", "--lr", "2e-2",
        "--rollout-engine", "torch", "--rollout-num-gpus", "1",
        "--fully-async", "--max-weight-staleness", str(BOUND), "--use-tis",
        "--async-unused-samples-handler", "retry",
        "--eval-prompt-data", "held", "synthetic:fixed", "--eval-interval", "2", "--eval-temperature", "0",
        train_backend="fsdp",
    )  # fmt: skip
    assert "--ci-test" in plan.train_args
    record = workdir / "record"
    assert runs.launch(plan, record) == 0, "the fully-async run failed (its output is above)"
    return record


def test_every_rollout_trains_within_the_staleness_bound_and_the_overlap_happens(record):
    trained = runs.series(record, "rollout/fully_async/trained_max_staleness")
    assert sorted(trained) == list(range(ROLLOUTS))
    assert max(trained.values()) <= BOUND
    assert trained[0] == 0  # the cold start: the first groups come from the starting weights
    assert any(v == 1 for v in trained.values()), trained  # later ones were made while a step trained
    # groups that fell beyond the bound were not trained but handed back (--async-unused-samples-handler retry)
    stale = runs.series(record, "rollout/fully_async/stale_groups_filtered")
    recycled = runs.series(record, "rollout/fully_async/recycled_groups")
    assert sum(recycled.values()) == sum(stale.values()) + sum(
        runs.series(record, "rollout/fully_async/aborted_groups_filtered").values()
    )


def test_stale_rollouts_train_on_the_behaviour_policys_logprobs(record):
    staleness = runs.series(record, "rollout/fully_async/trained_avg_staleness")
    gap = runs.series(record, "train/train_rollout_logprob_abs_diff")
    tis = runs.series(record, "train/tis_weight")
    stale = [r for r, s in staleness.items() if s > 0]
    fresh = [r for r, s in staleness.items() if s == 0]
    assert stale and fresh
    assert all(gap[r] > 1e-3 for r in stale), (gap, staleness)  # older weights made those tokens
    assert all(gap[r] < 1e-4 for r in fresh), (gap, staleness)
    assert all(abs(tis[r] - 1.0) > 1e-4 for r in stale), tis
    assert all(abs(tis[r] - 1.0) < 1e-3 for r in fresh), tis


def test_evaluation_runs_inside_the_asynchronous_run(record):
    # before the first rollout (the baseline, as the seed's train_async.py scores it), then at the interval
    assert sorted(runs.series(record, "eval/held")) == [0, 1, 3, 5]
