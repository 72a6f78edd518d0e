"""GPU twin of the seed's tests/e2e/lora/test_lora_qwen2.5_0.5B.py (radixark/miles 31f1ca961): GRPO with
LoRA adapters (rank 32, alpha 32, all-linear) on Qwen2.5-0.5B-Instruct, GSM8K, 3 rollouts, eval every
2 rollouts, a checkpoint every 2, the adapters' weights synced to SGLang; the Megatron backend on 4
GPUs, colocated, --ci-test. Flags as the seed has them (its `--megatron-to-hf-mode bridge` ckpt
args included); those miles does not parse are left out with why (LEFT_OUT). The CPU twin (only
adapters train, base weights bit-identical, merged weights = base + BA, resume) is
tests/e2e/test_train_lora.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-4-gpu-h200", labels=["lora"])
register_rocm_ci(est_time=300, suite="nightly-stage-c-4-gpu-mi350", labels=["lora"])

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

GPUS = 4
LEFT_OUT = {
    **case.LEFT_OUT,
    "--use-miles-router": "miles routes requests to its engines itself (no router process)",
}
FLAGS = f"""
--hf-checkpoint {{model}} --megatron-to-hf-mode bridge --ref-load {{ref}}
--lora-rank 32 --lora-alpha 32 --lora-dropout 0.0 --target-modules all-linear
--prompt-data {{data}}/gsm8k/train.parquet --input-key messages --label-key label --apply-chat-template
--rollout-shuffle --rm-type math --num-rollout 3 --rollout-batch-size 8 --n-samples-per-prompt 8
--rollout-max-response-len 1024 --rollout-temperature 1.0 --global-batch-size 32
--eval-interval 2 --eval-prompt-data gsm8k {{data}}/gsm8k/test.parquet --n-samples-per-eval-prompt 1
--eval-max-response-len 1024 --eval-top-k 1 --eval-temperature 0
--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1
--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 4096
--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00 --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28
--optimizer adam --lr 1e-5 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.4 --ci-test
--save-interval 2 --save {{save}}
--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32
--attention-backend flash --calculate-per-token-loss --use-miles-router
--actor-num-nodes 1 --actor-num-gpus-per-node {GPUS} --colocate --train-backend megatron --rollout-engine sglang
"""


def test_lora_trains_adapters_evaluates_and_checkpoints(tmp_path):
    plan = case.twins.prepared(case.RECIPE, case.MODEL, datasets=("gsm8k",))
    argv = case.twins.command(FLAGS, plan, LEFT_OUT, save=str(tmp_path / "ckpt"))
    record = case.twins.train(argv, nproc=GPUS, workdir=tmp_path)
    assert sorted(case.twins.series(record, "train/loss")) == [0, 1, 2]
    assert sorted(case.twins.series(record, "eval/gsm8k")) == [0, 1]  # before training, after rollout 1
    assert (tmp_path / "ckpt" / "iter_0000002").is_dir()
