"""Non-finite guards shared by every training backend and the trainer.

A backend never applies an optimizer step whose loss or gradient norm is not finite: it
calls `step_if_finite`, which decides on every rank together (one rank's NaN makes every
rank skip, so data-parallel replicas stay identical) and leaves weights, optimizer state and
lr schedule untouched. The trainer counts skipped steps (`train/skipped_steps`) and stops
the run after `--max-skipped-steps` in a row with one line naming the rollout, the metric
and the likely cause (`SkippedStreak`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class NonFiniteTraining(RuntimeError):
    """Training cannot go on: updates keep coming out non-finite. The message names the cause."""


def all_finite_on_every_rank(*values: float) -> bool:
    """True when every value is finite on every rank (one collective when a group is up)."""
    local_bad = 0.0 if all(math.isfinite(v) for v in values) else 1.0
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from miles.train.distributed import all_reduce_sum

        return all_reduce_sum([local_bad])[0] == 0
    return local_bad == 0


def step_if_finite(optimizer, scheduler, *, loss: float, grad_norm: float) -> bool:
    """Apply the optimizer (and lr schedule) step only if loss and grad norm are finite
    everywhere; otherwise drop the gradients. Returns True when the step was skipped."""
    if all_finite_on_every_rank(loss, grad_norm):
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        return False
    optimizer.zero_grad(set_to_none=True)
    return True


@dataclass
class SkippedStreak:
    """Consecutive skipped optimizer steps across rollouts; `limit` of them stop the run."""

    limit: int
    count: int = 0

    def record(self, rollout_id: int, skipped: bool, loss: float, grad_norm: float, lr: float) -> None:
        if not skipped:
            self.count = 0
            return
        self.count += 1
        if self.limit and self.count >= self.limit:
            raise NonFiniteTraining(describe_divergence(rollout_id, self.count, loss, grad_norm, lr))


def describe_divergence(rollout_id: int, count: int, loss: float, grad_norm: float, lr: float) -> str:
    metric, value = ("train/loss", loss) if not math.isfinite(loss) else ("train/grad_norm", grad_norm)
    if not math.isfinite(loss):
        cause = (
            "the loss itself is not finite: the policy's logprobs are (the weights diverged after an "
            f"earlier step at lr {lr:g}; lower --lr) or a reward/advantage is out of range"
        )
    else:
        cause = (
            "the gradients overflow at a finite loss (an earlier step moved the weights too far); "
            f"lower --lr (now {lr:g})"
        )
    return (
        f"rollout {rollout_id}: {metric} = {value} on {count} optimizer steps in a row, each skipped "
        f"(--max-skipped-steps {count}); likely cause: {cause}"
    )
