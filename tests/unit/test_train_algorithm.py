"""GRPO/GSPO mathematics checked against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.algorithm import (
    clipped_policy_loss,
    group_advantages,
    importance_log_ratio,
    kl_penalty,
    policy_loss,
    tis_weights,
    token_logprobs_and_entropy,
)
from miles.train.batch import Sample, collate, load_samples, save_samples
from miles.train.config import LossConfig
from miles.train.report import train_metrics
from miles.train.rollout import Generation

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def cfg(**overrides) -> LossConfig:
    base = dict(
        advantage_estimator="grpo", eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=None, use_kl_loss=False,
        kl_loss_type="low_var_kl", kl_loss_coef=0.0, entropy_coef=0.0, use_tis=False, tis_clip=2.0,
        tis_clip_low=0.0, per_token_loss=False, temperature=1.0,
    )  # fmt: skip
    return LossConfig(**{**base, **overrides})


def test_group_advantage_is_reward_minus_group_mean_over_group_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0]), 3)
    std = math.sqrt(1 / 3)  # unbiased std of (1, 0, 0)
    assert adv[:3].tolist() == pytest.approx([(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std], rel=1e-4)


def test_group_with_equal_rewards_has_zero_advantage():
    assert group_advantages(torch.tensor([0.5, 0.5, 1.0, 0.0]), 2)[:2].tolist() == [0.0, 0.0]


def test_dr_grpo_skips_the_std_division():
    assert group_advantages(torch.tensor([1.0, 0.0]), 2, normalize_std=False).tolist() == [0.5, -0.5]


def test_rewards_must_form_whole_groups():
    with pytest.raises(ValueError, match="do not form whole groups of 4"):
        group_advantages(torch.zeros(6), 4)


def test_kl_estimators_match_their_formulas():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    r = 0.5  # log(pi / pi_ref)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(r * r / 2)
    assert kl_penalty(logp, ref, "low_var_kl").item() == pytest.approx(math.exp(-r) + r - 1)
    assert kl_penalty(logp, ref, "k3").item() == kl_penalty(logp, ref, "low_var_kl").item()


def test_k3_is_never_negative():
    logp, ref = torch.randn(1000), torch.randn(1000)
    assert (kl_penalty(logp, ref, "k3") >= 0).all()


def test_ratio_above_the_upper_clip_is_clipped_for_positive_advantage():
    loss, clipped = clipped_policy_loss(torch.log(torch.tensor([1.5, 1.1])), torch.tensor([1.0, 1.0]), cfg())
    assert loss.tolist() == pytest.approx([-1.28, -1.1]) and clipped.tolist() == [1.0, 0.0]


def test_ratio_below_the_lower_clip_is_clipped_for_negative_advantage():
    loss, clipped = clipped_policy_loss(torch.log(torch.tensor([0.5])), torch.tensor([-1.0]), cfg())
    assert loss.tolist() == pytest.approx([0.8]) and clipped.tolist() == [1.0]


def test_dual_clip_caps_the_loss_of_a_negative_advantage():
    log_ratio, adv = torch.log(torch.tensor([10.0])), torch.tensor([-1.0])
    assert clipped_policy_loss(log_ratio, adv, cfg())[0].item() == pytest.approx(10.0)
    assert clipped_policy_loss(log_ratio, adv, cfg(eps_clip_c=3.0))[0].item() == pytest.approx(3.0)


def test_gspo_uses_the_sequence_ratio_for_every_token_but_keeps_token_gradients():
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    log_ratio = importance_log_ratio(logp, old, mask, "gspo")
    assert log_ratio[0, :2].tolist() == pytest.approx([0.0, 0.0])  # mean of (+0.5, -0.5)
    (log_ratio * mask).sum().backward()
    assert logp.grad.tolist() == [[1.0, 1.0, 0.0]]


def test_tis_weights_are_truncated():
    w = tis_weights(torch.tensor([0.0, 0.0]), torch.tensor([-2.0, 0.1]), cfg(tis_clip=2.0, tis_clip_low=0.95))
    assert w.tolist() == pytest.approx([2.0, 0.95])


def test_loss_at_ratio_one_is_minus_mean_advantage_with_zero_kl_and_clipping():
    logp = torch.log(torch.full((2, 3), 0.5))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    terms = policy_loss(logp, torch.zeros(2, 3), logp.clone(), torch.tensor([1.0, -0.5]), mask, cfg())
    assert terms.loss.item() == pytest.approx(-1.0 + 0.5)  # per sample: -A, summed over samples
    assert (terms.ppo_kl, terms.pg_clipfrac, terms.tokens) == (0.0, 0.0, 5.0)


def test_per_token_mode_sums_tokens_instead_of_averaging_each_sample():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    terms = policy_loss(
        logp, torch.zeros(2, 3), logp, torch.tensor([1.0, 1.0]), mask, cfg(per_token_loss=True)
    )
    assert terms.loss.item() == pytest.approx(-4.0)


def test_kl_and_entropy_terms_enter_the_loss_with_their_coefficients():
    logp, ref = torch.full((1, 1), -1.0), torch.full((1, 1), -1.5)
    mask, entropy = torch.ones(1, 1), torch.full((1, 1), 2.0)
    c = cfg(use_kl_loss=True, kl_loss_type="k1", kl_loss_coef=0.1, entropy_coef=0.01)
    terms = policy_loss(logp, entropy, logp, torch.zeros(1), mask, c, ref_logp=ref)
    assert terms.loss.item() == pytest.approx(0.1 * 0.5 - 0.01 * 2.0)


def test_logprobs_and_entropy_of_uniform_logits():
    logits = torch.zeros(1, 2, 4)
    logp, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1, 3]]), temperature=0.7)
    assert logp[0].tolist() == pytest.approx([math.log(0.25)] * 2)
    assert entropy[0].tolist() == pytest.approx([math.log(4)] * 2)


def test_collate_aligns_response_tokens_with_next_token_targets():
    gen = Generation(prompt_ids=(5, 6, 7), response_ids=(8, 9), logprobs=(-0.1, -0.2), finish_reason="stop")
    short = Generation(prompt_ids=(5,), response_ids=(8,), logprobs=(-0.3,), finish_reason="length")
    batch = collate([Sample(0, 0, gen, "", "", 1.0, 0.5), Sample(1, 0, short, "", "", 0.0, -0.5)])
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 8, 0, 0, 0]]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert batch.rollout_logp[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert batch.rows([1]).input_ids.tolist() == [[5, 8]]


def test_saved_rollout_samples_load_back_equal(tmp_path):
    gen = Generation(prompt_ids=(5, 6), response_ids=(8, 2), logprobs=(-0.1, -0.2), finish_reason="stop")
    samples = [Sample(3, 0, gen, "x", "7777", 0.25, 1.5), Sample(3, 0, gen, "y", "7777", 0.0, -1.5)]
    save_samples(str(tmp_path / "rollout_0.json"), samples)
    assert load_samples(str(tmp_path / "rollout_0.json")) == samples


def test_train_metrics_average_steps_and_divide_loss_terms_by_the_rollouts_tokens():
    def step(tokens, pg_loss, loss, grad_norm):
        terms = dict(pg_clipfrac=0.0, ppo_kl=0.0, kl_loss=0.0, entropy=0.0, tis_weight=tokens)
        return dict(terms, tokens=tokens, pg_loss=pg_loss, loss=loss, grad_norm=grad_norm, lr=1e-6)

    metrics = train_metrics([step(10, 5.0, 1.0, 2.0), step(30, 3.0, 3.0, 4.0)], use_tis=False)
    assert metrics["train/loss"] == 2.0 and metrics["train/grad_norm"] == 3.0
    assert metrics["train/pg_loss"] == pytest.approx(8.0 / 40)
    assert "train/tis_weight" not in metrics and "train/tokens" not in metrics
    assert train_metrics([step(10, 5.0, 1.0, 2.0)], use_tis=True)["train/tis_weight"] == 1.0
    assert "train/mtp_loss" not in metrics  # no MTP layer trained
    with_mtp = train_metrics([{**step(10, 5.0, 1.0, 2.0), "mtp_loss": 25.0}], use_tis=False)
    assert with_mtp["train/mtp_loss"] == 2.5  # token-summed, per token of the rollout


def test_a_diverged_token_gives_a_finite_loss_and_gradient():
    # log(pi/pi_old) = 200 would make exp() inf, and inf * a zero advantage is NaN.
    logp = torch.tensor([[200.0, 0.1]], requires_grad=True)
    loss, _ = clipped_policy_loss(logp - torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), cfg(eps_clip_c=3.0))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()


def test_the_log_ratio_is_clamped_where_verl_clamps_it():
    from miles.train.algorithm import LOG_RATIO_LIMIT

    assert LOG_RATIO_LIMIT == 20.0
    unclipped, _ = clipped_policy_loss(torch.tensor([[25.0]]), torch.tensor([[-1.0]]), cfg())
    assert unclipped.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_k3_of_a_diverged_token_stays_finite():
    assert torch.isfinite(kl_penalty(torch.tensor([-500.0]), torch.tensor([0.0]), "low_var_kl")).all()


def test_float32_sized_rewards_give_finite_advantages():
    adv = group_advantages(torch.tensor([3.0e38, -3.0e38, 3.0e38, 0.0], dtype=torch.float64), 4)
    assert torch.isfinite(adv).all() and adv.dtype == torch.float32
