"""Rollout routing replay (R3) for DeepSeek-V4, whose model is miles' own on the Megatron backend
(miles.families.deepseek_v4.model: its SqrtSoftplusRouter picks the top-k of sqrt(softplus) scores
plus a fixed expert bias; its hash-routed layers take their experts from a token-id table, the
engine's too): with --use-rollout-routing-replay the top-k routers take the rollout engine's experts,
and the train/rollout logprob gap stays at the float32 floor on both training backends, where without
it near-tied routers send tokens to other experts in training than in the rollout.

The checkpoint is the tiny DeepSeek-V4 (float32: sliding, sliding, CSA and HCA attention layers, the
first MLP hash-routed) with three routed experts of every router given rows 1e-8 apart
(tests/support/ckpt.py near_tied_checkpoint). Every case trains 2 rollouts (lr 1e-6) in one launch of
two gloo ranks: FSDP without and with R3, and Megatron without R3 and with it at TP 2 with sequence
parallelism and EP 2, and at PP 2.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import replay_cases as r3

register_cpu_ci(est_time=60, suite="stage-b-cpu")


@pytest.fixture(scope="module")
def gaps(tmp_path_factory) -> dict[str, list[float]]:
    return r3.gaps(
        "deepseek_v4", 4, tmp_path_factory.mktemp("r3_deepseek_v4"), megatron_without=True, spacing=1e-8
    )


@pytest.mark.parametrize("case", ["fsdp", "megatron/tp2-sp-ep2"])
def test_without_replay_near_tied_routers_move_the_gap_far_above_the_floor(gaps, case):
    r3.assert_apart(gaps, case)


def test_with_replay_the_fsdp_gap_stays_at_the_float32_floor_after_every_step(gaps):
    r3.assert_at_the_floor(gaps, "fsdp/r3")


@pytest.mark.parametrize("layout", list(r3.MEGATRON_LAYOUTS))
def test_with_replay_megatron_layouts_stay_at_the_float32_floor(gaps, layout):
    r3.assert_at_the_floor(gaps, f"megatron/{layout}/r3")
