"""GPU twin of the seed's tests/e2e/sglang_config/test_sglang_config.py (radixark/miles 31f1ca961):
one model served by two engine groups from --sglang-config, Qwen2.5-0.5B-Instruct, 3 rollouts,
--ci-test; placed as config_case.py says. Its CPU twin is tests/e2e/test_train_engine_groups.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=600, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("config_case", Path(__file__).with_name("config_case.py"))
config_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_case)

SGLANG_CONFIG_YAML = """\
sglang:
  - name: default
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
"""
FLAGS = """
--num-rollout 3 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 1024
--rollout-temperature 0.8 --over-sampling-batch-size 16
--dynamic-sampling-filter-path miles.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std
--global-batch-size 32 --eval-interval 20
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.6 --sglang-enable-metrics
--sglang-cuda-graph-max-bs-decode 32 --ci-test
"""


def test_two_engine_groups_of_one_model_serve_the_rollout(tmp_path):
    record = config_case.run(tmp_path, SGLANG_CONFIG_YAML, FLAGS)
    assert sorted(config_case.case.twins.series(record, "train/loss")) == [0, 1, 2]
