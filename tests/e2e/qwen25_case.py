"""The seed's Qwen2.5-0.5B-Instruct GSM8K flags (radixark/miles 31f1ca961, tests/e2e/short/ and
tests/e2e/long/test_qwen2.5_0.5B_*.py), shared by their GPU twins here. Not a test module.

The model comes from the qwen2_5_0_5b recipe's checkpoint plan and GSM8K from
miles.ckpt.datasets. Flags miles does not parse or act on are left out, with why (LEFT_OUT).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("seed_flags", Path(__file__).with_name("seed_flags.py"))
twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twins)

RECIPE, MODEL = "qwen2_5_0_5b", "Qwen2.5-0.5B-Instruct"

LEFT_OUT = {
    "--eval-top-k": "miles evaluates greedily with --eval-temperature 0 (passed instead)",
    "--over-sampling-batch-size": "dynamic sampling (over-sampling with a filter) is not in miles",
    "--dynamic-sampling-filter-path": "dynamic sampling (over-sampling with a filter) is not in miles",
    "--eval-num-gpus": "miles evaluates on the rollout engines (no dedicated evaluation fleet)",
    "--eval-num-gpus-per-engine": "miles evaluates on the rollout engines (no dedicated evaluation fleet)",
    "--eval-hf-dir": "miles evaluates on the rollout engines (no staged snapshots)",
    "--eval-keep-snapshots": "miles evaluates on the rollout engines (no staged snapshots)",
}

CKPT = "--hf-checkpoint {model} --ref-load {model}"
DATA = (
    "--prompt-data {data}/gsm8k/train.parquet --input-key messages --label-key label --apply-chat-template "
    "--rollout-shuffle --rm-type math"
)
EVAL = (
    "--eval-prompt-data gsm8k {data}/gsm8k/test.parquet --n-samples-per-eval-prompt 1 --eval-max-response-len 1024 "
    "--eval-top-k 1 --eval-temperature 0"
)
PERF = (
    "--tensor-model-parallel-size 1 --sequence-parallel --pipeline-model-parallel-size 1 --context-parallel-size 1 "
    "--expert-model-parallel-size 1 --expert-tensor-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216"
)
GRPO = (
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28"
)
OPTIMIZER = "--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98"
MISC = (
    "--attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 --attention-softmax-in-fp32 "
    "--attention-backend flash --megatron-to-hf-mode bridge --train-backend megatron --rollout-engine sglang"
)


def run(workdir: Path, flags: str, actor_gpus: int, env: dict | None = None) -> Path:
    plan = twins.prepared(RECIPE, MODEL, datasets=("gsm8k",))
    argv = twins.command(" ".join((CKPT, DATA, EVAL, PERF, GRPO, OPTIMIZER, MISC, flags)), plan, LEFT_OUT)
    return twins.train(argv, nproc=actor_gpus, workdir=workdir, env=env)
