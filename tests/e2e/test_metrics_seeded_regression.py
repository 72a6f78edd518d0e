"""The metric gate catches a seeded regression and trusts unchanged reruns.

A five-run nightly baseline of a real (small) GRPO training on CPU, then PR-style runs
gated against it; see metrics_seeded_regression.py for the protocol and the trainer.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.metrics.gate import INACTIVE
from tests.e2e import metrics_seeded_regression as protocol

register_cpu_ci(est_time=3, suite="stage-b-cpu")


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict:
    workdir = tmp_path_factory.mktemp("seeded")
    found = protocol.run_protocol(protocol.toy_trainer(), workdir, f"sqlite:///{workdir / 'history.sqlite'}")
    print("\n" + protocol.format_table(found))  # the numbers, with pytest -s
    return {row.case.name: row for row in found}


def test_the_baseline_runs_are_stored_as_trusted_cold_start_history(rows):
    baseline = [row for row in rows.values() if row.case.baseline]
    assert len(baseline) == 5
    for row in baseline:
        assert row.outcome.trusted is True and row.outcome.baseline_run_id is not None
        assert {v.status for v in row.outcome.verdicts} == {INACTIVE}


def test_learning_rate_x100_is_not_trusted(rows):
    row = rows["lr x100"]
    assert row.outcome.trusted is False
    assert "train/grad_norm" in row.failing  # the policy saturates and its gradient vanishes


def test_rollout_temperature_1_5_is_not_trusted(rows):
    row = rows["temperature 1.5"]
    assert row.outcome.trusted is False
    assert "train/train_rollout_logprob_abs_diff" in row.failing  # rollout and trainer disagree


@pytest.mark.parametrize("name", ["rerun seed 5", "rerun seed 6", "rerun seed 7"])
def test_an_unchanged_rerun_stays_trusted(rows, name):
    row = rows[name]
    assert row.outcome.trusted is True, row.outcome.verdict_line
    assert not row.failing
