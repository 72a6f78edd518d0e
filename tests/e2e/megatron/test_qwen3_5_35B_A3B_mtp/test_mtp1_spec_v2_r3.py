"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_5_35B_A3B_mtp/test_mtp1_spec_v2_r3.py
(radixark/miles 31f1ca961), the CUDA case beside the AMD one: Qwen3.5-35B-A3B on 8 H100s, TP2 x PP2 x
EP4 (CP1), one MTP layer trained, EAGLE speculative decoding v2 from it, R3, the vision weights
skipped in the weight-equality check; gated like the seed. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci
from tests.e2e.megatron.test_qwen3_5_35B_A3B_mtp import case

register_cuda_ci(
    est_time=1600,
    suite="stage-c-8-gpu-h100",
    labels=["megatron", "qwen35"],
)

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")


def test_mtp_training_with_speculative_rollouts_and_r3_on_eight_gpus(tmp_path):
    record = case.run(tmp_path, gpus=8, tp=2, pp=2, cp=1, ep=4, sglang_ep=8, r3=True)
    gap = case.twins.series(record, "train/train_rollout_logprob_abs_diff")
    assert sorted(gap) == [0, 1], gap  # both rollouts trained, the engine's experts replayed
