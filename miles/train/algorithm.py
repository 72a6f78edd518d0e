"""The GRPO/GSPO mathematics, as pure tensor functions (no model, no process group).

Shapes: `rewards` is [samples]; per-token tensors are [samples, response_len] with a 0/1
`mask` marking real response tokens. Logprobs are of the temperature-scaled policy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from miles.train.config import LossConfig

# log(pi/pi_old) is clamped to [-20, 20] before exp, as verl's PPO loss does
# (core_algos.compute_policy_loss): exp(20) ~ 5e8 is far outside any clip range, so the
# loss is unchanged wherever it is meaningful, and a diverged token gives a large finite
# ratio instead of inf (whose product with a zero advantage is NaN).
LOG_RATIO_LIMIT = 20.0


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True) -> torch.Tensor:
    """GRPO advantage of each sample: its reward minus its group's mean, over the group's std.

    Samples of one prompt are consecutive. A group whose rewards are all equal carries no
    signal and gets zero advantage (the std division is guarded, not skipped).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form whole groups of {group_size}")
    # float64: a group of float32-sized rewards (up to 3.4e38) would overflow its own mean.
    groups = rewards.double().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True, unbiased=True) + 1e-6)
    return centered.view(-1).float()


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    k1 = log r, k2 = (log r)^2 / 2, k3 (= low_var_kl) = exp(-log r) + log r - 1 with
    log r = logp - ref_logp; k3 is unbiased and never negative, so it is clamped for safety.
    """
    log_ratio = logp.float() - ref_logp.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
        return torch.clamp(torch.exp(-log_ratio) + log_ratio - 1.0, min=-10.0, max=10.0)
    raise ValueError(f"unknown KL type '{kind}'; known: k1, k2, k3, low_var_kl")


def importance_log_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """log(pi/pi_old) per token: token-level for GRPO and PPO; GSPO uses the sequence's length-normalised
    ratio for every token, with the gradient still flowing through each token's logprob."""
    log_ratio = logp - old_logp
    if estimator in ("grpo", "ppo"):
        return log_ratio
    if estimator == "gspo":
        seq = (log_ratio * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)
        return logp - logp.detach() + seq.detach()
    raise ValueError(f"unknown advantage estimator '{estimator}'; known: grpo, gspo, ppo")


def clipped_policy_loss(
    log_ratio: torch.Tensor, advantages: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token (to minimise) and where clipping was active.

    The ratio is clipped to [1 - eps_clip, 1 + eps_clip_high]; with dual clip, a negative
    advantage's loss is also capped at eps_clip_c * |A| so one stale token cannot blow up.
    """
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - cfg.eps_clip, 1.0 + cfg.eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = (clipped > unclipped).float()
    if cfg.eps_clip_c is not None:
        capped = torch.minimum(loss, -advantages * cfg.eps_clip_c)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, clip_active


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """Truncated importance weights pi_train_old / pi_rollout, correcting rollout-engine mismatch."""
    log_ratio = (old_logp - rollout_logp).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return torch.exp(log_ratio).clamp(min=cfg.tis_clip_low, max=cfg.tis_clip).detach()


@dataclass(frozen=True)
class LossTerms:
    """A micro-batch's loss (summed, to be divided by the caller's normaliser) and its stats,
    each a token-summed total so ranks and micro-batches can be added up exactly."""

    loss: torch.Tensor
    pg_loss: float
    pg_clipfrac: float
    ppo_kl: float
    kl_loss: float
    entropy: float
    tis_weight: float
    tokens: float
    mtp_loss: float = 0.0  # the MTP layers' token loss times `tokens` (--enable-mtp-training)


LOSS_SUMS = tuple(f.name for f in fields(LossTerms) if f.name != "loss")  # the additive stats


def policy_loss(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    sample_weight: torch.Tensor | None = None,
) -> LossTerms:
    """The GRPO/GSPO objective of one micro-batch.

    Per-sample mode (default) averages each sample's tokens and sums samples; per-token mode
    sums tokens. `advantages` is per sample ([samples], broadcast over tokens) or per token
    ([samples, response_len], PPO's); `sample_weight` ([samples]) scales each sample's part of the
    loss (an execution split into k samples weighs 1/k each, miles.train.generate)."""
    mask = mask.float()
    if advantages.dim() == 2:
        adv = advantages.float()[:, : logp.shape[1]]
    else:
        adv = advantages.float().unsqueeze(1).expand_as(logp)
    log_ratio = importance_log_ratio(logp.float(), old_logp.float(), mask, cfg.advantage_estimator)
    pg, clip_active = clipped_policy_loss(log_ratio, adv, cfg)
    weights = torch.ones_like(pg)
    if cfg.use_tis:
        if rollout_logp is None:
            raise ValueError("--use-tis needs the rollout engine's logprobs")
        weights = tis_weights(old_logp.float(), rollout_logp.float(), cfg)
        pg = pg * weights
    per_token = pg - cfg.entropy_coef * entropy.float()
    kl = torch.zeros_like(pg)
    if cfg.use_kl_loss:
        if ref_logp is None:
            raise ValueError("--use-kl-loss needs reference logprobs")
        kl = kl_penalty(logp, ref_logp, cfg.kl_loss_type)
        per_token = per_token + cfg.kl_loss_coef * kl
    loss = _aggregate(per_token, mask, cfg.per_token_loss, sample_weight)
    ppo_kl = (old_logp.float() - logp.float()).detach()
    total = lambda x: float((x.detach() * mask).sum())  # noqa: E731
    return LossTerms(
        loss=loss,
        pg_loss=total(pg),
        pg_clipfrac=total(clip_active),
        ppo_kl=total(ppo_kl),
        kl_loss=total(kl),
        entropy=total(entropy.float()),
        tis_weight=total(weights),
        tokens=float(mask.sum()),
    )


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, per_token_loss: bool, weight: torch.Tensor | None = None
) -> torch.Tensor:
    if per_token_loss:
        per_sample = (per_token * mask).sum(dim=1)
    else:
        per_sample = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return (per_sample if weight is None else per_sample * weight.to(per_sample)).sum()


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, *, with_entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of each target token under softmax(logits / T), and the entropy of that softmax."""
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked, torch.zeros_like(picked)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return picked, entropy
