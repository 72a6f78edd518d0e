"""GPU twin of radixark/miles 31f1ca961 tests/e2e/megatron/test_qwen3_4B_offload_disk.py.

Qwen3-4B on 4 GPUs, Megatron TP2+SP, colocated with SGLang, the trainer's state offloaded to
disk between phases (`--offload-train --offload-train-target disk --offload-train-disk-chunk-mb
64`); every rank must log that it armed and used disk offload under its own directory, and the
directory must be empty after the run (offload_disk_run.py holds the command and what is left
out of the seed's). The CPU twin is tests/e2e/test_train_offload.py. Untested on GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=600, suite="stage-c-4-gpu-h200", labels=["megatron"])
register_rocm_ci(est_time=300, suite="nightly-stage-c-4-gpu-mi350", labels=["megatron"])
register_ci_gate(metric_key="train/grad_norm")
register_ci_gate(metric_key="train/ppo_kl")
register_ci_gate(metric_key="train/train_rollout_logprob_abs_diff")
register_ci_gate(metric_key="train/train_rollout_kl")
register_ci_gate(metric_key="rollout/raw_reward")

_spec = importlib.util.spec_from_file_location(
    "offload_disk_run", Path(__file__).with_name("offload_disk_run.py")
)
seed_run = sys.modules.setdefault("offload_disk_run", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(seed_run)


def test_qwen3_4b_trains_with_its_state_offloaded_to_disk(tmp_path):
    out = seed_run.run(tmp_path / "train_offload_disk", stream=False)  # asserts the seed's checks too
    assert "miles.train: rank 0 offloaded the trainer state to disk" in out
    assert "streamed the optimizer state through disk" not in out  # the whole state, not streamed
