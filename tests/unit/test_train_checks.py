"""The --ci-test checks and the checkpoint markers fail loudly, naming what broke."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from miles.ci.register import register_cpu_ci
from miles.train import checkpoint
from miles.train.backends.torch_dp import lr_factor
from miles.train.checks import (
    CheckFailed,
    check_first_step,
    check_logprob_agreement,
    check_metric_threshold,
    check_weights_equal,
)

register_cpu_ci(est_time=2, suite="stage-a-cpu")


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
    from miles.train.args import parse_config

    config = parse_config(
        "--hf-checkpoint m --seed 1 --rollout-batch-size 8 --n-samples-per-prompt 8 --load x".split()
    )
    with pytest.raises(checkpoint.CheckpointError, match="--load x: .*--rollout-batch-size 4 -> 8"):
        checkpoint.check_compatible(_state(2), config)


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


def test_a_non_finite_logprob_gap_is_reported_as_divergence_not_as_a_sync_mismatch():
    with pytest.raises(
        CheckFailed, match="not finite, so the weights diverged .* not a weight-sync mismatch"
    ):
        check_logprob_agreement(2, float("nan"), 1e-3)


def test_non_finite_trainer_weights_are_named_as_divergence():
    import torch

    trainer = {"w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(CheckFailed, match="trainer's weight w is not finite: training diverged"):
        check_weights_equal(1, [("w", torch.tensor([1.0, 2.0]))], trainer)


class FullForwardScorer:
    """The trainer's side of the logprob weight check: one full forward per batch."""

    def __init__(self, model, temperature):
        self.model, self.temperature = model, temperature

    @contextlib.contextmanager
    def scoring_temperature(self, temperature):
        saved, self.temperature = self.temperature, temperature
        yield
        self.temperature = saved

    def logprobs(self, batch):
        import torch

        from miles.train.algorithm import token_logprobs_and_entropy

        with torch.no_grad():
            logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        logp, _ = token_logprobs_and_entropy(logits[:, :-1], batch.input_ids[:, 1:], self.temperature)
        return logp * batch.loss_mask


def test_the_logprob_weight_check_passes_a_synced_engine_and_catches_a_stale_one():
    import copy

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles.train.checks import check_probe_logprobs, probe_logprob_gap
    from miles.train.config import SamplingConfig
    from miles.train.rollout import TorchRolloutEngine

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )  # fmt: skip
    trainer_model = Qwen3ForCausalLM(config).eval()
    engine = TorchRolloutEngine(copy.deepcopy(trainer_model))
    sampling = SamplingConfig(temperature=0.8, top_p=1.0, top_k=-1, max_response_len=6)
    prompts = [[3, 4, 5], [9, 10], [11], [12, 13, 14, 15]]
    scorer = FullForwardScorer(trainer_model, 0.8)
    check_probe_logprobs(0, probe_logprob_gap(engine, scorer, prompts, sampling), 1e-4)
    with torch.no_grad():  # the trainer steps; the engine is not told
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    with pytest.raises(CheckFailed, match="did not load the trainer's weights"):
        check_probe_logprobs(1, probe_logprob_gap(engine, scorer, prompts, sampling), 1e-4)


def test_load_equal_to_save_starts_fresh_when_missing_or_empty(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "interrupted" / "iter_0000004.tmp").mkdir(parents=True)  # killed during the first save
    accepted = [
        (tmp_path / "new" / "ckpt", tmp_path / "new" / "ckpt"),
        (tmp_path / "empty", None),
        (tmp_path / "interrupted", None),
    ]
    for load, save in accepted:
        assert checkpoint.check_load_dir(load, save) is None, load  # it raises on a load it refuses
    assert not (tmp_path / "new").exists()  # a fresh start creates nothing before the first save


def test_a_load_elsewhere_that_does_not_exist_is_refused(tmp_path):
    with pytest.raises(
        checkpoint.CheckpointError, match="no such directory, and it is not the --save directory"
    ):
        checkpoint.check_load_dir(tmp_path / "ckpts", tmp_path / "ckpt")


def test_a_load_that_is_a_file_or_holds_other_files_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(checkpoint.CheckpointError, match="not a directory"):
        checkpoint.check_load_dir(tmp_path / "f", None)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.txt").write_text("x")
    with pytest.raises(
        checkpoint.CheckpointError, match="not a checkpoint directory; it holds notes.txt but no"
    ):
        checkpoint.check_load_dir(tmp_path / "d", None)


class SGLangGreedy:
    """The torch engine with SGLang's greedy rule, which needs a GPU to run for real: a request
    with top_k <= 1 is greedy (sglang 0.5.23 sampling_batch_info.py: is_all_greedy) and its
    logprobs are log_softmax of the untempered logits (sampler.py, Sampler.forward). The rule
    itself is read from the installed sglang in the test below."""

    def __init__(self, model):
        from miles.train.rollout import TorchRolloutEngine

        self.inner = TorchRolloutEngine(model)

    def generate(self, prompts, sampling, seed):
        from dataclasses import replace

        if sampling.top_k <= 1:
            sampling = replace(sampling, temperature=1.0)
        return self.inner.generate(prompts, sampling, seed)


def test_sglang_returns_untempered_logprobs_for_greedy_requests():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        pytest.skip("sglang is not installed (requirements/cpu-sglang.txt)")
    root = Path(spec.origin).parent / "srt"
    assert (
        "is_all_greedy=all(r.sampling_params.top_k <= 1 for r in reqs)"
        in (root / "sampling/sampling_batch_info.py").read_text()
    )
    sampler = (root / "layers/sampler.py").read_text()
    greedy = sampler[sampler.index("if sampling_info.is_all_greedy:\n") :][:800]
    assert "torch.nn.functional.log_softmax(\n                    logits, dim=-1" in greedy


def test_the_logprob_weight_probe_agrees_with_a_greedy_engine_at_any_rollout_temperature(tmp_path):
    import torch

    from miles.train.args import parse_config
    from miles.train.backends import make_backend
    from miles.train.checks import probe_logprob_gap
    from miles.train.distributed import DistInfo
    from miles.train.model import load_causal_lm
    from tests.support.ckpt import tiny_hf

    path = tiny_hf("qwen3", 2, dtype="float32")
    config = parse_config(["--hf-checkpoint", str(path), "--rollout-temperature", "0.7"])
    backend = make_backend(config, DistInfo(0, 1, 0, "cpu", "gloo"))
    engine = SGLangGreedy(load_causal_lm(path, dtype=torch.float32, device="cpu"))
    prompts = [[5, 6, 7], [40, 41], [9]]
    gap = probe_logprob_gap(engine, backend, prompts, config.rollout.sampling_config())
    assert gap < 1e-5
    assert backend.loss_cfg.temperature == 0.7  # scoring at 1 lasts only for the probe
