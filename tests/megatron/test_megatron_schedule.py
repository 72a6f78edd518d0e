"""The virtual pipeline a trainer command asks for is the schedule megatron-core runs.

Megatron-LM spells the virtual pipeline two ways: --num-virtual-stages-per-pipeline-rank N,
or --num-layers-per-virtual-pipeline-stage L (layers per pipeline rank / L stages). Two
gloo ranks build the Megatron backend from each command (pp=2, a 4-layer Qwen3), compute
logprobs and take one training step; a profiler hook records which of megatron-core's
schedule functions ran. Both spellings must run the interleaved schedule over two model
chunks per rank, and a command without them the plain pipeline schedule over one.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import tiny

register_cpu_ci(est_time=8, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("schedule_worker.py")
PP2 = ["--pipeline-model-parallel-size", "2"]
CASES = {
    "stages-per-rank": [*PP2, "--num-virtual-stages-per-pipeline-rank", "2"],
    "layers-per-stage": [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"],
    "no-vpp": PP2,
}


@pytest.fixture(scope="module")
def schedules() -> dict[str, dict]:
    qwen3 = tiny("qwen3", 4, torch_dist=True)
    return ranks.case_results(WORKER, CASES, str(qwen3.hf), str(qwen3.torch_dist), preload=ranks.MEGATRON_PRELOAD)


@pytest.mark.parametrize("case", ["stages-per-rank", "layers-per-stage"])
def test_either_virtual_pipeline_flag_trains_interleaved_over_two_chunks(schedules, case):
    result = schedules[case]
    assert result["vpp"] == 2, result
    assert result["schedules"] == ["forward_backward_pipelining_with_interleaving"], result
    assert result["chunks"] == 2 and result["megatron_vpp"] == 2, result
    assert result["applied"] and math.isfinite(result["grad_norm"]), result


def test_without_a_virtual_pipeline_the_plain_pipeline_schedule_runs(schedules):
    result = schedules["no-vpp"]
    assert result["vpp"] is None, result
    assert result["schedules"] == ["forward_backward_pipelining_without_interleaving"], result
    assert result["chunks"] == 1 and result["megatron_vpp"] is None, result
