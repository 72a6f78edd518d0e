"""Evaluation every --eval-interval rollouts: mean reward and pass@k on held-out prompt sets.

`--eval-prompt-data NAME PATH [NAME PATH ...]` names the sets; each is loaded like
--prompt-data (its keys, or --eval-input-key / --eval-label-key; the same reward rule). Ranks
split the prompts, sample --n-samples-per-eval-prompt responses each with the eval sampling
settings (--eval-temperature 0 or --eval-top-k 1 is greedy), and log, as the seed framework
names them (radixark/miles 31f1ca961, miles/ray/rollout/metrics.py, log_eval_rollout_data):

- `eval/<NAME>`: the mean reward over every sample of every prompt;
- `eval/<NAME>-pass@k` for k = 1, 2, 4, ... up to the samples per prompt (when above 1): the
  unbiased estimate 1 - C(n-c, k) / C(n, k) of a prompt's chance that one of k samples is
  correct (reward 1), averaged over the prompts (miles/utils/metric_utils.py, compute_pass_rate);
- `eval/<NAME>-truncated_ratio`: the share of samples cut at the length limit.

In a fully asynchronous run the rollout worker submits nothing while evaluation runs on the
same engines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from miles.train import data
from miles.train.config import DataConfig, EvalConfig, SamplingConfig
from miles.train.distributed import all_reduce_sum, sampling_seed

EVAL_SEED_OFFSET = 1_000_000_007  # eval draws never reuse a training rollout's random stream


def eval_sets(evaluation: EvalConfig, prompts: DataConfig) -> dict[str, list[data.Prompt]]:
    """The named evaluation prompt sets (the parser checked that NAME PATH come in pairs), read
    with the eval keys, or the training data's."""
    pairs = evaluation.eval_prompt_data or ()
    return {
        name: data.load_prompts(
            path,
            input_key=evaluation.eval_input_key or prompts.input_key,
            label_key=evaluation.eval_label_key or prompts.label_key,
            metadata_key=prompts.metadata_key,
        )
        for name, path in zip(pairs[::2], pairs[1::2], strict=True)
    }


def eval_sampling(evaluation: EvalConfig, train: SamplingConfig) -> SamplingConfig:
    temperature = train.temperature if evaluation.eval_temperature is None else evaluation.eval_temperature
    greedy = temperature == 0
    top_k = train.top_k if evaluation.eval_top_k is None else evaluation.eval_top_k
    return SamplingConfig(
        temperature=1.0 if greedy else temperature,
        top_p=train.top_p if evaluation.eval_top_p is None else evaluation.eval_top_p,
        top_k=1 if greedy else top_k,
        max_response_len=evaluation.eval_max_response_len or train.max_response_len,
        stop_token_ids=train.stop_token_ids,
    )


def due(evaluation: EvalConfig, rollout_id: int) -> bool:
    """Whether the sets are scored after rollout `rollout_id` (every --eval-interval rollouts)."""
    every = evaluation.eval_interval
    return bool(every and evaluation.eval_prompt_data and (rollout_id + 1) % every == 0)


def due_before_training(evaluation: EvalConfig) -> bool:
    """Whether the sets are scored before a run's first rollout, as the seed framework does unless
    --skip-eval-before-train (radixark/miles 31f1ca961, train.py): the baseline the curve starts
    from, logged at the first rollout's step."""
    return bool(
        evaluation.eval_interval and evaluation.eval_prompt_data and not evaluation.skip_eval_before_train
    )


def pass_ks(samples_per_prompt: int) -> tuple[int, ...]:
    """The k of pass@k logged for n samples per prompt: 1, 2, 4, ... up to n (none for n = 1)."""
    if samples_per_prompt < 2:
        return ()
    return tuple(2**i for i in range(int(math.log2(samples_per_prompt)) + 1))


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased chance that k of a prompt's n samples, c of them correct, hold a correct one."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def set_metrics(
    name: str, rewards: Sequence[Sequence[float]], n: int, truncated: int, group: object = None
) -> dict[str, float]:
    """`eval/<name>*` of one set from this rank's prompts' rewards (a list of n per prompt; a rank
    may have none), summed with the other ranks' over `group`."""
    ks = pass_ks(n)
    local = [
        float(sum(map(sum, rewards))),
        float(sum(map(len, rewards))),
        float(len(rewards)),
        float(truncated),
        *(sum(pass_at_k(n, sum(r == 1 for r in prompt), k) for prompt in rewards) for k in ks),
    ]
    total, samples, prompts, cut, *passes = all_reduce_sum(local, group)
    metrics = {f"eval/{name}": total / samples, f"eval/{name}-truncated_ratio": cut / samples}
    return metrics | {f"eval/{name}-pass@{k}": p / prompts for k, p in zip(ks, passes, strict=True)}


def before_training(run, sets: dict[str, list[data.Prompt]]) -> None:
    """Score the sets with the starting weights; recorded at the first rollout's step (an
    evaluation after that rollout, at --eval-interval 1, takes its place there)."""
    from miles.train import report

    metrics = evaluate(run, sets, run.start_rollout)
    if run.dist.is_main:
        report.record(run.start_rollout, metrics)
        run.log(" | ".join(["before training", *(f"{k} {v:.3f}" for k, v in metrics.items())]))


def evaluate(run, sets: dict[str, list[data.Prompt]], rollout_id: int) -> dict[str, float]:
    """Every set's `eval/<name>*` metrics, over all ranks (see the module docstring)."""
    if run.async_rollouts is not None:  # fully async: the worker submits nothing meanwhile
        with run.async_rollouts.paused():
            return _evaluate(run, sets, rollout_id)
    return _evaluate(run, sets, rollout_id)


def _evaluate(run, sets: dict[str, list[data.Prompt]], rollout_id: int) -> dict[str, float]:
    evaluation, rank, world = run.config.eval, run.dist.rank, run.dist.world_size
    sampling = eval_sampling(evaluation, run.sampling)
    n = evaluation.n_samples_per_eval_prompt
    metrics = {}
    for name, prompts in sets.items():
        mine = prompts[rank::world]
        # not run.encode: its cache is keyed by the training set's indices
        requests = [ids for ids in map(run.prompt_ids, mine) for _ in range(n)]
        seed = sampling_seed(run.config.rollout.rollout_seed + EVAL_SEED_OFFSET, rollout_id, rank)
        generations = run.engine.generate(requests, sampling, seed=seed) if requests else []
        rewards = [
            [run.score(prompt, g)[1] for g in generations[i * n : (i + 1) * n]]
            for i, prompt in enumerate(mine)
        ]
        truncated = sum(g.finish_reason == "length" for g in generations)
        metrics |= set_metrics(name, rewards, n, truncated)
    return metrics
