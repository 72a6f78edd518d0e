"""A global batch that varies per step: the partial step trains like a fixed batch of its own size.

The seed framework's variable-batch run (radixark/miles 31f1ca961,
tests/e2e/megatron/test_qwen3_4B_variable_gbs.py) rolls out 32 samples with --global-batch-size
24, --allow-partial-train-step and --disable-rollout-trim-samples: steps of 24 and 8, the loss of
each normalised by its own sample count (miles/backends/training_utils/loss.py). Here the tiny
Qwen3 recipe does that on two gloo ranks, with each backend (FSDP: data parallel over both;
Megatron: TP=2 with SP), from one saved rollout (--load-debug-rollout-data): its first three
groups get equal rewards, so the 24-sample step has zero advantage and a zero gradient (AdamW
with no weight decay then leaves every weight exactly as it was), and the 8-sample partial step
trains on the starting weights. The equivalent fixed run, --global-batch-size 8 over 16 samples
(one zero-advantage group, then the same 8), must report the same gradient norm and loss
(rel 1e-5, fp32): both are means over the two steps, and the first steps are zero in both.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=10, suite="stage-b-cpu")


ROLLOUT = ("--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--rollout-max-response-len", "6")
LEARN = ("--num-rollout", "1", "--micro-batch-size", "4", "--lr", "1e-3", "--weight-decay", "0")
BACKENDS = ("fsdp", "megatron")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """One directory for every run here, so the tiny checkpoint is prepared once."""
    return tmp_path_factory.mktemp("partial")


@pytest.fixture(scope="module")
def saved_rollout(workdir) -> Path:
    """One rollout of 4 groups of 8 (the tiny model's own samples), saved."""
    path = workdir / "rollout_0.json"
    plan = runs.tiny_plan(
        "qwen3_4b", workdir, *ROLLOUT, *LEARN, "--debug-rollout-only", "--save-debug-rollout-data", str(path),
        train_backend="fsdp",
    )  # fmt: skip
    assert runs.launch(plan, workdir / "record") == 0
    return path


def _write(path: Path, samples: list[dict]) -> str:
    path.write_text(json.dumps(samples))
    return str(path)


@pytest.fixture(scope="module")
def rollouts(saved_rollout) -> tuple[str, str]:
    """(32 samples: three zero-advantage groups, then a learning one; 16: one of each)."""
    samples = json.loads(saved_rollout.read_text())
    assert len(samples) == 32
    for i, sample in enumerate(samples):
        sample["reward"] = 0.0 if i < 24 else float(i % 2)
    variable = _write(saved_rollout.with_name("variable.json"), samples)
    fixed = _write(saved_rollout.with_name("fixed.json"), samples[:8] + samples[24:])
    return variable, fixed


def _run(workdir: Path, backend: str, rollout: str, *args: str, groups: int = 4) -> dict[str, float]:
    """Train one step on the saved `rollout` of `groups` groups."""
    run_id = f"{backend}-{Path(rollout).stem}"
    sizes = ("--rollout-batch-size", str(groups), *ROLLOUT[2:])
    plan = runs.tiny_plan(
        "qwen3_4b", workdir, *sizes, *LEARN, "--load-debug-rollout-data", rollout, *args,
        run_id=run_id, train_backend=backend,
    )  # fmt: skip
    record = workdir / f"record-{run_id}"
    assert runs.launch(plan, record) == 0
    return {
        key: runs.series(record, key)[0] for key in ("train/grad_norm", "train/loss", "train/optimizer_steps")
    }


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_partial_step_gives_the_gradient_of_the_equivalent_fixed_batch(rollouts, workdir, backend):
    variable, fixed = rollouts
    partial = _run(
        workdir, backend, variable,
        "--global-batch-size", "24", "--allow-partial-train-step", "--disable-rollout-trim-samples",
    )  # fmt: skip
    whole = _run(workdir, backend, fixed, "--global-batch-size", "8", groups=2)
    print(f"{backend}: partial {partial} / fixed {whole}")
    assert partial["train/optimizer_steps"] == whole["train/optimizer_steps"] == 2  # 24 + 8; 8 + 8
    assert whole["train/grad_norm"] > 0
    for key in ("train/grad_norm", "train/loss"):
        assert partial[key] == pytest.approx(whole[key], rel=1e-5), (key, partial, whole)
