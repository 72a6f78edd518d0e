"""The routing-replay (R3) cases the per-family R3 tests share: a near-tied tiny checkpoint of the
family trained 2 rollouts (lr 1e-6) by FSDP without and with --use-rollout-routing-replay, and by the
Megatron backend with it at TP 2 with sequence parallelism and EP 2 and at PP 2 (and, where asked,
without it at TP 2 + SP + EP 2), all in one launch of two gloo ranks (tests/support/trainer_cases.py);
`gaps` returns each case's train/rollout logprob gap by rollout."""

from __future__ import annotations

from pathlib import Path

from tests.support import recipes as runs
from tests.support.ckpt import near_tied_checkpoint
from tests.support.trainer_cases import run_cases

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


def gaps(
    family: str, layers: int, root: Path, *, megatron_without: bool = False, **tie
) -> dict[str, list[float]]:
    """Each case's gap by rollout: "fsdp", "fsdp/r3", "megatron/{layout}/r3" and, with
    `megatron_without`, "megatron/tp2-sp-ep2"; `tie` goes to near_tied_checkpoint."""
    hf, dist = near_tied_checkpoint(family, layers, root, **tie)
    fsdp = [*BASE, "--hf-checkpoint", str(hf), "--train-backend", "fsdp"]
    megatron = [*BASE, "--hf-checkpoint", str(hf), "--train-backend", "megatron", "--ref-load", str(dist)]
    cases = {"fsdp": fsdp, "fsdp/r3": [*fsdp, *R3]}
    if megatron_without:
        cases["megatron/tp2-sp-ep2"] = [*megatron, *MEGATRON_LAYOUTS["tp2-sp-ep2"]]
    cases |= {f"megatron/{name}/r3": [*megatron, *flags, *R3] for name, flags in MEGATRON_LAYOUTS.items()}
    records = run_cases(cases, root / "records")
    series = {name: runs.series(folder, GAP) for name, folder in records.items()}
    out = {name: [s[k] for k in sorted(s)] for name, s in series.items()}
    print(out)
    return out


def assert_apart(gaps: dict[str, list[float]], case: str) -> None:
    """Without replay the engine's and the trainer's routing differ: the first rollout's gap is far
    above the floor."""
    assert len(gaps[case]) == ROLLOUTS, gaps
    assert gaps[case][0] > 10 * FLOOR, gaps


def assert_at_the_floor(gaps: dict[str, list[float]], case: str) -> None:
    """With replay the gap stays at the float32 floor after every step."""
    assert len(gaps[case]) == ROLLOUTS, gaps
    assert max(gaps[case]) <= FLOOR, gaps
