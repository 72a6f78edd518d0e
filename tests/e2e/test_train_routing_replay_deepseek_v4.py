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
from tests.support import recipes as runs
from tests.support.ckpt import near_tied_checkpoint
from tests.support.trainer_cases import run_cases

register_cpu_ci(est_time=60, suite="stage-b-cpu")

FLOOR = 1e-5  # float32: the engine's and the trainer's logprobs of the same routing agree far below it
GAP = "train/train_rollout_logprob_abs_diff"
ROLLOUTS = 2
BASE = (
    "--prompt-data", "synthetic:fixed", "--num-rollout", str(ROLLOUTS), "--rollout-batch-size", "4",
    "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--micro-batch-size", "4",
    "--rollout-max-response-len", "8", "--lr", "1e-6", "--num-threads", "1", "--actor-num-gpus-per-node", "2",
)  # fmt: skip
MEGATRON_LAYOUTS = {
    "tp2-sp-ep2": (
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1",
    ),
    "pp2": ("--pipeline-model-parallel-size", "2"),
}  # fmt: skip
R3 = ("--use-rollout-routing-replay",)


@pytest.fixture(scope="module")
def gaps(tmp_path_factory) -> dict[str, list[float]]:
    """The logprob gap by rollout of every case."""
    root = tmp_path_factory.mktemp("r3_deepseek_v4")
    hf, dist = near_tied_checkpoint("deepseek_v4", 4, root, spacing=1e-8)
    fsdp = [*BASE, "--hf-checkpoint", str(hf), "--train-backend", "fsdp"]
    megatron = [*BASE, "--hf-checkpoint", str(hf), "--train-backend", "megatron", "--ref-load", str(dist)]
    cases = {
        "fsdp": fsdp,
        "fsdp/r3": [*fsdp, *R3],
        "megatron/tp2-sp-ep2": [*megatron, *MEGATRON_LAYOUTS["tp2-sp-ep2"]],
    }
    cases |= {f"megatron/{name}/r3": [*megatron, *flags, *R3] for name, flags in MEGATRON_LAYOUTS.items()}
    records = run_cases(cases, root / "records")
    series = {name: runs.series(folder, GAP) for name, folder in records.items()}
    out = {name: [s[k] for k in sorted(s)] for name, s in series.items()}
    print(out)
    return out


@pytest.mark.parametrize("case", ["fsdp", "megatron/tp2-sp-ep2"])
def test_without_replay_near_tied_routers_move_the_gap_far_above_the_floor(gaps, case):
    assert len(gaps[case]) == ROLLOUTS, gaps
    assert gaps[case][0] > 10 * FLOOR, gaps  # the engine's and the trainer's routing differ


def test_with_replay_the_fsdp_gap_stays_at_the_float32_floor_after_every_step(gaps):
    assert len(gaps["fsdp/r3"]) == ROLLOUTS, gaps
    assert max(gaps["fsdp/r3"]) <= FLOOR, gaps


@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_with_replay_deepseek_v4s_own_router_stays_at_the_float32_floor(gaps, layout):
    gap = gaps[f"megatron/{layout}/r3"]
    assert len(gap) == ROLLOUTS, gaps
    assert max(gap) <= FLOOR, gaps
