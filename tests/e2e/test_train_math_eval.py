"""A math-answer reward and evaluation during training, on the CPU lane's tiny Qwen3 (FSDP, 2 ranks).

The run trains the synthetic arithmetic task (`a+b=`, the answer the sum) with the GSM8K
reward (the response's final number, as an exact number: no credit for a near miss), so a
random model starts near zero and only learning lifts it. Held-out sums are scored before the
first rollout and every --eval-interval rollouts with several samples per prompt, which gives
the eval set's mean reward and its pass@k (miles.train.evaluation). The command is the
recipe's tiny one (tests/support/recipes.py), with extra_args for the task.
"""

from __future__ import annotations

import json

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=7, suite="stage-b-cpu")


NUM_ROLLOUT = 20
EVAL_EVERY = 5
EVAL_SAMPLES = 4


@pytest.fixture(scope="module")
def arith_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("arith")
    held_out = workdir / "sums.jsonl"
    held_out.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n" for a in (1, 4) for b in (2, 3)
        )
    )
    plan = runs.tiny_plan(
        "qwen3_4b", workdir,
        "--prompt-data", "synthetic:arith", "--rm-type", "gsm8k", "--num-rollout", str(NUM_ROLLOUT),
        "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
        "--rollout-max-response-len", "3", "--micro-batch-size", "64", "--lr", "1e-2", "--weight-decay", "0",
        "--eval-prompt-data", "sums", str(held_out), "--eval-interval", str(EVAL_EVERY),
        "--n-samples-per-eval-prompt", str(EVAL_SAMPLES), "--save-interval", str(NUM_ROLLOUT),
        train_backend="fsdp",
    )  # fmt: skip
    record = workdir / "record"
    assert runs.launch(plan, record) == 0
    return record


def test_the_math_reward_rises_on_the_arithmetic_task(arith_run):
    reward = runs.series(arith_run, "rollout/raw_reward")
    assert sorted(reward) == list(range(NUM_ROLLOUT))
    first = sum(reward[s] for s in range(5)) / 5
    last = sum(reward[s] for s in range(NUM_ROLLOUT - 5, NUM_ROLLOUT)) / 5
    print(f"rollout/raw_reward first 5 rollouts {first:.3f} -> last 5 {last:.3f}")
    assert first < 0.02, f"a random model should rarely state the sum, got mean reward {first:.3f}"
    assert last > first + 0.06, (
        f"no learning: mean reward {first:.3f} over the first 5 rollouts, {last:.3f} over the last 5"
    )


def test_eval_metrics_appear_before_training_and_at_the_interval(arith_run):
    steps = [0, *(r for r in range(NUM_ROLLOUT) if (r + 1) % EVAL_EVERY == 0)]
    for key in ("eval/sums", "eval/sums-truncated_ratio", *(f"eval/sums-pass@{k}" for k in (1, 2, 4))):
        assert sorted(runs.series(arith_run, key)) == steps, key
    assert not runs.series(arith_run, "eval/sums-pass@8")  # no more than the samples per prompt


def test_pass_at_k_grows_with_k_and_pass_at_1_is_the_mean_of_a_0_1_reward(arith_run):
    mean = runs.series(arith_run, "eval/sums")
    passes = {k: runs.series(arith_run, f"eval/sums-pass@{k}") for k in (1, 2, 4)}
    for step, value in mean.items():
        assert passes[1][step] == pytest.approx(value, abs=1e-9), step
        assert passes[1][step] <= passes[2][step] <= passes[4][step], step
    assert max(passes[4].values()) > 0, "no eval prompt was ever answered in 4 samples"
