"""The routing-replay (R3) cases the per-family R3 tests share: a near-tied tiny checkpoint of the
family trained 2 rollouts (lr 1e-6; or as many as asked) by FSDP without and with
--use-rollout-routing-replay, and by the Megatron backend with it at TP 2 with sequence parallelism
and EP 2 and at PP 2 (or the layouts asked; and, where asked, at one of them without it), all in one
launch of two gloo ranks (tests/support/trainer_cases.py); `gaps` returns each case's train/rollout
logprob gap by rollout."""

from __future__ import annotations

from pathlib import Path

from tests.support import recipes as runs
from tests.support.ckpt import near_tied_checkpoint
from tests.support.trainer_cases import run_cases

FLOOR = 1e-5  # float32: the engine's and the trainer's logprobs of the same routing agree far below it
GAP = "train/train_rollout_logprob_abs_diff"
ROLLOUTS = 2
BASE = (
    "--prompt-data", "synthetic:fixed", "--rollout-batch-size", "4",
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
    family: str,
    layers: int,
    root: Path,
    *,
    rollouts: int = ROLLOUTS,
    layouts: dict[str, tuple[str, ...]] = MEGATRON_LAYOUTS,
    megatron_without: str | None = None,
    **tie,
) -> dict[str, list[float]]:
    """Each case's gap by rollout: "fsdp", "fsdp/r3", "megatron/{layout}/r3" for each of `layouts`
    and, with `megatron_without` (one of them), "megatron/{megatron_without}"; `tie` goes to
    near_tied_checkpoint."""
    hf, dist = near_tied_checkpoint(family, layers, root, **tie)
    base = [*BASE, "--num-rollout", str(rollouts), "--hf-checkpoint", str(hf)]
    fsdp = [*base, "--train-backend", "fsdp"]
    megatron = [*base, "--train-backend", "megatron", "--ref-load", str(dist)]
    cases = {"fsdp": fsdp, "fsdp/r3": [*fsdp, *R3]}
    if megatron_without:
        cases[f"megatron/{megatron_without}"] = [*megatron, *layouts[megatron_without]]
    cases |= {f"megatron/{name}/r3": [*megatron, *flags, *R3] for name, flags in layouts.items()}
    records = run_cases(cases, root / "records")
    series = {name: runs.series(folder, GAP) for name, folder in records.items()}
    out = {name: [s[k] for k in sorted(s)] for name, s in series.items()}
    print(out)
    return out


def assert_apart(gaps: dict[str, list[float]], case: str, rollouts: int = ROLLOUTS) -> None:
    """Without replay the engine's and the trainer's routing differ: the first rollout's gap is far
    above the floor."""
    assert len(gaps[case]) == rollouts, gaps
    assert gaps[case][0] > 10 * FLOOR, gaps


def assert_at_the_floor(gaps: dict[str, list[float]], case: str, rollouts: int = ROLLOUTS) -> None:
    """With replay the gap stays at the float32 floor after every step."""
    assert len(gaps[case]) == rollouts, gaps
    assert max(gaps[case]) <= FLOOR, gaps
