"""Qwen3.5's gated delta net under context parallelism computes what it computes on the whole sequence.

The CPU twin of radixark/miles 31f1ca961 tests/e2e/precision/test_qwen3_5_cp_correctness.py: the
layer (megatron-core's GatedDeltaNet as miles/families/qwen3_5_moe/gdn.py builds it) at the seed's
sizes, its sequence split over two gloo context-parallel ranks in megatron's load-balanced order,
gives the whole-sequence layer's output, input gradient and parameter gradients (summed over the
ranks) in float32, within 1e-5 of their scale (the seed's bf16 bound is 1e-2). The whole model
under CP 2 is held to CP 1 and to transformers in tests/megatron/test_megatron_qwen3_5.py.
"""

from __future__ import annotations

from pathlib import Path

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.results import result

register_cpu_ci(est_time=4, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("gdn_cp_worker.py")
REL = 1e-5


def run(nproc: int = 2, backend: str = "gloo") -> dict:
    return result(ranks.launch(WORKER, backend, nproc=nproc))


def assert_equal_to_whole_sequence(found: dict, rel: float) -> None:
    assert found["output"] <= rel * found["output_scale"], found
    assert found["input_grad"] <= rel * found["input_grad_scale"], found
    assert found["param_grad"] <= rel * found["param_grad_scale"], found


def test_two_context_parallel_ranks_give_the_whole_sequences_output_and_gradients():
    found = run()
    print(found)
    assert found["cp"] == 2 and found["dtype"] == "torch.float32"
    assert_equal_to_whole_sequence(found, REL)
