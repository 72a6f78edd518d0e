"""PPO's mathematics with a learned critic, as pure tensor functions (no model, no process group).

`--advantage-estimator ppo` replaces GRPO's group baseline with a value model (the critic) that
predicts, at each response token, the return still to come. Shapes follow miles.train.algorithm:
per-token tensors are [samples, positions] aligned with next-token targets, with a 0/1 `mask` on
response tokens; position t's value is the critic's estimate before response token t is chosen.
As in the seed framework (radixark/miles 31f1ca961, miles/backends/training_utils/loss_hub/):

- the reward is paid at a response's last token (math_utils.py, get_advantages_and_returns:
  delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, V past the end 0,
  returns = A + V);
- the value loss is max((V - R)^2, (clip(V, V_old +- value_clip) - R)^2), a mean over each
  sample's tokens (losses.py, value_loss_function);
- `--normalize-advantages` whitens the advantages over every data-parallel rank's response
  tokens (advantages.py, normalize_advantages).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[samples, positions]: each sample's reward on its last response token, 0 elsewhere."""
    out = torch.zeros_like(mask, dtype=torch.float32)
    last = _last_positions(mask)
    has = mask.sum(dim=1) > 0
    out[has, last[has]] = rewards.float()[has]
    return out


def _last_positions(mask: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask > 0, positions, torch.full_like(positions, -1)).max(dim=1).values.clamp(min=0)


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns [samples, positions], over each row's masked
    (response) positions in order; zero outside them. `rewards` are per token (token_rewards)."""
    mask = mask.float()
    values = values.float() * mask
    rewards = rewards.float() * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)
    next_value = torch.zeros_like(running)
    for t in reversed(range(values.shape[1])):
        live = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(live > 0, delta + gamma * lambd * running, running)
        next_value = torch.where(live > 0, values[:, t], next_value)
        advantages[:, t] = running * live
    return advantages, (advantages + values) * mask


def whiten(advantages: torch.Tensor, mask: torch.Tensor, sums: tuple[float, float, float]) -> torch.Tensor:
    """Advantages less their mean over the masked tokens, over their std; `sums` is (count, sum,
    sum of squares) of the masked advantages over every data-parallel rank."""
    count, total, squares = sums
    mean = total / count
    var = max(squares / count - mean * mean, 0.0)
    if count >= 2:
        var *= count / (count - 1)  # Bessel's correction, as the seed's distributed_masked_whiten
    return (advantages - mean) / math.sqrt(var + 1e-8) * mask


def masked_sums(x: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """(count, sum, sum of squares) of `x` over the masked positions, in float64."""
    x, mask = x.double(), mask.double()
    return [float(mask.sum()), float((x * mask).sum()), float((x * x * mask).sum())]


def explained_variance(
    returns_sums: tuple[float, float, float], residual_sums: tuple[float, float, float]
) -> float:
    """1 - Var(R - V) / Var(R) over the response tokens of every rank: 1 when the critic predicts
    the returns exactly, 0 when it is no better than their mean, below 0 when worse."""

    def variance(sums: tuple[float, float, float]) -> float:
        count, total, squares = sums
        return squares / count - (total / count) ** 2

    var_returns = variance(returns_sums)
    return 1.0 - variance(residual_sums) / var_returns if var_returns > 0 else float("nan")


@dataclass(frozen=True)
class ValueTerms:
    """A micro-batch's value loss (summed over samples, each a mean over its tokens; the caller
    divides) and its token-summed stats."""

    loss: torch.Tensor
    value_loss: float
    value_clipfrac: float
    tokens: float


VALUE_SUMS = tuple(f.name for f in fields(ValueTerms) if f.name not in ("loss",))


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float,
    *,
    per_token: bool = False,
) -> ValueTerms:
    """The clipped value loss of one micro-batch (see the module docstring)."""
    mask = mask.float()
    values, old_values, returns = values.float(), old_values.float(), returns.float()
    clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    per = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    clip_active = ((values - old_values).abs() > value_clip).float()
    if per_token:
        loss = (per * mask).sum()
    else:
        loss = ((per * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).sum()
    total = lambda x: float((x.detach() * mask).sum())  # noqa: E731
    return ValueTerms(
        loss=loss, value_loss=total(per), value_clipfrac=total(clip_active), tokens=float(mask.sum())
    )
