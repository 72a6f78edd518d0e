"""Evaluation every --eval-interval rollouts: mean reward on held-out prompt sets.

`--eval-prompt-data NAME PATH [NAME PATH ...]` names the sets; each is loaded like
--prompt-data (same keys, same reward rule). Ranks split the prompts, sample
--n-samples-per-eval-prompt responses each with the eval sampling settings (temperature 0
is greedy), and the mean reward is logged as `eval/<NAME>`. In a fully asynchronous run the
rollout worker submits nothing while evaluation runs on the same engines.
"""

from __future__ import annotations

from miles.train import data
from miles.train.config import DataConfig, EvalConfig, SamplingConfig
from miles.train.distributed import all_reduce_sum, sampling_seed

EVAL_SEED_OFFSET = 1_000_000_007  # eval draws never reuse a training rollout's random stream


def eval_sets(evaluation: EvalConfig, prompts: DataConfig) -> dict[str, list[data.Prompt]]:
    """The named evaluation prompt sets (the parser checked that NAME PATH come in pairs), read
    with the training data's keys."""
    pairs = evaluation.eval_prompt_data or ()
    return {
        name: data.load_prompts(
            path, input_key=prompts.input_key, label_key=prompts.label_key, metadata_key=prompts.metadata_key
        )
        for name, path in zip(pairs[::2], pairs[1::2], strict=True)
    }


def eval_sampling(evaluation: EvalConfig, train: SamplingConfig) -> SamplingConfig:
    temperature = train.temperature if evaluation.eval_temperature is None else evaluation.eval_temperature
    greedy = temperature == 0
    return SamplingConfig(
        temperature=1.0 if greedy else temperature,
        top_p=train.top_p if evaluation.eval_top_p is None else evaluation.eval_top_p,
        top_k=1 if greedy else train.top_k,
        max_response_len=evaluation.eval_max_response_len or train.max_response_len,
        stop_token_ids=train.stop_token_ids,
    )


def due(evaluation: EvalConfig, rollout_id: int) -> bool:
    every = evaluation.eval_interval
    return bool(every and evaluation.eval_prompt_data and (rollout_id + 1) % every == 0)


def evaluate(run, sets: dict[str, list[data.Prompt]], rollout_id: int) -> dict[str, float]:
    """`eval/<name>`: mean reward over every prompt of each set and its samples, all ranks."""
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
        total = sum(run.score(mine[i // n], generation)[1] for i, generation in enumerate(generations))
        reward_sum, count = all_reduce_sum([total, float(len(requests))])
        metrics[f"eval/{name}"] = reward_sum / count
    return metrics
