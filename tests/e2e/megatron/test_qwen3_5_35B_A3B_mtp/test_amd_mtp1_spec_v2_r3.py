"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_5_35B_A3B_mtp/test_amd_mtp1_spec_v2_r3.py
(radixark/miles 31f1ca961): Qwen3.5-35B-A3B on a 4-GPU MI350 runner, PP2 x TP2 x EP2 (ETP1: PP·EP·ETP
divides 4), one MTP layer trained, EAGLE speculative decoding v2 from it, R3, the all-to-all dispatcher
and SGLang's shared-expert fusion off (the seed's AMD extra args), the vision weights skipped in the
weight-equality check; gated like the seed. The model's math on CPU: tests/megatron/test_megatron_qwen3_5.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_rocm_ci
from tests.e2e.megatron.test_qwen3_5_35B_A3B_mtp import case

register_rocm_ci(
    est_time=1600,
    suite="stage-c-4-gpu-mi350",
    labels=["megatron", "qwen35", "amd"],
)

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")


def test_mtp_training_with_speculative_rollouts_and_r3_on_four_gpus(tmp_path):
    record = case.run(
        tmp_path, gpus=4, tp=2, pp=2, cp=1, ep=2, sglang_ep=4, r3=True,
        extra="--moe-token-dispatcher-type alltoall --sglang-disable-shared-experts-fusion",
    )  # fmt: skip
    gap = case.twins.series(record, "train/train_rollout_logprob_abs_diff")
    assert sorted(gap) == [0, 1], gap  # both rollouts trained, the engine's experts replayed
