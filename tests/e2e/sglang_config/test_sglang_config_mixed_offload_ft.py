"""GPU twin of the seed's tests/e2e/sglang_config/test_sglang_config_mixed_offload_ft.py
(radixark/miles 31f1ca961): the actor and ref models of test_sglang_config_mixed_offload.py with
fault tolerance; --ci-test kills an actor engine mid-rollout, its requests go to the other actor
engines, it is restarted and takes the next weight sync, and training continues. Placed as
config_case.py says. Its CPU twin is tests/e2e/test_train_engine_groups.py. Untested on GPU:
est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=500, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=600, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("config_case", Path(__file__).with_name("config_case.py"))
config_case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(config_case)
_mixed = importlib.util.spec_from_file_location(
    "mixed", Path(__file__).with_name("test_sglang_config_mixed_offload.py")
)
mixed = importlib.util.module_from_spec(_mixed)
_mixed.loader.exec_module(mixed)

FAULT_TOLERANCE = """
--use-fault-tolerance --rollout-health-check-interval 5 --rollout-health-check-timeout 10
--rollout-health-check-first-wait 0
"""


def test_a_dead_actor_engine_does_not_stop_training(tmp_path):
    record = config_case.run(tmp_path, mixed.SGLANG_CONFIG_YAML, mixed.FLAGS + FAULT_TOLERANCE)
    retries = config_case.case.twins.series(record, "rollout/engine_retries")
    assert retries[1] > 0 and sorted(config_case.case.twins.series(record, "train/loss")) == [0, 1, 2]
