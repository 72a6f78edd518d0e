"""GPU twin of radixark/miles 31f1ca961 tests/e2e/precision/test_hf_attention_cp_relayout.py.

The zigzag <-> packed-shard relayout of miles.megatron.cp_relayout, exact at 2 and 4 ranks, with
its gradients, over NCCL (RCCL on ROCm), one rank per GPU: the worker and checks of the CPU
twin (tests/e2e/test_cp_relayout.py, tests/e2e/cp_relayout_worker.py). Untested on GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=60, suite="stage-c-4-gpu-h200", labels=["precision"])
register_rocm_ci(est_time=90, suite="nightly-stage-c-4-gpu-mi350", labels=["precision"])

_spec = importlib.util.spec_from_file_location(
    "cp_relayout_twin", Path(__file__).parents[1] / "test_cp_relayout.py"
)
twin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twin)


@pytest.mark.parametrize("ranks", [2, 4])
def test_relayout_round_trips_exactly_over_nccl(ranks):
    proc = twin.relayout(ranks, backend="nccl")
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert proc.returncode == 0 and lines == [f"rank {r} of {ranks}: relayout exact" for r in range(ranks)], (
        proc.stdout + proc.stderr
    )[-3000:]
