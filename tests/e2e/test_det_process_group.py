"""The deterministic process group (miles.train.deterministic) folds sums in a fixed order, bit for bit.

The seed framework's test of its det_nccl backend (radixark/miles 31f1ca961,
tests/fast-gpu/test_det_process_group.py) checks, on 4 GPUs, that all-reduce and reduce-scatter
equal a hand-computed pairwise tree fold bitwise (SUM and AVG, under the coalescing manager, for
non-contiguous tensors, in chunks) and that every other collective is delegated faithfully.
tests/e2e/det_collectives_worker.py makes the same checks on 4 ranks: over gloo (`det_gloo`) on
the CPU lane, over NCCL/RCCL (`det_nccl`) on GPUs, including the values whose sum a different
bracketing changes (0.5 + 0.5 + 2^-53 + 2^-53 keeps 2^-52 only as a tree) and a three-rank group's
ascending fold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cpu_ci, register_cuda_ci, register_rocm_ci

register_cpu_ci(est_time=6, suite="stage-b-cpu")
register_cuda_ci(est_time=240, suite="stage-c-4-gpu-h200", labels=["precision"])
register_rocm_ci(est_time=60, suite="nightly-stage-c-4-gpu-mi350", labels=["precision"])

WORKER = Path(__file__).with_name("det_collectives_worker.py")
ON_GPU = os.environ.get("MILES_CI_BACKEND", "cpu") != "cpu"


def test_det_process_group_folds_in_a_fixed_order_and_delegates_the_rest():
    backend = "nccl" if ON_GPU else "gloo"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
        str(WORKER),
        backend,
    ]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert sorted(line for line in proc.stdout.splitlines() if "every check passed" in line) == [
        f"rank {r}: every check passed" for r in range(4)
    ], output[-4000:]
