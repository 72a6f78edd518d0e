"""Rollout routing replay (R3): with --use-rollout-routing-replay the train/rollout logprob gap of a
tiny MoE stays at the float32 floor where, without it, near-tied routers send tokens to other
experts in training than in the rollout.

The checkpoint is the tiny Qwen3-MoE (float32) with three experts of every MoE layer given router
rows 1e-6 apart (and four times the others' scale, so the three lead): each token's top-2 is a
near-tie among them, which the engine's cached decode and the trainer's whole-sequence forward
round differently. Every case trains 3 rollouts (lr 1e-6) in one launch of two gloo ranks
(tests/support/trainer_cases.py): FSDP and Megatron EP2 each with and without R3, and Megatron at
TP2 with SP and EP2, and at PP2, with R3. Measured here: without R3 the gap is 6.5e-4 / 7.0e-4 at
the first rollout and 3.2e-4 after a step (FSDP); with R3 at most 2.1e-7 everywhere.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import replay_cases as r3

register_cpu_ci(est_time=15, suite="stage-b-cpu")

ROLLOUTS = 3
EP2 = ("--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1")
LAYOUTS = {"ep2": EP2, **r3.MEGATRON_LAYOUTS}


@pytest.fixture(scope="module")
def gaps(tmp_path_factory) -> dict[str, list[float]]:
    """The logprob gap by rollout of every case."""
    root = tmp_path_factory.mktemp("r3")
    return r3.gaps("qwen3_moe", 2, root, rollouts=ROLLOUTS, layouts=LAYOUTS, megatron_without="ep2")


def test_without_replay_near_tied_routers_move_the_fsdp_gap_far_above_the_floor(gaps):
    r3.assert_apart(gaps, "fsdp", ROLLOUTS)
    assert gaps["fsdp"][1] > r3.FLOOR, gaps  # and after a step too


def test_with_replay_the_fsdp_gap_stays_at_the_float32_floor_after_every_step(gaps):
    r3.assert_at_the_floor(gaps, "fsdp/r3", ROLLOUTS)


def test_without_replay_megatron_ep2_routes_otherwise_than_the_engine(gaps):
    r3.assert_apart(gaps, "megatron/ep2", ROLLOUTS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_with_replay_megatron_layouts_stay_at_the_float32_floor(gaps, layout):
    r3.assert_at_the_floor(gaps, f"megatron/{layout}/r3", ROLLOUTS)
