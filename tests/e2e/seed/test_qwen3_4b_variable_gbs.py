"""Qwen3-4B with a global batch that varies per step: whole steps of 24, then a partial one of 8.

The seed test (radixark/miles 31f1ca961, tests/e2e/megatron/test_qwen3_4B_variable_gbs.py): 3
rollouts of 8 prompts x 4 samples on dapo-math-17k (`--rm-type deepscaler`), --global-batch-size
24 with `--allow-partial-train-step --disable-rollout-trim-samples`, so each rollout trains a
step of 24 and one of 8, at CP2 with dynamic batches, `--ci-test`. Here the same flags run
through the Qwen3-4B recipe's full-train on 4 GPUs; `--megatron-to-hf-mode bridge` is left out
(miles loads the torch_dist conversion prepare-ckpt writes). The CPU lane's twin (the partial
step's gradient equals that of the equivalent fixed batch) is tests/e2e/test_train_partial_step.py.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=1200, suite="stage-c-4-gpu-h200", labels=["megatron"])
register_rocm_ci(est_time=500, suite="nightly-stage-c-4-gpu-mi350", labels=["megatron"])
register_ci_gate(metric_key="train/grad_norm")

RECIPE, MODEL, GPUS = "qwen3_4b", "Qwen3-4B", 4
FLAGS = (
    "--prompt-data", "{data}/dapo-math-17k/dapo-math-17k.jsonl", "--input-key", "prompt", "--label-key", "label",
    "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3",
    "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "4096",
    "--rollout-temperature", "0.8", "--global-batch-size", "24", "--allow-partial-train-step",
    "--disable-rollout-trim-samples",
    "--tensor-model-parallel-size", "1", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
    "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
    "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
    "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
    "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
    "--adam-beta1", "0.9", "--adam-beta2", "0.98",
    "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7",
    "--ci-test",
    "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
    "--attention-softmax-in-fp32", "--attention-backend", "flash", "--actor-num-nodes", "1",
    "--actor-num-gpus-per-node", str(GPUS), "--colocate",
)  # fmt: skip


def test_qwen3_4b_trains_whole_and_partial_steps(seed_train, series):
    record, _ = seed_train(RECIPE, FLAGS, model=MODEL, gpus=GPUS)
    assert sorted(series(record, "train/grad_norm")) == [0, 1, 2]
    # two optimizer steps per rollout: 24 samples, then the partial 8
    assert series(record, "train/optimizer_steps") == {0: 2.0, 1: 2.0, 2: 2.0}
