"""Cross-backend alignment from saved rollouts: one run's rollouts replayed by another backend or layout.

The CPU twin of radixark/miles 31f1ca961 tests/e2e/fsdp/test_qwen3_0.6B_megatron_fsdp_align.py
(its GPU twin is tests/e2e/fsdp/test_qwen3_0.6B_megatron_fsdp_align.py here), on a tiny Qwen3
over two gloo ranks in float32. An FSDP run saves its rollouts (--save-debug-rollout-data) and
each optimizer step's gradient norm and loss (--ci-save-grad-norm); replays train on those
rollouts with no rollout engine (--load-debug-rollout-data implies --debug-train-only) and check
every step against the saved ones in the run (--ci-load-grad-norm, the seed's bound 3%); the
tests hold them to the FSDP run step by step within the seed's bar of rel 1e-4 for Megatron, and
bit for bit for FSDP replaying its own rollouts.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=7, suite="stage-b-cpu")

_spec = importlib.util.spec_from_file_location("trainer_runs", Path(__file__).with_name("trainer_runs.py"))
runs = sys.modules.setdefault("trainer_runs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(runs)

ROLLOUTS = 2
STEPS = [f"{r}/{s}" for r in range(ROLLOUTS) for s in range(2)]  # two optimizer steps per rollout
MEGATRON_LAYOUTS = {"dp2": ()}  # the seed's layout: TP1, PP1, CP1 on two devices


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model, its torch_dist, and the FSDP run that saved its rollouts and steps."""
    root = tmp_path_factory.mktemp("align")
    hf, dist = runs.tiny_qwen3(root)
    data = root / "rollouts"
    data.mkdir()
    fsdp = runs.train(
        root, hf, "--num-rollout", str(ROLLOUTS), "--train-backend", "fsdp",
        "--save-debug-rollout-data", str(data / "rollout_{rollout_id}.json"),
        "--ci-save-grad-norm", str(root / "steps_fsdp.json"), name="fsdp",
    )  # fmt: skip
    assert fsdp.returncode == 0, fsdp.tail()
    assert sorted(p.name for p in data.iterdir()) == [f"rollout_{r}.json" for r in range(ROLLOUTS)]
    return hf, dist, root, fsdp


def _replay(saved, tmp_path: Path, *args: str, name: str) -> tuple[runs.Run, dict]:
    hf, _, root, _ = saved
    steps = tmp_path / f"steps_{name}.json"
    run = runs.train(
        tmp_path, hf, "--num-rollout", str(ROLLOUTS),
        "--load-debug-rollout-data", str(root / "rollouts" / "rollout_{rollout_id}.json"),
        "--ci-load-grad-norm", str(root / "steps_fsdp.json"), "--ci-save-grad-norm", str(steps), *args, name=name,
    )  # fmt: skip
    assert run.returncode == 0, run.tail()
    assert "rollout replayed from" in run.output
    return run, json.loads(steps.read_text())


def _fsdp_steps(saved) -> dict:
    return json.loads((saved[2] / "steps_fsdp.json").read_text())


def test_fsdp_replaying_its_own_rollouts_trains_bit_for_bit_alike(saved, tmp_path):
    replay, steps = _replay(saved, tmp_path, "--train-backend", "fsdp", name="fsdp_replay")
    assert steps == _fsdp_steps(saved)
    assert sorted(steps) == STEPS
    runs.assert_same_metrics(saved[3], replay, range(ROLLOUTS))


@pytest.mark.parametrize("layout", list(MEGATRON_LAYOUTS))
def test_megatron_replaying_fsdp_rollouts_matches_fsdp_step_by_step(saved, tmp_path, layout):
    _, dist, _, fsdp = saved
    replay, steps = _replay(
        saved, tmp_path, "--train-backend", "megatron", "--ref-load", str(dist), *MEGATRON_LAYOUTS[layout],
        name=f"megatron_{layout}",
    )  # fmt: skip
    expected = _fsdp_steps(saved)
    assert sorted(steps) == STEPS
    for key in STEPS:
        for metric in ("loss", "grad_norm"):
            assert steps[key][metric] == pytest.approx(expected[key][metric], rel=1e-4), (
                f"{layout} step {key} {metric}: megatron {steps[key][metric]!r}, fsdp {expected[key][metric]!r}"
            )
    runs.assert_same_metrics(fsdp, replay, range(ROLLOUTS), rel=1e-4)


def test_a_replay_that_trains_otherwise_fails_the_step_check(saved, tmp_path):
    hf, _, root, _ = saved
    # the same rollouts at 30x the learning rate: the first step matches, the second does not
    run = runs.train(
        tmp_path, hf, "--num-rollout", str(ROLLOUTS), "--train-backend", "fsdp", "--lr", "3e-2",
        "--load-debug-rollout-data", str(root / "rollouts" / "rollout_{rollout_id}.json"),
        "--ci-load-grad-norm", str(root / "steps_fsdp.json"), name="bad",
    )  # fmt: skip
    assert run.returncode != 0
    assert "CheckFailed: rollout 0, step 1: train/grad_norm" in run.output, run.tail()
    assert "the two runs do not train alike" in run.output
