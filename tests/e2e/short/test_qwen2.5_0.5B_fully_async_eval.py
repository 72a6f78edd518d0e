"""GPU twin of the seed's tests/e2e/short/test_qwen2.5_0.5B_fully_async_eval.py (radixark/miles
31f1ca961): Qwen2.5-0.5B-Instruct trained fully asynchronously on 2 GPUs with 5 SGLang servers,
GSM8K evaluated every second rollout, 4 rollouts, --ci-test. The seed evaluates on a dedicated
fleet of one more GPU (--eval-num-gpus ...); miles evaluates on the rollout engines while the
worker submits nothing (the fleet flags are left out: tests/e2e/qwen25_case.py). Its CPU twin is
tests/e2e/test_train_fully_async.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h100", labels=["short", "eval", "fully-async"])
register_rocm_ci(est_time=400, suite="nightly-stage-c-8-gpu-mi350", labels=["short", "eval", "fully-async"])

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

FLAGS = """
--fully-async --num-rollout 4 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 1024
--rollout-temperature 0.8 --global-batch-size 32 --pause-generation-mode in_place
--eval-interval 2 --eval-num-gpus 1 --eval-num-gpus-per-engine 1 --eval-hf-dir /dev/shm/miles_e2e_eval_hf
--eval-keep-snapshots 2
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.65 --sglang-enable-metrics
--ci-test --actor-num-nodes 1 --actor-num-gpus-per-node 2 --rollout-num-gpus 5
"""


def test_fully_async_training_evaluates_on_the_shared_engines(tmp_path):
    record = case.run(tmp_path, FLAGS, actor_gpus=2)
    assert sorted(case.twins.series(record, "eval/gsm8k")) == [1, 3]
