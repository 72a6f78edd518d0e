"""PPO's critic in the training loop (`--advantage-estimator ppo`): values, GAE, value steps.

The critic is a second training backend of the run's kind, built with role="critic" (its own
model: the policy's network with a value head; its own optimizer, --critic-lr and checkpoint,
under `critic/` in each checkpoint directory). For a rollout, `with_gae` scores every local
sample's positions with the critic's current values, turns the rewards into per-token
advantages and returns by GAE (--gamma, --lambd; miles.train.ppo), and, with
--normalize-advantages, whitens the advantages over every data-parallel rank's response tokens;
`explained_variance` says how much of the returns those values foresaw. Then `value_step` trains
the critic on each minibatch, beside the policy's step; during the first
--num-critic-only-steps rollouts only the critic trains.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from miles.train import ppo
from miles.train.batch import TokenBatch
from miles.train.distributed import all_reduce_sum


def policy_waits(run, rollout_id: int) -> bool:
    """Whether this rollout trains the critic alone (--num-critic-only-steps warm-up)."""
    return run.critic is not None and rollout_id < run.config.algorithm.num_critic_only_steps


def values(run, local: TokenBatch, plan: Sequence[Sequence[Sequence[int]]]) -> torch.Tensor:
    """The critic's values [B, T-1] of the local batch's rows, each minibatch scored with the
    micro-batches its steps get (zeros outside the response)."""
    out = torch.zeros_like(local.loss_mask)
    for micro in plan:
        for rows, value in zip(micro, run.critic.batch_values([local.rows(r) for r in micro]), strict=True):
            out[torch.as_tensor(list(rows), dtype=torch.long), : value.shape[1]] = value.float()
    return out


def with_gae(
    run, local: TokenBatch, plan: Sequence[Sequence[Sequence[int]]], rewards: torch.Tensor
) -> tuple[TokenBatch, dict[str, float]]:
    """The local batch with PPO's per-token advantages, returns and old values, and the
    rollout's value metrics over every data-parallel rank (explained variance, mean value)."""
    algorithm, mask = run.config.algorithm, local.loss_mask
    old = values(run, local, plan)
    advantages, returns = ppo.gae(
        ppo.token_rewards(rewards, mask), old, mask, algorithm.gamma, algorithm.lambd
    )
    group = run.backend.data_parallel[2]
    sums = all_reduce_sum(
        [*ppo.masked_sums(returns, mask), *ppo.masked_sums(returns - old, mask), *ppo.masked_sums(old, mask)],
        group,
    )
    metrics = {
        "train/explained_variance": ppo.explained_variance(tuple(sums[0:3]), tuple(sums[3:6])),
        "train/values": sums[7] / sums[6],
        "train/returns": sums[1] / sums[0],
    }
    return local.with_(advantages=advantages, returns=returns, old_values=old), metrics


def whitened(run, local: TokenBatch) -> TokenBatch:
    """--normalize-advantages: the advantages, per token, less their mean over every
    data-parallel rank's response tokens, over their std (the seed's distributed_masked_whiten)."""
    mask = local.loss_mask
    advantages = local.advantages
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(mask)
    sums = all_reduce_sum(ppo.masked_sums(advantages, mask), run.backend.data_parallel[2])
    return local.with_(advantages=ppo.whiten(advantages, mask, tuple(sums)))


def value_step(run, micro: Sequence[TokenBatch], normalizer: float) -> dict[str, float]:
    """One critic step on this rank's micro-batches of a minibatch (the policy's normaliser); its
    value-loss sums over the data-parallel ranks, its gradient norm and learning rate."""
    result = run.critic.train_step(micro, normalizer)
    local = [sum(getattr(t, k) for t in result.terms) for k in ppo.VALUE_SUMS]
    reduced = dict(zip(ppo.VALUE_SUMS, all_reduce_sum(local, run.critic.data_parallel[2]), strict=True))
    return reduced | {"grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped}


def value_metrics(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """`train/value_loss` and `train/value_clipfrac` per response token of the rollout, and the
    critic's gradient norm and learning rate averaged over its steps."""
    tokens = sum(step["tokens"] for step in steps)
    return {
        "train/value_loss": sum(step["value_loss"] for step in steps) / tokens,
        "train/value_clipfrac": sum(step["value_clipfrac"] for step in steps) / tokens,
        "train/critic_grad_norm": sum(step["grad_norm"] for step in steps) / len(steps),
        "train/critic_lr": sum(step["lr"] for step in steps) / len(steps),
        "train/critic_skipped_steps": float(sum(step["skipped"] for step in steps)),
    }
