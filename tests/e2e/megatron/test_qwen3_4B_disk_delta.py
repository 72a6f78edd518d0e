"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_4B_disk_delta.py (radixark/miles
31f1ca961): Qwen3-4B trained on 4 GPUs (TP2 with SP, CP2) while 4 GPUs of their own roll out
(two SGLang servers of 2 GPUs), weights handed over through disk as deltas
(`--update-weight-transfer-mode disk-delta`, `--update-weight-disk-dir`,
`--update-weight-local-checkpoint-dir`), 2 rollouts with --ci-test. The seed runs it with
train_async.py (its one-step-ahead driver); miles runs it with its trainer, which starts the
rollout after the sync (the seed's other async tests use --fully-async). Its CPU twin is
tests/e2e/test_train_disaggregated.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=600, suite="stage-c-8-gpu-h100", labels=["megatron", "weight-update"])
register_rocm_ci(est_time=500, suite="nightly-stage-c-8-gpu-mi350", labels=["megatron", "weight-update"])

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")

_spec = importlib.util.spec_from_file_location("seed_flags", Path(__file__).parents[1] / "seed_flags.py")
twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twins)

NUM_GPUS = 8
FLAGS = """
--hf-checkpoint {model} --ref-load {ref}
--prompt-data {data}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rm-type deepscaler --num-rollout 2 --rollout-batch-size 4 --n-samples-per-prompt 2
--rollout-max-response-len 100 --rollout-temperature 0.8 --global-batch-size 8 --balance-data
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 2
--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size
--max-tokens-per-gpu 2048
--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 --eps-clip 0.2
--eps-clip-high 0.28
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 2 --rollout-num-gpus {rollout_gpus} --sglang-mem-fraction-static 0.8
--ci-test
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node {actor_gpus}
--update-weight-buffer-size {buffer} --update-weight-transfer-mode disk-delta
--update-weight-disk-dir {workdir}/delta-updates --update-weight-local-checkpoint-dir {workdir}/delta-local-ckpt
--train-backend megatron --rollout-engine sglang
"""


def test_disk_delta_weight_sync_trains(tmp_path):
    plan = twins.prepared("qwen3_4b", "Qwen3-4B")
    argv = twins.command(
        FLAGS, plan, {}, rollout_gpus=str(NUM_GPUS // 2), actor_gpus=str(NUM_GPUS // 2), buffer=str(1024**3),
        workdir=str(tmp_path),
    )  # fmt: skip
    twins.train(argv, nproc=NUM_GPUS // 2, workdir=tmp_path)
    assert (tmp_path / "delta-local-ckpt" / "manifest.json").is_file()
