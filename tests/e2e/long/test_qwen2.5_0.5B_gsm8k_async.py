"""GPU twin of the seed's tests/e2e/long/test_qwen2.5_0.5B_gsm8k_async.py (radixark/miles
31f1ca961): Qwen2.5-0.5B-Instruct learning GSM8K asynchronously on 2 GPUs (1 training, 1 SGLang
server), 250 rollouts (3000 with MILES_TEST_ENABLE_INFINITE_RUN=1, as the seed's), and its
GSM8K evaluation must reach 0.55 (--ci-metric-checker-key eval/gsm8k). The seed runs
train_async.py, which generates the next rollout while one trains; miles runs that as
--fully-async --max-weight-staleness 1. Over-sampling with a dynamic filter is left out
(tests/e2e/qwen25_case.py). Its CPU twin is tests/e2e/test_train_fully_async.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=5400, suite="stage-c-2-gpu-h200", labels=["long"])
register_rocm_ci(est_time=5000, suite="nightly-stage-c-2-gpu-mi350", labels=["long"])

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

ROLLOUTS = 3000 if os.environ.get("MILES_TEST_ENABLE_INFINITE_RUN") == "1" else 250
FLAGS = f"""
--fully-async --max-weight-staleness 1
--num-rollout {ROLLOUTS} --rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 1024
--rollout-temperature 1 --over-sampling-batch-size 64
--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
--global-batch-size 256 --eval-interval 20
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 --sglang-enable-metrics
--ci-test --ci-disable-kl-checker --ci-metric-checker-key eval/gsm8k --ci-metric-checker-threshold 0.55
--actor-num-nodes 1 --actor-num-gpus-per-node 1 --rollout-num-gpus 1
"""


def test_async_training_learns_gsm8k(tmp_path):
    record = case.run(tmp_path, FLAGS, actor_gpus=1)
    assert case.twins.series(record, "eval/gsm8k")
