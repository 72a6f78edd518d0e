"""A non-finite loss or grad norm skips the optimizer step; a streak of them stops the run."""

from __future__ import annotations

import math

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.guards import NonFiniteTraining, SkippedStreak, step_if_finite

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def optimizer_with_grad(value: float):
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([param], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    param.grad = torch.full((3,), value)
    return param, opt, sched


def test_a_finite_step_is_applied_and_the_schedule_advances():
    param, opt, sched = optimizer_with_grad(0.5)
    assert step_if_finite(opt, sched, loss=1.0, grad_norm=0.87) is False
    assert not torch.equal(param.detach(), torch.ones(3)) and sched.last_epoch == 1


@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (1.0, math.inf), (-math.inf, math.nan)])
def test_a_non_finite_step_leaves_weights_optimizer_and_schedule_untouched(loss, grad_norm):
    param, opt, sched = optimizer_with_grad(math.nan)
    assert step_if_finite(opt, sched, loss=loss, grad_norm=grad_norm) is True
    assert torch.equal(param.detach(), torch.ones(3)) and param.grad is None
    assert sched.last_epoch == 0 and not opt.state


def test_the_streak_stops_the_run_at_the_limit_naming_rollout_metric_and_cause():
    streak = SkippedStreak(limit=3)
    streak.record(4, True, math.nan, math.nan, 1e4)
    streak.record(4, False, 0.1, 0.2, 1e4)  # a good step resets it
    streak.record(5, True, math.nan, math.nan, 1e4)
    streak.record(5, True, math.nan, math.nan, 1e4)
    with pytest.raises(NonFiniteTraining) as err:
        streak.record(6, True, math.nan, math.nan, 1e4)
    message = str(err.value)
    assert message.startswith("rollout 6: train/loss = nan on 3 optimizer steps in a row, each skipped")
    assert "lower --lr" in message and "\n" not in message


def test_a_finite_loss_with_overflowing_gradients_names_the_grad_norm():
    streak = SkippedStreak(limit=1)
    with pytest.raises(NonFiniteTraining, match=r"rollout 0: train/grad_norm = inf .* gradients overflow"):
        streak.record(0, True, 2.5, math.inf, 1e-2)


def test_a_limit_of_zero_never_stops():
    streak = SkippedStreak(limit=0)
    for _ in range(10):
        streak.record(0, True, math.nan, math.nan, 1.0)
    assert streak.count == 10  # every skipped step counted, none stopped the run
