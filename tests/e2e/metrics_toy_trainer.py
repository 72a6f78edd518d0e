"""A small real GRPO-style trainer on CPU that logs the standard metrics for the CI gate.

The task: for each of P prompts, emit L tokens from a vocabulary of V; the reward is the
fraction of tokens equal to a fixed target sequence of that prompt. The rollout samples
with a temperature from bf16 logits (standing in for an inference engine); the trainer
recomputes log-probabilities in fp32 at temperature 1, optimises the clipped PPO
objective with group-normalised advantages, and logs through miles.metrics.capture.log:

- train/grad_norm: total gradient norm before clipping, mean over minibatches;
- train/ppo_kl: mean (old - new) log-probability of each minibatch update;
- train/train_rollout_logprob_abs_diff: mean |trainer - rollout| token log-probability;
- train/train_rollout_kl: k3 estimate of KL(rollout || trainer) over rollout tokens;
- rollout/raw_reward: mean reward of the step's rollouts.

`python tests/e2e/metrics_toy_trainer.py --seed 3 --lr-scale 100` runs one training; under
MILES_CI_GATE_RECORD_DIR it leaves its metric record there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class ToyConfig:
    seed: int = 0
    steps: int = 20
    lr: float = 3e-2
    temperature: float = 1.0
    prompts: int = 16
    vocab: int = 8
    length: int = 4
    hidden: int = 32
    batch_prompts: int = 64
    samples_per_prompt: int = 8
    minibatches: int = 2
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28
    max_grad_norm: float = 1.0


def train(config: ToyConfig) -> dict[str, float]:
    """Train for `config.steps` steps, logging every step; returns the last step's metrics."""
    import torch

    from miles.metrics.capture import log

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    targets = torch.randint(
        0, config.vocab, (config.prompts, config.length), generator=torch.Generator().manual_seed(1234)
    )
    policy = _Policy(config)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.lr, betas=(0.9, 0.98))
    metrics: dict[str, float] = {}
    for step in range(config.steps):
        prompts = torch.randint(0, config.prompts, (config.batch_prompts,), generator=gen)
        prompts = prompts.repeat_interleave(config.samples_per_prompt)
        tokens, rollout_logp = _rollout(policy, prompts, config.temperature, gen)
        rewards = (tokens == targets[prompts]).float().mean(dim=1)
        advantages = _group_advantages(rewards, config.samples_per_prompt)
        with torch.no_grad():
            old_logp = policy.token_logp(prompts, tokens)
        log_ratio = old_logp - rollout_logp
        metrics = {
            "rollout/raw_reward": rewards.mean().item(),
            "train/train_rollout_logprob_abs_diff": log_ratio.abs().mean().item(),
            "train/train_rollout_kl": (log_ratio.exp() - 1 - log_ratio).mean().item(),
        }
        metrics.update(_update(policy, optimizer, prompts, tokens, old_logp, advantages, config))
        log(step, metrics)
    return metrics


class _Policy:
    """Token logits from a prompt embedding and a position embedding, through one hidden layer."""

    def __init__(self, config: ToyConfig):
        import torch

        self.config = config
        self.net = torch.nn.Sequential(
            torch.nn.Linear(config.prompts + config.length, config.hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(config.hidden, config.vocab),
        )

    def parameters(self):
        return self.net.parameters()

    def logits(self, prompts, dtype=None):
        import torch

        c = self.config
        p = torch.nn.functional.one_hot(prompts, c.prompts).float()
        pos = torch.eye(c.length)
        x = torch.cat(
            [p[:, None, :].expand(-1, c.length, -1), pos[None].expand(len(prompts), -1, -1)], dim=-1
        )
        if dtype is None:
            return self.net(x)
        return torch.nn.functional.linear(
            torch.tanh(
                torch.nn.functional.linear(
                    x.to(dtype), self.net[0].weight.to(dtype), self.net[0].bias.to(dtype)
                )
            ),
            self.net[2].weight.to(dtype),
            self.net[2].bias.to(dtype),
        )

    def token_logp(self, prompts, tokens):
        logp = self.logits(prompts).log_softmax(dim=-1)
        return logp.gather(-1, tokens[..., None]).squeeze(-1)


def _rollout(policy: _Policy, prompts, temperature: float, gen):
    """Sample as an inference engine would: bf16 logits, temperature applied, logprobs reported."""
    import torch

    with torch.no_grad():
        logits = policy.logits(prompts, dtype=torch.bfloat16).float() / temperature
        logp = logits.log_softmax(dim=-1)
        tokens = torch.multinomial(logp.exp().reshape(-1, logp.shape[-1]), 1, generator=gen).reshape(
            logp.shape[:-1]
        )
        return tokens, logp.gather(-1, tokens[..., None]).squeeze(-1)


def _group_advantages(rewards, group: int):
    grouped = rewards.reshape(-1, group)
    normalised = (grouped - grouped.mean(dim=1, keepdim=True)) / (grouped.std(dim=1, keepdim=True) + 1e-6)
    return normalised.reshape(-1)


def _update(policy, optimizer, prompts, tokens, old_logp, advantages, config: ToyConfig) -> dict[str, float]:
    import torch

    grad_norms, ppo_kls = [], []
    for idx in torch.arange(len(prompts)).chunk(config.minibatches):
        new_logp = policy.token_logp(prompts[idx], tokens[idx])
        ratio = (new_logp - old_logp[idx]).exp()
        adv = advantages[idx][:, None]
        clipped = ratio.clamp(1 - config.eps_clip, 1 + config.eps_clip_high)
        loss = -torch.minimum(ratio * adv, clipped * adv).mean()
        optimizer.zero_grad()
        loss.backward()
        grad_norms.append(
            torch.nn.utils.clip_grad_norm_(list(policy.parameters()), config.max_grad_norm).item()
        )
        ppo_kls.append((old_logp[idx] - new_logp.detach()).mean().item())
        optimizer.step()
    return {"train/grad_norm": sum(grad_norms) / len(grad_norms), "train/ppo_kl": sum(ppo_kls) / len(ppo_kls)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=ToyConfig.steps)
    parser.add_argument("--lr-scale", type=float, default=1.0, help="multiply the learning rate")
    parser.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    args = parser.parse_args(argv)
    config = ToyConfig(
        seed=args.seed, steps=args.steps, lr=ToyConfig.lr * args.lr_scale, temperature=args.temperature
    )
    for key, value in train(config).items():
        print(f"{key} = {value:.6g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
