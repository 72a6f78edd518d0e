"""The --ci-test checks and the checkpoint markers fail loudly, naming what broke."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles.train import checkpoint
from miles.train.backends.torch_dp import lr_factor
from miles.train.checks import CheckFailed, check_first_step, check_logprob_agreement, check_metric_threshold


def test_first_step_kl_above_tolerance_fails_with_the_value():
    check_first_step(0, 1e-9, 0.0, 1e-6)
    with pytest.raises(CheckFailed, match=r"rollout 3: train/ppo_kl = 0.002 on the first step"):
        check_first_step(3, 2e-3, 0.0, 1e-6)


def test_first_step_clipping_fails():
    with pytest.raises(CheckFailed, match="pg_clipfrac = 0.1"):
        check_first_step(0, 0.0, 0.1, 1e-6)


def test_logprob_disagreement_fails_and_nan_never_passes():
    check_logprob_agreement(0, 1e-4, 1e-3)
    with pytest.raises(CheckFailed, match="logprob_abs_diff = 0.5 > 0.001"):
        check_logprob_agreement(1, 0.5, 1e-3)
    with pytest.raises(CheckFailed):
        check_logprob_agreement(1, float("nan"), 1e-3)


def _state(done: int) -> checkpoint.TrainerState:
    return checkpoint.TrainerState(done, "m", 1, 4, 8, "synthetic:fixed", True)


def test_no_marker_means_no_checkpoint(tmp_path):
    assert checkpoint.latest_iteration(tmp_path) is None
    assert checkpoint.read_state(tmp_path) is None


def test_marker_naming_an_incomplete_iteration_is_an_error(tmp_path):
    (tmp_path / checkpoint.MARKER).write_text("5\n")
    (tmp_path / "iter_0000005").mkdir()
    with pytest.raises(
        checkpoint.CheckpointError, match="names iteration 5, but .*iter_0000005 is incomplete"
    ):
        checkpoint.latest_iteration(tmp_path)


def test_save_writes_state_then_marker_and_leaves_no_temporary(tmp_path):
    saved = []
    backend = SimpleNamespace(save=lambda d, with_optimizer: saved.append(d))
    path = checkpoint.save(backend, tmp_path, _state(4), is_main=True, barrier=lambda: None)
    assert saved == [str(tmp_path / "iter_0000004.tmp")]
    assert path == tmp_path / "iter_0000004" and checkpoint.latest_iteration(tmp_path) == 4
    assert checkpoint.read_state(tmp_path) == _state(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", checkpoint.MARKER]


def test_resuming_with_other_batch_flags_is_refused():
    args = SimpleNamespace(
        seed=1, rollout_batch_size=8, n_samples_per_prompt=8, prompt_data="synthetic:fixed", load="x"
    )
    with pytest.raises(checkpoint.CheckpointError, match="--rollout-batch-size 4 -> 8"):
        checkpoint.check_compatible(_state(2), args)


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = SimpleNamespace(lr=1.0, min_lr=0.1, lr_decay_style="linear", lr_warmup_iters=2, lr_decay_iters=None)
    assert [round(lr_factor(s, cfg, 6), 3) for s in range(7)] == [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1]


def test_metric_checker_reads_the_last_value_and_needs_one():
    check_metric_threshold("eval/gsm8k", {0: 0.1, 5: 0.8}, 0.7)
    with pytest.raises(
        CheckFailed, match="eval/gsm8k = 0.6 at rollout 5, below --ci-metric-checker-threshold 0.7"
    ):
        check_metric_threshold("eval/gsm8k", {0: 0.9, 5: 0.6}, 0.7)
    with pytest.raises(CheckFailed, match="never logged it"):
        check_metric_threshold("eval/gsm8k", {}, 0.7)


def test_a_run_stopped_by_bad_input_prints_one_line_naming_it_and_exits_1(tmp_path, capsys):
    from miles.train.trainer import main

    assert main(["--hf-checkpoint", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"miles.train: ModelLoadError: {tmp_path / 'nowhere'}: no config.json; --hf-checkpoint must be a "
        "Hugging Face model directory (e.g. one made by `invoke make-tiny-ckpt` or `invoke prepare-ckpt`)"
    ]
