"""A rollout's first minibatch takes its old logprobs from its own training forward, and the old-
logprob and training passes see the same micro-batches.

One rank trains a tiny random Qwen3 (fp32, FSDP backend, the built-in sampler) in this
process, on prompts of different lengths whose responses stop at random. With --lr 0 the
weights stay put, so the two-pass path (the trainer's separate old-logprob forward, then the
step) and `learn`, which skips that forward for the first minibatch, can be compared on the
same weights: same loss, same gradients, and the same trainer/rollout logprob gap, which
still compares the trainer's logprobs with the rollout engine's.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")

STOP_TOKENS = [str(t) for t in range(100, 140)]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from miles.train.args import parse_config
    from miles.train.distributed import shutdown
    from miles.train.runtime import build_run
    from tests.support.ckpt import tiny_hf

    root = tmp_path_factory.mktemp("old-logprobs")
    hf = tiny_hf("qwen3", 2)
    rng = random.Random(1)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(8):
            words = " ".join(f"code {rng.randint(0, 9999):04d}" for _ in range(rng.randint(1, 6)))
            f.write(json.dumps({"prompt": words + ":", "label": "42"}) + "\n")
    argv = [
        "--hf-checkpoint", str(hf), "--prompt-data", str(prompts), "--rm-type", "synthetic", "--rollout-engine",
        "torch", "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "8", "--micro-batch-size", "3", "--rollout-max-response-len", "8",
        "--rollout-stop-token-ids", *STOP_TOKENS, "--lr", "0", "--seed", "0", "--ci-test",
    ]  # fmt: skip
    run = build_run(parse_config(argv))
    yield run
    shutdown()


def _grads(run) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in run.backend.model.named_parameters() if p.grad is not None}


def test_the_first_minibatch_trains_as_with_a_separate_old_logprob_forward(run):
    from miles.train import trainer

    assert run.backend.forward_is_deterministic  # a tiny Qwen3 has no dropout
    samples = trainer.with_advantages(run, trainer.generate_and_score(run, 0))
    assert len({len(s.generation.response_ids) for s in samples}) > 1

    # two passes: the old-logprob forward over the first minibatch's micro-batches, then the step
    local, plan = trainer.share_of_rank(run, samples)
    scored, trainer_logp = trainer.with_old_logprobs(run, local, plan)
    two_pass, _ = trainer.optimizer_step(run, [scored.rows(rows) for rows in plan[0]])
    two_pass_grads = _grads(run)
    gap = trainer.rollout_mismatch(run, local, trainer_logp)

    # learn: the first minibatch's old logprobs are its training forward's own (the last step
    # is the second minibatch's, so take the first one's gradients from a learn of it alone)
    metrics = trainer.learn(run, 0, samples[:8])
    assert metrics["train/grad_norm"] == pytest.approx(two_pass["grad_norm"], rel=1e-6)
    assert metrics["train/loss"] == pytest.approx(two_pass["loss"], rel=1e-6, abs=1e-9)
    for name, grad in _grads(run).items():
        torch.testing.assert_close(grad, two_pass_grads[name], rtol=1e-5, atol=1e-8, msg=name)
    reused = trainer.learn(run, 0, samples)
    # the trainer/rollout gap of the whole rollout: the first minibatch's logprobs from its
    # training forward, the second's from the old-logprob forward, the engine's on the other side
    assert reused["train/train_rollout_logprob_abs_diff"] == pytest.approx(
        gap["train/train_rollout_logprob_abs_diff"], rel=1e-4, abs=1e-9
    )
    assert 0 < gap["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert reused["train/train_rollout_kl"] == pytest.approx(
        gap["train/train_rollout_kl"], rel=1e-3, abs=1e-9
    )


def test_the_old_logprob_and_training_passes_see_the_same_micro_batches(run):
    from miles.train import trainer

    samples = trainer.with_advantages(run, trainer.generate_and_score(run, 0))
    seen: list[torch.Tensor] = []
    hook = run.backend.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    try:
        trainer.learn(run, 0, samples)  # --ci-test scores the first minibatch too
    finally:
        hook.remove()
    _, plan = trainer.share_of_rank(run, samples)
    counts = [len(micro) for micro in plan]
    assert counts == [3, 3] and len(seen) == 2 * sum(counts)  # 8 rows per minibatch, 3 per micro-batch
    scoring, training = seen[: sum(counts)], seen[sum(counts) :]
    for old, new in zip(scoring, training, strict=True):
        assert old.shape == new.shape and torch.equal(old, new)
    widths = [int(t.shape[1]) for t in training]
    assert len(set(widths)) > 1  # each padded to its own widest row, not the rollout's
