"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_r3_baseline.py (radixark/miles
31f1ca961): Qwen3-30B-A3B with rollout routing replay (R3: --use-rollout-routing-replay; SGLang
returns each token's experts and megatron-core's routers replay them), TP2 with SP, CP2, EP4 on 4
GPUs with one colocated SGLang engine of 4 GPUs, 2 rollouts, --ci-test; gated on the train/rollout
logprob gap and KL like the seed. Its CPU twin is tests/e2e/test_train_routing_replay.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci
from tests.e2e.megatron.test_qwen3_30B_A3B import case

register_cuda_ci(est_time=1200, suite="stage-c-4-gpu-h200", labels=["megatron", "replay"])
register_rocm_ci(est_time=1500, suite="nightly-stage-c-4-gpu-mi350", labels=["megatron", "replay"])

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")


def test_rollout_routing_replay_keeps_the_logprob_gap_small(tmp_path):
    record = case.run_colocated(tmp_path, tp=2, pp=1, cp=2, ep=4, r3=True)
    gap = case.twins.series(record, "train/train_rollout_logprob_abs_diff")
    assert sorted(gap) == [0, 1]  # both rollouts trained with the engine's experts replayed
    assert all(value < 0.05 for value in gap.values()), gap  # --ci-test holds it to its own tolerance too
