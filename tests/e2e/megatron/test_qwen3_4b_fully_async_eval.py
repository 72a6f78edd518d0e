"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_4b_fully_async_eval.py (radixark/miles
31f1ca961): Qwen3-4B trained fully asynchronously (TP2 with SP on 2 GPUs, 6 SGLang servers of one
GPU each) with evaluation on GSM8K after every rollout, 2 rollouts, --ci-test.

The seed runs three evaluation postures; this twin runs the first, `shared` (evaluation on the
rollout engines while the worker submits nothing), which is the one miles has. `fleet`
(--eval-num-gpus, --eval-num-gpus-per-engine, --eval-hf-dir, --eval-keep-snapshots: a dedicated
engine evaluating staged snapshots) and `external` (--eval-function-path with a server outside the
placement) are left out: miles has no such flags. Its CPU twin is tests/e2e/test_train_fully_async.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=2400, suite="stage-c-8-gpu-h200", labels=["megatron", "eval", "fully-async"])
register_rocm_ci(
    est_time=1500, suite="nightly-stage-c-8-gpu-mi350", labels=["megatron", "eval", "fully-async"]
)

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")

_spec = importlib.util.spec_from_file_location("seed_flags", Path(__file__).parents[1] / "seed_flags.py")
twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twins)

NUM_GPUS = 8
ACTOR_GPUS = 2
LEFT_OUT = {
    "--eval-top-k": "miles evaluates greedily with --eval-temperature 0 (passed instead)",
    "--skip-actor-forward-only": "miles' trainer takes the first minibatch's old logprobs from its own forward",
}
FLAGS = """
--hf-checkpoint {model} --ref-load {ref}
--fully-async --prompt-data {data}/gsm8k/train.parquet --input-key messages --label-key label --apply-chat-template
--rollout-shuffle --rm-type math --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 4
--rollout-max-response-len 1024 --rollout-temperature 0.8 --global-batch-size 32 --balance-data
--pause-generation-mode in_place
--eval-interval 1 --eval-prompt-data gsm8k {data}/gsm8k/test.parquet --n-samples-per-eval-prompt 1
--eval-max-response-len 1024 --eval-top-k 1 --eval-temperature 0
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --recompute-granularity full
--recompute-method uniform --recompute-num-layers 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28 --use-tis --skip-actor-forward-only
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7
--ci-test
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --actor-num-nodes 1 --actor-num-gpus-per-node {actor_gpus} --rollout-num-gpus {rollout_gpus}
--train-backend megatron --rollout-engine sglang
"""


def test_fully_async_with_shared_engine_evaluation(tmp_path):
    plan = twins.prepared("qwen3_4b", "Qwen3-4B", datasets=("gsm8k",))
    argv = twins.command(
        FLAGS, plan, LEFT_OUT, actor_gpus=str(ACTOR_GPUS), rollout_gpus=str(NUM_GPUS - ACTOR_GPUS)
    )
    record = twins.train(argv, nproc=ACTOR_GPUS, workdir=tmp_path)
    assert sorted(twins.series(record, "eval/gsm8k")) == [0, 1]
