"""Qwen3-4B trained by PPO with a critic at PP2 x CP2 (the seed's PPO run).

The seed test (radixark/miles 31f1ca961, tests/e2e/megatron/test_qwen3_4B_ppo.py): 3 rollouts of
8 prompts x 8 samples on dapo-math-17k (`--rm-type deepscaler`), `--advantage-estimator ppo` with
`--critic-lr 1e-5`, `--num-critic-only-steps 1` and `--normalize-advantages`, at TP1 x PP2 x CP2
with recomputation and dynamic batches, `--ci-test`. Here the same flags run through the Qwen3-4B
recipe's full-train on 4 GPUs, with the seed's evaluation form (MILES_TEST_ENABLE_EVAL=1:
`--eval-interval 20` on aime24, scored before the first rollout); without it the seed passes the
eval flags and evaluates nothing, which miles refuses as flags without effect. The CPU lane's
twin (value loss falls, explained variance rises, the critic resumes) is
tests/e2e/test_train_ppo.py.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=1500, suite="stage-c-4-gpu-h200", labels=["megatron"])
register_rocm_ci(est_time=800, suite="nightly-stage-c-4-gpu-mi350", labels=["megatron"])
register_ci_gate(metric_key="train/value_loss")
# explained variance lives in (-inf, 1] and is near 0 early: a band of 0.2 either way, not half its value
register_ci_gate(
    metric_key="train/explained_variance", constraint={"abs_floor_up": 0.2, "abs_floor_down": 0.2}
)

RECIPE, MODEL, GPUS = "qwen3_4b", "Qwen3-4B", 4
FLAGS = (
    "--prompt-data", "{data}/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3",
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "8192",
    "--rollout-temperature", "0.8", "--global-batch-size", "32", "--balance-data",
    "--eval-interval", "20", "--eval-prompt-data", "aime24", "{data}/aime-2024/aime-2024.jsonl",
    "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "16384", "--eval-top-k", "1",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
    "--advantage-estimator", "ppo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "k1",
    "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "4e-4", "--num-critic-only-steps", "1",
    "--normalize-advantages", "--critic-lr", "1e-5",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.8",
    "--sglang-max-running-requests", "512", "--sglang-enable-metrics",
    "--ci-test",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", str(GPUS), "--colocate",
)  # fmt: skip


def test_qwen3_4b_ppo_trains_the_critic_then_both(seed_train, series):
    record, _ = seed_train(RECIPE, FLAGS, model=MODEL, gpus=GPUS)
    assert sorted(series(record, "train/value_loss")) == [0, 1, 2]
    assert sorted(series(record, "train/explained_variance")) == [0, 1, 2]
    assert sorted(series(record, "train/grad_norm")) == [1, 2]  # the policy waits for one rollout
    assert sorted(series(record, "eval/aime24")) == [0]
