"""Rollout routing replay (R3) in the routers miles builds itself on the Megatron backend: Inkling's
(miles.families.inkling.layers.InklingRouter: sigmoid scores plus the expert bias pick the experts, one
softmax over the chosen and the shared experts' log-sigmoid logits weighs them) and DeepSeek-V4's
(miles.families.deepseek_v4.model.SqrtSoftplusRouter: the top-k of sqrt(softplus) scores plus a fixed
expert bias; its hash-routed layers take their experts from a token-id table, the engine's too). With
--use-rollout-routing-replay they take the rollout engine's experts and the train/rollout logprob gap
stays at the float32 floor on both training backends, where without it near-tied routers send tokens
to other experts in training than in the rollout, on FSDP and on Megatron alike.

Each family's tiny checkpoint (float32; Inkling: a sliding-window dense layer, then a global MoE layer
with two shared experts; DeepSeek-V4: sliding, sliding, CSA and HCA attention layers, the first MLPs
hash-routed) has three routed experts of every router given rows 1e-8 apart and one expert bias
(tests/support/ckpt.py near_tied_checkpoint). Every case trains 2 rollouts (lr 1e-6) in one launch of
two gloo ranks per family (tests/support/replay_cases.py). Measured: without replay 2.0e-4 (FSDP) and
2.7e-4 (Megatron) for Inkling, 4.5e-3 and 3.3e-3 for DeepSeek-V4; with it at most 1.4e-7 and 2.3e-7.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import replay_cases as r3

register_cpu_ci(est_time=30, suite="stage-b-cpu")

FAMILIES = {
    # its head scaled by 30 (as tests/support/inkling.py does): logits of order 1, not 0.06, where an
    # expert routed otherwise moves the logprobs by 1e-5 only
    "inkling": dict(layers=2, spacing=1e-8, head_scale=30.0),
    "deepseek_v4": dict(layers=4, spacing=1e-8),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def gaps(request, tmp_path_factory) -> dict[str, list[float]]:
    family = request.param
    tie = dict(FAMILIES[family])
    layers = tie.pop("layers")
    return r3.gaps(
        family, layers, tmp_path_factory.mktemp(f"r3_{family}"), megatron_without="tp2-sp-ep2", **tie
    )


@pytest.mark.parametrize("case", ["fsdp", "megatron/tp2-sp-ep2"])
def test_without_replay_near_tied_routers_move_the_gap_far_above_the_floor(gaps, case):
    r3.assert_apart(gaps, case)


def test_with_replay_the_fsdp_gap_stays_at_the_float32_floor_after_every_step(gaps):
    r3.assert_at_the_floor(gaps, "fsdp/r3")


@pytest.mark.parametrize("layout", list(r3.MEGATRON_LAYOUTS))
def test_with_replay_the_own_routers_stay_at_the_float32_floor(gaps, layout):
    r3.assert_at_the_floor(gaps, f"megatron/{layout}/r3")
