"""GPU twin of the seed's tests/e2e/sglang_config/test_sglang_config_mixed_offload.py
(radixark/miles 31f1ca961): an updatable model (actor) and a frozen one (ref, update_weights
false) from --sglang-config; the actor's engines take every weight sync, the ref's keep their
checkpoint. The seed colocates them and offloads both between steps; miles places them apart
(config_case.py), so nothing is offloaded. Its CPU twin is tests/e2e/test_train_engine_groups.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=300, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("config_case", Path(__file__).with_name("config_case.py"))
config_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_case)

SGLANG_CONFIG_YAML = """\
sglang:
  - name: actor
    update_weights: true
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
  - name: ref
    update_weights: false
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
"""
FLAGS = """
--num-rollout 3 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 512
--rollout-temperature 0.8 --global-batch-size 32 --eval-interval 20 --eval-max-response-len 512
--max-tokens-per-gpu 4096
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7 --sglang-cuda-graph-max-bs-decode 32 --ci-test
"""


def test_an_updatable_and_a_frozen_model_serve_side_by_side(tmp_path):
    record = config_case.run(tmp_path, SGLANG_CONFIG_YAML, FLAGS)
    assert sorted(config_case.case.twins.series(record, "train/loss")) == [0, 1, 2]
