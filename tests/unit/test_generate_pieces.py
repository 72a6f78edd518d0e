"""Custom generate functions (miles.train.generate): an execution split into several training
samples (the seed's compact rollout) shares its reward and advantage, stays in one optimizer
step, trains each piece on its own tokens and counts once in the loss.

The CPU twin of the seed's tests/e2e/short/test_qwen2.5_0.5B_compact_rollout.py: one rank of a
tiny Qwen3 (FSDP backend, built-in engine) in this process, with the seed's compact split
(miles.train.generate_hub.compact_split)."""

from __future__ import annotations

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.batch import Sample, collate, executions
from miles.train.rollout import Generation

register_cpu_ci(est_time=2, suite="stage-a-cpu")

SPLIT = "miles.train.generate_hub.compact_split"


def _sample(execution, siblings=1, mask=None, response=(7, 8, 9)):
    g = Generation((1, 2), tuple(response), (-0.5,) * len(response), "stop")
    return Sample(0, 0, g, "", "", 1.0, execution=execution, siblings=siblings, loss_mask=mask)


def test_samples_group_by_execution_and_collate_their_masks_and_weights():
    samples = [_sample(0, 2, (1, 0, 0)), _sample(0, 2, (0, 1, 1)), _sample(1), _sample(None), _sample(None)]
    assert executions(samples) == [[0, 1], [2], [3], [4]]
    batch = collate(samples)
    assert batch.loss_mask[0].tolist() == [0.0, 1.0, 0.0, 0.0] and batch.loss_mask[1].tolist() == [
        0.0,
        0.0,
        1.0,
        1.0,
    ]
    assert batch.weights.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0]
    assert batch.rollout_logp[0].tolist() == [0.0, -0.5, 0.0, 0.0]  # untrained tokens carry nothing


def test_a_bad_generate_function_path_is_one_line(tmp_path):
    from miles.train.generate import GenerateFunctionError, load_generate

    with pytest.raises(
        GenerateFunctionError, match="--custom-generate-function-path no.such:fn: cannot import it"
    ):
        load_generate("no.such:fn")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.train.args import parse_config
    from miles.train.distributed import shutdown
    from miles.train.runtime import build_run

    hf = make_tiny_checkpoint("qwen3", 2, tmp_path_factory.mktemp("compact") / "hf", progress=False)
    argv = [
        "--hf-checkpoint", str(hf), "--prompt-data", "synthetic:fixed", "--rm-type", "synthetic",
        "--rollout-engine", "torch", "--num-rollout", "1", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--rollout-max-response-len", "6",
        "--lr", "0", "--seed", "0", "--custom-generate-function-path", SPLIT,
    ]  # fmt: skip
    run = build_run(parse_config(argv))
    yield run
    shutdown()


def test_a_split_execution_shares_its_reward_and_advantage_and_stays_in_one_step(run):
    from miles.train import trainer

    samples = trainer.with_advantages(run, trainer.generate_and_score(run, 0))
    by_execution = executions(samples)
    assert len(by_execution) == 16 and all(len(e) == 2 for e in by_execution)  # 6-token responses split
    for first, second in by_execution:
        a, b = samples[first], samples[second]
        assert (a.reward, a.advantage, a.siblings) == (b.reward, b.advantage, 2)
        cut = len(a.generation.response_ids)
        assert b.generation.response_ids[:cut] == a.generation.response_ids
        assert b.loss_mask == (0,) * cut + (1,) * (len(b.generation.response_ids) - cut)
    _, plan = trainer.share_of_rank(run, samples)
    assert len(plan) == 2  # --global-batch-size counts executions: 16 / 8
    step_rows = [sorted(r for micro in step for r in micro) for step in plan]
    assert step_rows == [list(range(16)), list(range(16, 32))]  # both pieces of each execution in one step


def test_a_split_execution_counts_once_in_the_loss(run):
    from miles.train import trainer

    samples = trainer.with_advantages(run, trainer.generate_and_score(run, 0))[:16]  # the first step's
    batch = collate(samples)
    logp = run.backend.logprobs(batch)
    mask = batch.loss_mask
    # lr 0, first step: ratio 1, so each sample's loss is -advantage over its own trained tokens,
    # weighed 1/2, and the step's mean is over the 8 executions
    per_sample = (-batch.advantages.unsqueeze(1) * torch.exp(logp - logp) * mask).sum(1) / mask.sum(1)
    expected = float((per_sample * 0.5).sum() / 8)
    metrics = trainer.learn(run, 0, samples)
    assert metrics["train/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-8)
