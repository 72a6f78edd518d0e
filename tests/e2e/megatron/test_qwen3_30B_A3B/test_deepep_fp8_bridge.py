"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_deepep_fp8_bridge.py
(radixark/miles 31f1ca961): Qwen3-30B-A3B trained at TP4 with SP, PP2, EP4 on 8 GPUs, rolled out
by one colocated SGLang engine of the 8 GPUs from the FP8 checkpoint with DeepEP all-to-all
(SGLang EP 8), 2 rollouts, --ci-test. The CUDA form of test_amd_moriep_fp8_bridge.py (MoRI exists
for ROCm only; miles refuses it on CUDA, naming DeepEP). The trainer dispatches all-to-all where the
seed trains with megatron-core's flex (DeepEP) dispatcher, and there is no Megatron-Bridge (case.py
says why). Its CPU twin: tests/megatron/test_megatron_weights.py's moe-tp2-ep2-fp8 case. Untested on
GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci
from tests.e2e.megatron.test_qwen3_30B_A3B import case

register_cuda_ci(est_time=800, suite="stage-c-8-gpu-h100", labels=["megatron"])

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")

CASE = dict(a2a="deepep", gpus=8, tp=4, pp=2, cp=1, ep=4)  # the seed's CaseConfig


def test_the_fp8_engine_with_deepep_all_to_all_trains_both_rollouts(tmp_path):
    record = case.run_fp8(tmp_path, CASE)
    assert sorted(case.twins.series(record, "train/grad_norm")) == [0, 1]
    gap = case.twins.series(record, "train/train_rollout_logprob_abs_diff")
    assert sorted(gap) == [0, 1]  # --ci-test held each update's FP8 weights to the trainer's, exactly
