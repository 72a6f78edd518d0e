"""GPU twin of the seed's tests/e2e/short/test_qwen2.5_0.5B_compact_rollout.py (radixark/miles
31f1ca961): a compact generate function splits every rollout execution into two training
samples of one rollout; Qwen2.5-0.5B-Instruct colocated on 8 GPUs, 3 rollouts, --ci-test. The
seed's fixture tests.manual.compact_split_generate is miles.train.generate_hub.compact_split
here. Its CPU twin is tests/unit/test_generate_pieces.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=400, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

FLAGS = """
--custom-generate-function-path miles.train.generate_hub.compact_split
--num-rollout 3 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 1024
--rollout-temperature 0.8 --global-batch-size 32 --eval-interval 20
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.7
--ci-test --actor-num-nodes 1 --actor-num-gpus-per-node 8 --colocate
"""


def test_compact_rollout_trains_split_executions(tmp_path):
    record = case.run(tmp_path, FLAGS, actor_gpus=8)
    assert sorted(case.twins.series(record, "train/loss")) == [0, 1, 2]
