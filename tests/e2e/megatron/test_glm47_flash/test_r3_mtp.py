"""GPU twin of the seed's tests/e2e/megatron/test_glm47_flash/test_r3_mtp.py (radixark/miles 31f1ca961):
GLM-4.7-Flash with rollout routing replay and its MTP layer (EAGLE speculation in SGLang), TP2 with
SP, PP2 (24 + 23 layers), CP2, EP4 on 8 GPUs with one colocated SGLang engine of 4 GPUs, 2 rollouts,
--ci-test (case.py). Its CPU twins are tests/e2e/test_train_routing_replay_glm4_moe_lite.py (R3 on
both backends) and tests/megatron/test_megatron_glm4_moe_lite.py (the model and its MTP layer against
transformers at TP2+SP+EP2 and PP2). Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci
from tests.e2e.megatron.test_glm47_flash import case

register_cuda_ci(
    est_time=1100,
    suite="stage-c-8-gpu-h100",
    labels=["megatron"],
)

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")


def test_r3_with_the_mtp_layer_trains_both_rollouts_within_the_replay_tolerance(tmp_path):
    record = case.run(tmp_path, tp=2, pp=2, cp=2, ep=4, gpus=8)
    gap = case.twins.series(record, "train/train_rollout_logprob_abs_diff")
    assert sorted(gap) == [0, 1]  # both rollouts trained with the engine's experts replayed
    assert all(value < 0.05 for value in gap.values()), gap  # the seed's MILES_TEST_R3_THRESHOLD
