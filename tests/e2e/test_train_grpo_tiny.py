"""The Qwen3 recipe's CPU `tiny` profile trains for real: 2 gloo ranks under torchrun, FSDP2.

The command is the recipe's own (miles.recipes), with extra_args (which come last and win)
setting what a learning test needs: enough rollouts, a learning rate a random model moves
at, short answers. The tiny model learns the synthetic fixed-answer task; a run resumed
from the mid-run checkpoint continues the same curve; the --ci-test checks (in the tiny
profile) pass, and fail when the rollout engine is left with stale weights. Assertions are
about learning and equal curves, never about time.

On GPU runners the same profile runs over NCCL (extra_args `--distributed-backend nccl`);
the resume test is CPU-only there, because GPU kernels are not bitwise deterministic and a
resumed run's samples may legitimately diverge. The main run's metrics go to the runner's
record directory when it sets one, so the rollout/raw_reward gate sees them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from miles.ci.register import register_ci_gate, register_cpu_ci, register_cuda_ci, register_rocm_ci
from miles.metrics.capture import RECORD_DIR_ENV
from tests.support import recipes as runs

register_cpu_ci(est_time=15, suite="stage-b-cpu")
register_cuda_ci(est_time=120, suite="stage-b-2-gpu-h200", labels=["fsdp", "short"])
register_rocm_ci(est_time=150, suite="stage-c-4-gpu-mi350", labels=["fsdp", "short", "amd"])
# The nightly MI350 lane runs it too, so its baselines of rollout/raw_reward exist to gate PRs against.
register_rocm_ci(est_time=150, suite="nightly-stage-c-2-gpu-mi350", labels=["fsdp", "short", "amd"])
register_ci_gate(metric_key="rollout/raw_reward")


NUM_ROLLOUT = 16
SAVE_AT = 12
# The recipe's tiny profile trains with Megatron (tests/e2e/test_train_megatron_tiny.py); this
# file renders the same recipe for the FSDP backend (Recipe.on_backend).
LEARNING_ARGS = (
    "--num-rollout", str(NUM_ROLLOUT), "--save-interval", str(SAVE_AT), "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "6", "--micro-batch-size", "8", "--lr", "5e-3", "--weight-decay", "0",
)  # fmt: skip
ON_GPU = os.environ.get("MILES_CI_BACKEND", "cpu") != "cpu"
if ON_GPU:
    LEARNING_ARGS += ("--distributed-backend", "nccl")


def fsdp_plan(workdir, *extra: str, **options):
    """The qwen3_4b tiny recipe rendered for FSDP, with LEARNING_ARGS and `extra` (a flag `extra`
    gives replaces LEARNING_ARGS' value: the render refuses a flag given twice with two values)."""
    pairs = zip(LEARNING_ARGS[::2], LEARNING_ARGS[1::2], strict=True)
    base = [x for flag, value in pairs if flag not in extra for x in (flag, value)]
    return runs.tiny_plan("qwen3_4b", workdir, *base, *extra, train_backend="fsdp", **options)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("qwen3")
    record = Path(os.environ.get(RECORD_DIR_ENV) or workdir / "record")
    plan = fsdp_plan(workdir)
    assert "--ci-test" in plan.train_args
    assert runs.launch(plan, record) == 0
    return workdir, plan, record


def test_tiny_qwen3_learns_the_synthetic_task(full_run):
    _, _, record = full_run
    reward = runs.series(record, "rollout/raw_reward")
    assert sorted(reward) == list(range(NUM_ROLLOUT))
    first = sum(reward[s] for s in range(3)) / 3
    last = sum(reward[s] for s in range(NUM_ROLLOUT - 3, NUM_ROLLOUT)) / 3
    assert last - first > 0.3, (
        f"no learning: mean reward {first:.3f} over the first 3 rollouts, {last:.3f} over the last 3"
    )


def test_every_standard_metric_is_recorded_every_rollout(full_run):
    from miles.metrics.capture import STANDARD_METRICS

    _, _, record = full_run
    for key in (*STANDARD_METRICS, "train/loss", "train/pg_clipfrac", "train/entropy", "perf/step_time"):
        assert sorted(runs.series(record, key)) == list(range(NUM_ROLLOUT)), key


def test_checkpoints_are_written_at_the_interval_and_the_end(full_run):
    _, plan, _ = full_run
    ckpt = runs.checkpoint_dir(plan)
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000012", "iter_0000016", "latest_checkpointed_iteration.txt",
    ]  # fmt: skip
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "16"


@pytest.mark.skipif(ON_GPU, reason="GPU kernels are not bitwise deterministic; resumed samples may diverge")
def test_resumed_run_continues_the_same_curve(full_run):
    workdir, _, record = full_run
    # The same recipe command (its --load is its --save), resumed from the mid-run checkpoint.
    plan = fsdp_plan(workdir, "--ckpt-step", str(SAVE_AT))
    assert runs.launch(plan, workdir / "record-resumed") == 0
    for key in ("rollout/raw_reward", "train/grad_norm", "train/ppo_kl", "train/loss"):
        resumed = runs.series(workdir / "record-resumed", key)
        original = runs.series(record, key)
        assert sorted(resumed) == list(range(SAVE_AT, NUM_ROLLOUT)), key
        for step, value in resumed.items():
            assert value == pytest.approx(original[step], rel=1e-5, abs=1e-7), f"{key} at rollout {step}"


def test_ci_check_catches_a_rollout_engine_left_with_stale_weights(full_run, capsys, monkeypatch):
    from miles.train.trainer import main

    monkeypatch.delenv(RECORD_DIR_ENV, raising=False)  # this short run is not the gated one
    workdir, _, _ = full_run
    plan = fsdp_plan(
        workdir,
        "--num-rollout",
        "2",
        "--update-weights-interval",
        "2",
        run_id="stale",
    )
    # In this process, as a world of one. Syncing every 2nd rollout leaves the engine one
    # update behind at rollout 1.
    assert main(list(plan.train_args)) == 1
    assert "CheckFailed: rollout 1: train/train_rollout_logprob_abs_diff" in capsys.readouterr().err


def test_evaluation_scores_held_out_prompts_and_the_metric_checker_reads_them(
    full_run, tmp_path, monkeypatch, capsys
):
    import json

    from miles.train.trainer import main

    workdir, _, _ = full_run
    eval_file = tmp_path / "held_out.jsonl"
    eval_file.write_text(
        "".join(json.dumps({"prompt": f"code {i:04d}:", "label": "7777"}) + "\n" for i in range(5))
    )
    monkeypatch.setenv(RECORD_DIR_ENV, str(tmp_path / "record"))
    plan = fsdp_plan(
        workdir, "--num-rollout", "4", "--eval-prompt-data", "held_out", str(eval_file),
        "--eval-interval", "2", "--eval-temperature", "0", "--n-samples-per-eval-prompt", "2",
        "--ci-metric-checker-key", "eval/held_out", "--ci-metric-checker-threshold", "1.5", run_id="eval",
    )  # fmt: skip
    assert main(list(plan.train_args)) == 1  # a reward never reaches 1.5
    scores = runs.series(tmp_path / "record", "eval/held_out")
    # scored before the first rollout (at its step), then after every 2nd
    assert sorted(scores) == [0, 1, 3] and all(0.0 <= v <= 1.0 for v in scores.values())
    assert (
        f"eval/held_out = {scores[3]:.4g} at rollout 3, below --ci-metric-checker-threshold 1.5"
        in capsys.readouterr().err
    )
