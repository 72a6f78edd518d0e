"""GPU twin of the seed's tests/e2e/short/test_qwen2.5_0.5B_opd_sglang.py (radixark/miles 31f1ca961):
on-policy distillation from an SGLang teacher (the same Qwen2.5-0.5B-Instruct: self-distillation)
served by `python -m sglang.launch_server` on the 5th GPU, the policy trained on the first 4 with
the Megatron backend, colocated SGLang rollout, 2 rollouts of GSM8K, `--opd-log-prob-top-k 2
--opd-top-k-strategy only-student --opd-reward-weight-mode student_p`, --ci-test. The CPU twin (the
policy's KL to the teacher falls) is tests/e2e/test_train_opd.py; the top-k KL's arithmetic is held
to hand-worked values in tests/unit/test_train_opd_top_k.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=400, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=300, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

TRAIN_GPUS, TEACHER_GPU, PORT = 4, 4, 13141
MODULE = "miles.rollout.on_policy_distillation"
# the seed passes its eval flags with no --eval-interval (scoring nothing), which miles refuses as
# flags without effect: --eval-interval 20 scores GSM8K once, before training, as the seed's siblings do
FLAGS = f"""
--eval-interval 20 --num-rollout 2 --rollout-batch-size 8 --n-samples-per-prompt 4 --rollout-max-response-len 1024
--rollout-temperature 0.8 --global-batch-size 32
--use-opd --opd-type sglang --opd-kl-coef 1.0 --opd-log-prob-top-k 2 --opd-top-k-strategy only-student
--opd-reward-weight-mode student_p
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.6 --sglang-enable-metrics --ci-test
--actor-num-nodes 1 --actor-num-gpus-per-node {TRAIN_GPUS} --colocate
--custom-rm-path {MODULE}.reward_func --custom-reward-post-process-path {MODULE}.post_process_rewards
--rm-url http://127.0.0.1:{PORT}/generate
"""


def _visible() -> list[str]:
    names = os.environ.get("HIP_VISIBLE_DEVICES") or os.environ.get("CUDA_VISIBLE_DEVICES")
    return names.split(",") if names else [str(i) for i in range(8)]


def _teacher(model: Path, device: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": device, "HIP_VISIBLE_DEVICES": device}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
           "--port", str(PORT), "--tp", "1", "--mem-fraction-static", "0.6"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(120):
        assert proc.poll() is None, f"the teacher exited {proc.returncode}: see {log}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health_generate", timeout=2) as answer:
                if answer.status == 200:
                    return proc
        except OSError:
            time.sleep(5)
    proc.kill()
    raise AssertionError(f"the teacher did not answer within 10 minutes: see {log}")


def test_opd_trains_on_the_teachers_reverse_kl(tmp_path):
    devices = _visible()
    plan = case.twins.prepared(case.RECIPE, case.MODEL, datasets=("gsm8k",))
    teacher = _teacher(plan.hf_dir, devices[TEACHER_GPU], tmp_path / "teacher.log")
    try:
        train = ",".join(devices[:TRAIN_GPUS])
        env = {"CUDA_VISIBLE_DEVICES": train, "HIP_VISIBLE_DEVICES": train}
        record = case.run(tmp_path, FLAGS, actor_gpus=TRAIN_GPUS, env=env)
    finally:
        teacher.kill()
        teacher.wait()
    kl = case.twins.series(record, "rollout/opd_reverse_kl")
    assert sorted(kl) == [0, 1]
    assert sorted(case.twins.series(record, "train/loss")) == [0, 1]
