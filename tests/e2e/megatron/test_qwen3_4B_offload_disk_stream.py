"""GPU twin of radixark/miles 31f1ca961 tests/e2e/megatron/test_qwen3_4B_offload_disk_stream.py.

The disk-offload run of test_qwen3_4B_offload_disk.py with the optimizer state also streamed
through disk during each step (`--stream-optimizer-state-to-disk`): every rank must log its
disk offload and its streamed steps (offload_disk_run.py holds the command). miles streams Adam's
moments; megatron-core's fp32 main parameters stay on the GPU (the seed streams them too). The
CPU twin is tests/e2e/test_train_offload.py. Untested on GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=600, suite="stage-c-4-gpu-h200", labels=["miles-plugin"])
register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["miles-plugin", "amd"])
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


def test_qwen3_4b_trains_with_its_optimizer_state_streamed_through_disk(tmp_path):
    out = seed_run.run(tmp_path / "train_offload_disk_stream", stream=True)  # asserts the seed's checks too
    assert "miles.train: rank 0 streamed the optimizer state through disk" in out
