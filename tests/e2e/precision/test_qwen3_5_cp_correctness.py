"""GPU twin of radixark/miles 31f1ca961 tests/e2e/precision/test_qwen3_5_cp_correctness.py.

Qwen3.5's gated delta net (megatron-core's GatedDeltaNet as miles/families/qwen3_5_moe/gdn.py builds
it, fla's kernel where the image has fla) with its sequence split over 2 and 4 context-parallel GPUs
over NCCL (RCCL on ROCm) gives the whole-sequence layer's output and gradients in bfloat16 within the
seed's bound (1e-2 absolute): the worker and checks of the CPU twin (tests/e2e/test_gdn_context_parallel.py).
Untested on GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=300, suite="stage-c-4-gpu-h200", labels=["precision"])
register_rocm_ci(est_time=120, suite="nightly-stage-c-4-gpu-mi350", labels=["precision"])

_spec = importlib.util.spec_from_file_location(
    "gdn_cp_twin", Path(__file__).parents[1] / "test_gdn_context_parallel.py"
)
twin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twin)

SEED_BOUND = 1e-2  # the seed's bf16 bound on the largest absolute difference


@pytest.mark.parametrize("nproc", [2, 4])
def test_context_parallel_gdn_matches_the_whole_sequence_over_nccl(nproc):
    found = twin.run(nproc, backend="nccl")
    assert found["cp"] == nproc and found["dtype"] == "torch.bfloat16", found
    assert found["output"] < SEED_BOUND and found["input_grad"] < SEED_BOUND, found
