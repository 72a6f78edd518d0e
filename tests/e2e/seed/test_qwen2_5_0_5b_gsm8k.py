"""Qwen2.5-0.5B-Instruct learns GSM8K with the math-answer reward (the seed's long run).

The seed test (radixark/miles 31f1ca961, tests/e2e/long/test_qwen2.5_0.5B_gsm8k.py): 250
GRPO rollouts of 32 prompts x 8 samples on gsm8k/train.parquet, `--rm-type math`, evaluation
on gsm8k/test.parquet every 20 rollouts, greedy (`--eval-top-k 1`), and `--ci-metric-checker-key
eval/gsm8k --ci-metric-checker-threshold 0.55`: the run fails unless the last evaluation reaches
0.55. Here the same flags run through the Qwen2.5-0.5B recipe's full-train on 2 GPUs. Left out,
each for want of a miles counterpart: `--over-sampling-batch-size 64` with
`--dynamic-sampling-filter-path ...check_reward_nonzero_std` (miles trains every group it
samples; groups whose rewards are all equal get zero advantage), `--megatron-to-hf-mode bridge`
(miles loads the torch_dist conversion prepare-ckpt writes), and
`--rematerialize-param-from-master-weight`. The CPU lane's twin of what this run shows (a math
reward rising, eval metrics at the interval) is tests/e2e/test_train_math_eval.py.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=7000, suite="stage-c-2-gpu-h200", labels=["long"])
register_rocm_ci(est_time=6800, suite="nightly-stage-c-2-gpu-mi350", labels=["long"])
register_ci_gate(metric_key="rollout/raw_reward")

RECIPE, MODEL, GPUS = "qwen2_5_0_5b", "Qwen2.5-0.5B-Instruct", 2
NUM_ROLLOUT = 250
FLAGS = (
    "--prompt-data", "{data}/gsm8k/train.parquet", "--input-key", "messages", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", str(NUM_ROLLOUT),
    "--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "1024",
    "--rollout-temperature", "1", "--global-batch-size", "256",
    "--eval-interval", "20", "--eval-prompt-data", "gsm8k", "{data}/gsm8k/test.parquet",
    "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "1024", "--eval-top-k", "1",
    "--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216",
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics",
    "--ci-test", "--ci-disable-kl-checker", "--ci-metric-checker-key", "eval/gsm8k",
    "--ci-metric-checker-threshold", "0.55",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", str(GPUS), "--colocate",
)  # fmt: skip


def test_qwen2_5_0_5b_learns_gsm8k(seed_train, series):
    record, _ = seed_train(RECIPE, FLAGS, model=MODEL, gpus=GPUS)
    reward = series(record, "rollout/raw_reward")
    assert sorted(reward) == list(range(NUM_ROLLOUT))
    first = sum(reward[s] for s in range(20)) / 20
    last = sum(reward[s] for s in range(NUM_ROLLOUT - 20, NUM_ROLLOUT)) / 20
    assert last > first, (
        f"raw reward did not rise: {first:.3f} over the first 20 rollouts, {last:.3f} over the last 20"
    )
    scores = series(record, "eval/gsm8k")
    assert sorted(scores) == [0, *range(19, NUM_ROLLOUT, 20)], sorted(scores)
