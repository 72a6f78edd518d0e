"""PPO's mathematics: GAE as the seed computes it, the clipped value loss, whitening, explained variance."""

from __future__ import annotations

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.ppo import explained_variance, gae, masked_sums, token_rewards, value_loss, whiten

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _reference_gae(rewards: list[float], values: list[float], gamma: float, lambd: float):
    """The seed's loop over one response (radixark/miles 31f1ca961, loss_hub/math_utils.py)."""
    last, out = 0.0, []
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t < len(values) - 1 else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lambd * last
        out.append(last)
    advantages = out[::-1]
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


@pytest.mark.parametrize(("gamma", "lambd"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_over_each_rows_response_matches_the_seeds_loop(gamma, lambd):
    torch.manual_seed(0)
    # two rows: responses at positions 2..5 and 1..2 (prompt and padding masked out)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    values = torch.randn(2, 7)
    rewards = token_rewards(torch.tensor([1.0, -0.5]), mask)
    assert rewards.tolist()[0] == [0, 0, 0, 0, 0, 1.0, 0] and rewards.tolist()[1][2] == -0.5
    advantages, returns = gae(rewards, values, mask, gamma, lambd)
    for row, (start, end) in enumerate(((2, 6), (1, 3))):
        ref_adv, ref_ret = _reference_gae(
            rewards[row, start:end].tolist(), values[row, start:end].tolist(), gamma, lambd
        )
        assert advantages[row, start:end].tolist() == pytest.approx(ref_adv, abs=1e-6)
        assert returns[row, start:end].tolist() == pytest.approx(ref_ret, abs=1e-6)
    assert (advantages * (1 - mask)).abs().sum() == 0 and (returns * (1 - mask)).abs().sum() == 0


def test_with_gamma_and_lambda_one_and_zero_values_every_token_gets_the_reward():
    mask = torch.tensor([[0, 1, 1, 1]], dtype=torch.float32)
    advantages, returns = gae(token_rewards(torch.tensor([2.0]), mask), torch.zeros(1, 4), mask, 1.0, 1.0)
    assert advantages.tolist() == [[0.0, 2.0, 2.0, 2.0]] and returns.tolist() == advantages.tolist()


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    mask = torch.ones(1, 3)
    old = torch.zeros(1, 3)
    values = torch.tensor([[0.1, 0.5, -0.5]])
    returns = torch.tensor([[0.0, 1.0, 1.0]])
    terms = value_loss(values, old, returns, mask, value_clip=0.2)
    # per token: max((v-R)^2, (clip(v, -0.2, 0.2) - R)^2)
    expected = [max(0.01, 0.01), max(0.25, 0.64), max(2.25, 1.44)]
    assert float(terms.loss) == pytest.approx(sum(expected) / 3)
    assert terms.value_loss == pytest.approx(sum(expected))
    assert terms.value_clipfrac == 2.0 and terms.tokens == 3.0


def test_whitened_advantages_have_zero_mean_and_unit_std_over_the_masked_tokens():
    torch.manual_seed(1)
    advantages = torch.randn(3, 5) * 4 + 2
    mask = (torch.rand(3, 5) > 0.3).float()
    out = whiten(advantages, mask, tuple(masked_sums(advantages, mask)))
    picked = out[mask > 0]
    assert float(picked.mean()) == pytest.approx(0.0, abs=1e-6)
    assert float(picked.std()) == pytest.approx(1.0, abs=1e-4)
    assert (out * (1 - mask)).abs().sum() == 0


def test_explained_variance_is_one_for_a_perfect_critic_and_zero_for_the_mean():
    returns = torch.tensor([[1.0, 2.0, 3.0, 6.0]])
    mask = torch.ones(1, 4)
    perfect = explained_variance(masked_sums(returns, mask), masked_sums(returns - returns, mask))
    mean = explained_variance(masked_sums(returns, mask), masked_sums(returns - returns.mean(), mask))
    assert perfect == pytest.approx(1.0) and mean == pytest.approx(0.0, abs=1e-9)


def test_the_critic_is_the_policy_network_with_a_zero_initialised_value_head():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from miles.train.model import with_value_head

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = with_value_head(Qwen3ForCausalLM(config))
    embedding = model.get_input_embeddings().weight.clone()
    tokens = torch.tensor([[1, 2, 3, 4]])
    values = model(input_ids=tokens).logits
    assert values.shape == (1, 4, 1) and values.abs().sum() == 0
    values.sum().backward()
    model.lm_head.weight.data.add_(model.lm_head.weight.grad)
    assert torch.equal(model.get_input_embeddings().weight, embedding)  # untied: the embedding is its own
    assert model(input_ids=tokens).logits.abs().sum() > 0
