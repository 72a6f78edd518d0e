"""PPO with a critic on the CPU lane's tiny Qwen3: the value loss falls and the explained variance rises.

`--advantage-estimator ppo` trains a critic beside the policy (its own model: the policy's network
with a value head; its own optimizer, --critic-lr and checkpoint): GAE with --gamma 0.5 gives each
response token the discounted return still to come, so a critic that learns how far a token is from
the reward explains part of the returns' variance. For the first 8 rollouts only the critic trains
(--num-critic-only-steps): the policy is fixed, and the critic's value loss must fall and its
explained variance (of the values it held before each rollout's steps) rise from exactly 0 (its
head starts at zero); then the policy trains too, on whitened per-token advantages
(--normalize-advantages). Each backend runs it on two gloo ranks (FSDP: data parallel; Megatron:
TP=2 with SP); a run resumed from the mid-run checkpoint (the critic's model and optimizer under
critic/) continues the same value curve.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=20, suite="stage-b-cpu")


NUM_ROLLOUT, CRITIC_ONLY, SAVE_AT = 10, 8, 6
PPO = (
    "--advantage-estimator", "ppo", "--critic-lr", "1e-3", "--num-critic-only-steps", str(CRITIC_ONLY),
    "--normalize-advantages", "--gamma", "0.5", "--num-rollout", str(NUM_ROLLOUT), "--save-interval", str(SAVE_AT),
    "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "6",
    "--global-batch-size", "4", "--micro-batch-size", "4", "--lr", "5e-3", "--weight-decay", "0",
)  # fmt: skip
VALUE_KEYS = ("train/value_loss", "train/explained_variance", "train/critic_grad_norm")


def _mean(series: dict[int, float], steps) -> float:
    return sum(series[s] for s in steps) / len(steps)


@pytest.fixture(scope="module", params=["fsdp", "megatron"])
def ppo_run(request, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(f"ppo-{request.param}")
    plan = runs.tiny_plan("qwen3_4b", workdir, *PPO, train_backend=request.param)
    record = workdir / "record"
    assert runs.launch(plan, record) == 0
    return request.param, workdir, record


def test_the_critics_value_loss_falls_and_explained_variance_rises(ppo_run):
    _, _, record = ppo_run
    loss = runs.series(record, "train/value_loss")
    explained = runs.series(record, "train/explained_variance")
    assert sorted(loss) == sorted(explained) == list(range(NUM_ROLLOUT))
    assert explained[0] == 0.0  # the head starts at zero: no variance explained
    first, last = range(2), range(NUM_ROLLOUT - 3, NUM_ROLLOUT)
    print(
        f"train/value_loss {_mean(loss, first):.4f} -> {_mean(loss, last):.4f}, train/explained_variance "
        f"{_mean(explained, first):.3f} -> {_mean(explained, last):.3f} (first 2 -> last 3 rollouts)"
    )
    assert _mean(loss, last) < 0.7 * _mean(loss, first), loss
    assert _mean(explained, last) > _mean(explained, first) + 0.08, explained


def test_only_the_critic_trains_during_its_warm_up(ppo_run):
    _, _, record = ppo_run
    assert sorted(runs.series(record, "train/grad_norm")) == list(range(CRITIC_ONLY, NUM_ROLLOUT))
    assert sorted(runs.series(record, "train/critic_grad_norm")) == list(range(NUM_ROLLOUT))


def test_a_resumed_run_restores_the_critic(ppo_run):
    backend, workdir, record = ppo_run
    if backend != "fsdp":
        pytest.skip("the resume is checked once, on the FSDP run")
    plan = runs.tiny_plan("qwen3_4b", workdir, *PPO, "--ckpt-step", str(SAVE_AT), train_backend=backend)
    assert (runs.checkpoint_dir(plan) / f"iter_{SAVE_AT:07d}" / "critic").is_dir()
    assert runs.launch(plan, workdir / "record-resumed") == 0
    for key in VALUE_KEYS:
        resumed, original = runs.series(workdir / "record-resumed", key), runs.series(record, key)
        assert sorted(resumed) == list(range(SAVE_AT, NUM_ROLLOUT)), key
        for step, value in resumed.items():
            assert value == pytest.approx(original[step], rel=1e-5, abs=1e-7), f"{key} at rollout {step}"
