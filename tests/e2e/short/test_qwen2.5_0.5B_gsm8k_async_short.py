"""GPU twin of the seed's tests/e2e/short/test_qwen2.5_0.5B_gsm8k_async_short.py (radixark/miles
31f1ca961): Qwen2.5-0.5B-Instruct trained asynchronously on 2 GPUs with 6 SGLang servers and
fault tolerance (health checks every 5 s; --ci-test kills an engine mid-rollout and the run goes
on), 3 rollouts. The seed runs train_async.py (miles: --fully-async --max-weight-staleness 1)
and moves rollout data through a Mooncake object store (left out: miles hands samples over in
memory); over-sampling with a filter is left out too (tests/e2e/qwen25_case.py). Its CPU twins
are tests/e2e/test_train_fully_async.py and tests/e2e/test_train_engine_groups.py. Untested on
GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h100", labels=["short", "mooncake"])
register_rocm_ci(est_time=240, suite="nightly-stage-c-8-gpu-mi350", labels=["short", "mooncake"])

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

FLAGS = """
--fully-async --max-weight-staleness 1
--num-rollout 3 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 1024
--rollout-temperature 0.8 --over-sampling-batch-size 16
--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
--global-batch-size 32 --eval-interval 8
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.65 --sglang-enable-metrics --ci-test
--use-fault-tolerance --rollout-health-check-interval 5 --rollout-health-check-timeout 10
--rollout-health-check-first-wait 0
--actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus 6
"""


def test_async_training_survives_a_dead_engine(tmp_path):
    record = case.run(tmp_path, FLAGS, actor_gpus=2)
    assert sorted(case.twins.series(record, "train/loss")) == [0, 1, 2]
