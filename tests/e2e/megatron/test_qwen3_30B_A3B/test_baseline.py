"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_baseline.py (radixark/miles
31f1ca961): Qwen3-30B-A3B without rollout routing replay, CP2 x PP2, EP2 on 4 GPUs with one
colocated SGLang engine of 4 GPUs, 2 rollouts, --ci-test: the baseline test_r3_baseline.py's gap
is gated against. The seed's --use-routing-replay (R2) and Mooncake weight store are left out, with
why (case.py). Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci
from tests.e2e.megatron.test_qwen3_30B_A3B import case

register_cuda_ci(
    est_time=1100, suite="stage-c-4-gpu-h200", labels=["megatron", "weight-update", "short", "mooncake"]
)

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")

register_rocm_ci(
    est_time=900,
    suite="nightly-stage-c-4-gpu-mi350",
    labels=["megatron", "weight-update", "short", "mooncake"],
)


def test_baseline_trains_both_rollouts_with_the_routers_own_top_k(tmp_path):
    record = case.run_colocated(tmp_path, tp=1, pp=2, cp=2, ep=2, r3=False)
    assert sorted(case.twins.series(record, "train/train_rollout_logprob_abs_diff")) == [0, 1]
    assert sorted(case.twins.series(record, "train/grad_norm")) == [0, 1]
