"""Fully asynchronous rollouts: the buffer's staleness bound and what happens to groups it does
not train (miles.train.async_rollout), the prompt order the worker draws, the flags' rules, and
the loss of a deliberately stale batch, which must weigh each token by the behaviour policy's
logprobs (the truncated importance ratio, --use-tis)."""

from __future__ import annotations

import threading

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.args import parse_config
from miles.train.async_rollout import DataBuffer, Group, PromptStream
from miles.train.data import batch_for_rollout, synthetic_prompts

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def _group(order: int, oldest: int, *, aborted: bool = False) -> Group:
    return Group(order, synthetic_prompts("fixed", 1)[0], [], oldest, aborted)


def test_the_buffer_trains_groups_within_the_bound_and_hands_the_rest_back():
    unused: list[int] = []
    buffer = DataBuffer(capacity=8, max_staleness=1, unused=lambda g: unused.append(g.order))
    for order, oldest in enumerate([3, 1, 2, 3]):
        buffer.put(_group(order, oldest))
    buffer.put(_group(4, 3, aborted=True))
    taken = [buffer.get(current_version=3, timeout=1).order for _ in range(3)]
    assert taken == [0, 2, 3]  # group 1 (made by version 1, 2 behind) was handed back
    assert unused == [4, 1]  # the aborted one on arrival, the stale one when taken
    metrics = buffer.metrics()
    assert metrics["rollout/fully_async/max_staleness"] == 2.0  # what was taken, the stale one included
    assert metrics["rollout/fully_async/trained_max_staleness"] == 1.0  # what was handed to training
    assert metrics["rollout/fully_async/stale_groups_filtered"] == 1.0
    assert metrics["rollout/fully_async/aborted_groups_filtered"] == 1.0
    assert buffer.metrics()["rollout/fully_async/stale_groups_filtered"] == 0.0  # counters reset per step


def test_a_full_buffer_holds_the_producer_until_the_trainer_takes_a_group():
    buffer = DataBuffer(capacity=2, max_staleness=None, unused=lambda g: None)
    stop = threading.Event()
    assert buffer.room(5, stop) == 2
    buffer.put(_group(0, 0))
    buffer.put(_group(1, 0))
    answer: list[int] = []
    producer = threading.Thread(target=lambda: answer.append(buffer.room(5, stop)))
    producer.start()
    producer.join(timeout=0.5)
    assert producer.is_alive() and not answer  # no room: the producer waits
    buffer.get(current_version=0, timeout=1)
    producer.join(timeout=30)
    assert answer == [1]


def test_the_worker_draws_the_synchronous_order_and_recycled_prompts_first():
    prompts = synthetic_prompts("fixed", 10)
    stream = PromptStream(prompts, 4, seed=5, shuffle=True)
    drawn = [stream.next() for _ in range(6)]
    expected = (
        batch_for_rollout(prompts, 0, 4, seed=5, shuffle=True)
        + batch_for_rollout(prompts, 1, 4, seed=5, shuffle=True)[:2]
    )
    assert [p for _, p in drawn] == expected
    stream.give_back(*drawn[1])
    assert stream.next() == drawn[1]
    assert stream.next()[1] == batch_for_rollout(prompts, 1, 4, seed=5, shuffle=True)[2]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--fully-async",), "--fully-async needs engines on devices of their own"),
        (("--fully-async", "--rollout-num-gpus", "1", "--colocate"), "needs engines on devices of their own"),
        (("--max-weight-staleness", "1"), "--max-weight-staleness set the fully asynchronous rollout"),
        (
            ("--fully-async", "--rollout-num-gpus", "1", "--pause-generation-mode", "abort"),
            "cannot use --pause-generation-mode abort",
        ),
    ],
)
def test_fully_async_flags_out_of_place_are_one_line(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_config(["--hf-checkpoint", "m", *flags])
    assert message in capsys.readouterr().err


def test_fully_async_with_its_engines_parses():
    config = parse_config(
        ["--hf-checkpoint", "m", "--fully-async", "--rollout-num-gpus", "1", "--max-weight-staleness", "2"]
    )
    assert config.engines.fully_async and config.engines.max_weight_staleness == 2


# --- a deliberately stale batch ---


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.train.distributed import shutdown
    from miles.train.runtime import build_run

    hf = make_tiny_checkpoint("qwen3", 2, tmp_path_factory.mktemp("stale") / "hf", progress=False)
    argv = [
        "--hf-checkpoint", str(hf), "--prompt-data", "synthetic:fixed", "--rm-type", "synthetic",
        "--rollout-engine", "torch", "--num-rollout", "1", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--rollout-max-response-len", "6",
        "--lr", "0", "--seed", "0", "--use-tis", "--tis-clip", "1.5",
    ]  # fmt: skip
    run = build_run(parse_config(argv))
    yield run
    shutdown()


def _expected(run, samples) -> tuple[float, float]:
    """The stale batch's loss and mean TIS weight, computed here from the trainer's and the
    behaviour policy's logprobs (one step, lr 0: old = current policy, ratio 1)."""
    from miles.train.batch import collate
    from miles.train.trainer import with_advantages

    batch = collate(with_advantages(run, samples))
    mask = batch.loss_mask
    trainer_logp = run.backend.logprobs(batch)
    weights = torch.exp(trainer_logp - batch.rollout_logp).clamp(0.0, 1.5)  # --tis-clip-low 0, --tis-clip 1.5
    per_token = -batch.advantages.unsqueeze(1) * weights
    per_sample = (per_token * mask).sum(1) / mask.sum(1)
    return float(per_sample.sum() / len(samples)), float((weights * mask).sum() / mask.sum())


def test_a_stale_batch_is_trained_with_the_behaviour_policys_logprobs(run):
    from miles.train import trainer

    fresh = trainer.learn(run, 0, trainer.generate_and_score(run, 0))
    assert fresh["train/tis_weight"] == pytest.approx(1.0, abs=1e-5)  # same weights: nothing to correct

    # the behaviour policy: the engine holds older (here: shifted) weights than the trainer's
    g = torch.Generator().manual_seed(0)
    moved = {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in run.engine.named_weights()}
    run.engine.update_weights(moved.items())
    samples = trainer.with_advantages(run, trainer.generate_and_score(run, 0))
    loss, tis = _expected(run, samples)
    stale = trainer.learn(run, 0, samples)
    assert abs(tis - 1.0) > 1e-2  # the batch is off-policy
    assert stale["train/tis_weight"] == pytest.approx(tis, rel=1e-5)
    assert stale["train/loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert stale["train/train_rollout_logprob_abs_diff"] > 1e-2
