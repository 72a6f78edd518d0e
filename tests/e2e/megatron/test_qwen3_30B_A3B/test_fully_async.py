"""GPU twin of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_fully_async.py
(radixark/miles 31f1ca961): the disaggregated broadcast case (6 training GPUs, CP2 x PP3, EP2;
one SGLang server of 2 GPUs) with a persistent rollout worker (`--fully-async`), 3 rollouts: a
cold start, a drain from an already-warm buffer, and a drain across a weight update that
pauses generation. The seed runs it with train_async.py; miles' trainer takes --fully-async.
Its CPU twin is tests/e2e/test_train_fully_async.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci
from tests.e2e.megatron.test_qwen3_30B_A3B import case

register_cuda_ci(
    est_time=1500, suite="stage-c-8-gpu-h100", labels=["megatron", "weight-update", "fully-async"]
)
register_rocm_ci(
    est_time=800, suite="nightly-stage-c-8-gpu-mi350", labels=["megatron", "weight-update", "fully-async"]
)

register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")


def test_fully_async_drains_across_a_weight_update(tmp_path):
    record = case.run(tmp_path, case.FULLY_ASYNC, num_rollout=3)
    staleness = case.twins.series(record, "rollout/fully_async/max_staleness")
    assert sorted(staleness) == [0, 1, 2]
