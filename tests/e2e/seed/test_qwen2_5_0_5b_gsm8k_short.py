"""Qwen2.5-0.5B-Instruct on GSM8K for 3 rollouts on 8 GPUs (the seed's short run).

The seed test (radixark/miles 31f1ca961, tests/e2e/short/test_qwen2.5_0.5B_gsm8k_short.py):
3 GRPO rollouts of 8 prompts x 4 samples, `--rm-type math`, `--ci-test`, with gsm8k/test.parquet
scored before training (its --eval-interval 20 is past the run's end). Here the same flags run
through the Qwen2.5-0.5B recipe's full-train on 8 GPUs. Left out, each for want of a miles
counterpart: the Mooncake object store it moves rollout data through (`mooncake`, its label,
is kept so the seed's run-ci-mooncake selects this twin), the fault-tolerance health checks
(`--use-fault-tolerance --rollout-health-check-*`), `--over-sampling-batch-size 16` with its
dynamic sampling filter, and `--megatron-to-hf-mode bridge` (miles loads the torch_dist
conversion prepare-ckpt writes).
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h200", labels=["short", "mooncake"])
register_rocm_ci(est_time=360, suite="nightly-stage-c-8-gpu-mi350", labels=["short", "mooncake"])
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")

RECIPE, MODEL, GPUS = "qwen2_5_0_5b", "Qwen2.5-0.5B-Instruct", 8
FLAGS = (
    "--prompt-data", "{data}/gsm8k/train.parquet", "--input-key", "messages", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math", "--num-rollout", "3",
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "1024",
    "--rollout-temperature", "0.8", "--global-batch-size", "32",
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
    "--ci-test",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", str(GPUS), "--colocate",
)  # fmt: skip


def test_qwen2_5_0_5b_gsm8k_short_run_passes_its_checks_and_scores_the_eval_set(seed_train, series):
    record, _ = seed_train(RECIPE, FLAGS, model=MODEL, gpus=GPUS)
    assert sorted(series(record, "rollout/raw_reward")) == [0, 1, 2]
    scores = series(record, "eval/gsm8k")
    assert sorted(scores) == [0] and 0.0 <= scores[0] <= 1.0, scores
