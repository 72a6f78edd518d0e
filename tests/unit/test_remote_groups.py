"""Engine groups from --sglang-config (miles.train.remote.groups, plan): the seed framework's
files parse into the engines a run starts, bad files are one line, and the check that a rollout
lost no request and counted none twice."""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.args import parse_config
from miles.train.batch import Sample
from miles.train.checks import CheckFailed, check_rollout_complete
from miles.train.remote.plan import plan_engines
from miles.train.rollout import Generation, RolloutEngineError

register_cpu_ci(est_time=1, suite="stage-a-cpu")

# radixark/miles 31f1ca961 tests/e2e/sglang_config/test_sglang_config.py and _mixed_offload.py
TWO_GROUPS = """
sglang:
  - name: default
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
"""
ACTOR_AND_REF = """
sglang:
  - name: actor
    update_weights: true
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
  - name: ref
    update_weights: false
    server_groups:
      - worker_type: regular
        num_gpus: 4
        num_gpus_per_engine: 1
"""


def _plan(tmp_path, text: str, *flags: str):
    path = tmp_path / "sglang.yaml"
    path.write_text(text)
    config = parse_config(["--hf-checkpoint", "m", "--sglang-config", str(path), *flags])
    return plan_engines(config.engines, config.job, config.sglang, "m")


def test_two_groups_of_one_model_make_eight_rollout_engines(tmp_path):
    specs = _plan(tmp_path, TWO_GROUPS, "--rollout-num-gpus", "8")
    assert [s.name for s in specs] == [f"default-{i}" for i in range(8)]
    assert all(s.updatable and s.rollout for s in specs)
    assert [s.first_device for s in specs] == list(range(8))


def test_a_frozen_model_gets_engines_that_neither_roll_out_nor_take_weights(tmp_path):
    specs = _plan(tmp_path, ACTOR_AND_REF, "--rollout-num-gpus", "8")
    actor, ref = specs[:4], specs[4:]
    assert all(s.model == "actor" and s.updatable and s.rollout for s in actor)
    assert all(s.model == "ref" and not s.updatable and not s.rollout for s in ref)
    assert [s.first_device for s in ref] == [4, 5, 6, 7]


@pytest.mark.parametrize(
    ("text", "flags", "message"),
    [
        (TWO_GROUPS, ("--rollout-num-gpus", "4"), "places engines on 8 device.*give --rollout-num-gpus 8"),
        (TWO_GROUPS.replace("regular", "prefill", 1), ("--rollout-num-gpus", "8"), "worker_type 'prefill'"),
        (TWO_GROUPS.replace("num_gpus_per_engine: 1", "num_gpus_per_engine: 3", 1), ("--rollout-num-gpus", "8"),
         "num_gpus 4 must be a positive multiple of num_gpus_per_engine 3"),
        (ACTOR_AND_REF.replace("update_weights: true", "update_weights: false"), ("--rollout-num-gpus", "8"),
         "no model gets the trainer's weights"),
        ("models: []", ("--rollout-num-gpus", "8"), "needs a top-level 'sglang' list"),
    ],
)  # fmt: skip
def test_a_bad_sglang_config_is_one_line_naming_the_file(tmp_path, text, flags, message):
    with pytest.raises(RolloutEngineError, match=message):
        _plan(tmp_path, text, *flags)


def _rollout(groups: int, size: int, drop: tuple[int, int] | None = None, twice: int | None = None):
    g = Generation((1,), (2,), (-0.1,), "stop")
    samples = [
        Sample(0, group, g, "", "", 0.0, execution=group * size + i)
        for group in range(groups)
        for i in range(size)
        if (group, i) != drop
    ]
    if twice is not None:
        samples.insert(twice + 1, samples[twice].__class__(**{**samples[twice].__dict__, "execution": -1}))
    return samples


def test_a_rollout_missing_a_request_or_holding_one_twice_fails_the_check():
    check_rollout_complete(3, _rollout(4, 2), 4, 2)
    with pytest.raises(
        CheckFailed, match=r"rollout 3: .*groups of another size \{1: 1\}.*lost or answered twice"
    ):
        check_rollout_complete(3, _rollout(4, 2, drop=(1, 0)), 4, 2)
    with pytest.raises(CheckFailed, match=r"groups of another size \{0: 3\}"):
        check_rollout_complete(3, _rollout(4, 2, twice=0), 4, 2)
