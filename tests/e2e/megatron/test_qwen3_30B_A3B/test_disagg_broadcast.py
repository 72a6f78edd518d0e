"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_disagg_broadcast.py
(radixark/miles 31f1ca961): Qwen3-30B-A3B trained on 6 GPUs (CP2 x PP3, EP2, ETP1) while 2 GPUs
of their own roll out (one SGLang server of 2 GPUs, not colocated), weights sent by
`--update-weight-transfer-mode broadcast` over NCCL; 2 rollouts with --ci-test, the seed's
flags as its _common.py builds them for this case. Its CPU twin is
tests/e2e/test_train_disaggregated.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci
from tests.e2e.megatron.test_qwen3_30B_A3B import case

register_cuda_ci(est_time=1300, suite="stage-c-8-gpu-h100", labels=["megatron", "weight-update"])
register_rocm_ci(est_time=900, suite="nightly-stage-c-8-gpu-mi350", labels=["megatron", "weight-update"])

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")


def test_disaggregated_broadcast_trains(tmp_path):
    record = case.run(tmp_path, case.DISAGG_BROADCAST, num_rollout=2)
    assert sorted(case.twins.series(record, "train/loss")) == [0, 1]  # both rollouts trained
