"""Evaluation's metrics: mean reward, the unbiased pass@k, and when the sets are scored."""

from __future__ import annotations

import itertools
import math

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.args import parse_config
from miles.train.evaluation import due, due_before_training, pass_at_k, pass_ks, set_metrics

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def test_pass_k_is_logged_for_powers_of_two_up_to_the_samples_per_prompt():
    assert pass_ks(1) == ()
    assert pass_ks(2) == (1, 2)
    assert pass_ks(6) == (1, 2, 4)
    assert pass_ks(8) == (1, 2, 4, 8)


@pytest.mark.parametrize(("n", "correct"), [(4, 0), (4, 1), (4, 3), (6, 2), (8, 8)])
def test_pass_at_k_is_the_share_of_k_subsets_that_hold_a_correct_sample(n, correct):
    outcomes = [True] * correct + [False] * (n - correct)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(outcomes, k))
        expected = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, correct, k) == pytest.approx(expected, abs=1e-12), (n, correct, k)


def test_set_metrics_average_over_prompts_and_count_only_reward_one_as_correct():
    rewards = [[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]]
    metrics = set_metrics("gsm8k", rewards, 4, truncated=3)
    assert metrics["eval/gsm8k"] == pytest.approx(3.5 / 12)
    assert metrics["eval/gsm8k-truncated_ratio"] == pytest.approx(3 / 12)
    assert metrics["eval/gsm8k-pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert metrics["eval/gsm8k-pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 3)
    assert metrics["eval/gsm8k-pass@4"] == pytest.approx(2 / 3)
    assert not math.isnan(sum(metrics.values()))


def test_one_sample_per_prompt_logs_no_pass_k():
    assert set(set_metrics("aime", [[1.0], [0.0]], 1, truncated=0)) == {
        "eval/aime",
        "eval/aime-truncated_ratio",
    }


def _config(*extra):
    return parse_config(["--hf-checkpoint", "/m", *extra])


def test_sets_are_scored_before_training_and_every_interval_unless_skipped():
    cfg = _config("--eval-prompt-data", "a", "a.jsonl", "--eval-interval", "2").eval
    assert due_before_training(cfg)
    assert [r for r in range(6) if due(cfg, r)] == [1, 3, 5]
    skipped = _config(
        "--eval-prompt-data", "a", "a.jsonl", "--eval-interval", "2", "--skip-eval-before-train"
    )
    assert not due_before_training(skipped.eval)


def test_eval_sets_without_an_interval_and_an_interval_without_sets_are_refused(capsys):
    with pytest.raises(SystemExit):
        _config("--eval-prompt-data", "a", "a.jsonl")
    assert "no --eval-interval says when to score them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _config("--eval-interval", "5")
    assert "--eval-interval 5 has no eval set to score" in capsys.readouterr().err
