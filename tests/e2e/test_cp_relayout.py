"""The context-parallel relayout (zigzag <-> packed shards) is exact at 2 and 4 ranks, with its gradients.

The CPU twin of radixark/miles 31f1ca961 tests/e2e/precision/test_hf_attention_cp_relayout.py (its
GPU twin is tests/e2e/precision/test_hf_attention_cp_relayout.py here): the same worker
(tests/e2e/cp_relayout_worker.py, the checks listed there) under torchrun on gloo ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("cp_relayout_worker.py")


def relayout(ranks: int, backend: str = "gloo") -> subprocess.CompletedProcess:
    """The worker on `ranks` processes (one per GPU with nccl)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        str(WORKER),
    ]
    env = {**os.environ, "MILES_RELAYOUT_BACKEND": backend, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize("ranks", [2, 4])
def test_relayout_round_trips_exactly(ranks):
    proc = relayout(ranks)
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert proc.returncode == 0 and lines == [f"rank {r} of {ranks}: relayout exact" for r in range(ranks)], (
        proc.stdout + proc.stderr
    )[-3000:]


def test_a_length_the_ranks_cannot_split_is_refused():
    from miles.megatron.cp_relayout import zigzag_positions

    with pytest.raises(
        ValueError, match="sequence 1 has 6 tokens, which the 4 context-parallel ranks cannot split"
    ):
        zigzag_positions([16, 6], cp=4, rank=0)
