"""`python -m miles.train`: group-relative policy optimisation, one rollout per iteration.

    for rollout k = start .. num_rollout-1:
        1. rollout    for each prompt of the batch, sample G responses with the current policy
        2. reward     score each response with the rule (--rm-type)
        3. advantage  A_i = (r_i - mean(r_group)) / std(r_group)
        4. learn      for each minibatch: clipped policy loss (+ KL to the reference,
                      - entropy bonus), AdamW step with gradient clipping
        5. sync       push the new weights to the rollout engine
        evaluate every --eval-interval rollouts; log the metrics; save every --save-interval

Ranks split the prompts for step 1-2, gather the samples, and split them again for step 4
(data parallel, FSDP2 or DDP). The machinery lives in runtime.py (setup), checks.py,
checkpoint.py and report.py; this file is the algorithm.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from miles.train import checkpoint, checks, evaluation, guards, report
from miles.train.algorithm import LOSS_SUMS, group_advantages
from miles.train.args import ArgsError, parse_args
from miles.train.backends import BackendUnavailable
from miles.train.batch import Sample, TokenBatch, collate, load_samples, save_samples
from miles.train.data import SYNTHETIC_PREFIX, DataError, batch_for_rollout
from miles.train.distributed import all_gather_objects, all_reduce_sum, barrier, sampling_seed, shutdown
from miles.train.model import ModelLoadError
from miles.train.rewards import RewardError
from miles.train.rollout import RolloutEngineError
from miles.train.runtime import Run, build_run, dry_start
from miles.train.sglang_engine import SGLangUnavailable

# Errors whose message names the file or flag, the rule and the fix: one line and exit 1.
FOR_PEOPLE = (
    ArgsError,
    BackendUnavailable,
    checkpoint.CheckpointError,
    checks.CheckFailed,
    DataError,
    guards.NonFiniteTraining,
    ModelLoadError,
    RewardError,
    RolloutEngineError,
    SGLangUnavailable,
)


def train(run: Run) -> None:
    """The loop of this module's docstring, from the first rollout not yet done to --num-rollout."""
    args = run.args
    eval_sets = evaluation.eval_sets(args)
    watched: dict[int, float] = {}  # --ci-metric-checker-key's values by rollout
    for rollout_id in range(run.start_rollout, args.num_rollout):
        started = time.perf_counter()
        samples = generate_and_score(run, rollout_id)  # 1 rollout, 2 reward
        samples = with_advantages(run, samples)  # 3 advantage
        metrics = report.rollout_metrics(
            samples, time.perf_counter() - started, exact=args.prompt_data.startswith(SYNTHETIC_PREFIX)
        )
        if not args.debug_rollout_only:
            metrics |= learn(run, rollout_id, samples)  # 4 loss and optimizer steps
            metrics |= sync_weights(run, rollout_id)  # 5 sync
        metrics["perf/step_time"] = time.perf_counter() - started
        if evaluation.due(args, rollout_id):
            metrics |= evaluation.evaluate(run, eval_sets, rollout_id)
        if run.dist.is_main:
            report.record(rollout_id, metrics)
            run.log(report.console_line(rollout_id, args.num_rollout, metrics))
        if args.ci_metric_checker_key in metrics:
            watched[rollout_id] = metrics[args.ci_metric_checker_key]
        maybe_save(run, rollout_id)
    if args.ci_metric_checker_key:
        checks.check_metric_threshold(args.ci_metric_checker_key, watched, args.ci_metric_checker_threshold)


def generate_and_score(run: Run, rollout_id: int) -> list[Sample]:
    """This rank's share of the prompts, G samples each, scored; then every rank's, in order."""
    args, rank, world = run.args, run.dist.rank, run.dist.world_size
    if args.load_debug_rollout_data:
        return load_samples(args.load_debug_rollout_data.format(rollout_id=rollout_id))
    prompts = batch_for_rollout(
        run.prompts, rollout_id, args.rollout_batch_size, seed=args.seed, shuffle=args.rollout_shuffle
    )
    per_rank = len(prompts) // world
    mine = prompts[rank * per_rank : (rank + 1) * per_rank]
    group_size = args.n_samples_per_prompt
    requests = [run.encode(p) for p in mine for _ in range(group_size)]
    generations = run.engine.generate(
        requests, run.sampling, seed=sampling_seed(args.rollout_seed, rollout_id, rank)
    )
    samples = []
    for i, generation in enumerate(generations):
        prompt = mine[i // group_size]
        text, reward = run.score(prompt, generation, i % group_size)
        samples.append(
            Sample(prompt.index, rank * per_rank + i // group_size, generation, text, prompt.label, reward)
        )
    gathered = [s for part in all_gather_objects(samples) for s in part]
    if args.save_debug_rollout_data and run.dist.is_main:
        save_samples(args.save_debug_rollout_data.format(rollout_id=rollout_id), gathered)
    return gathered


def with_advantages(run: Run, samples: Sequence[Sample]) -> list[Sample]:
    """Step 3: each sample's advantage within its group of --n-samples-per-prompt."""
    rewards = torch.tensor([s.reward for s in samples])
    normalize_std = not run.args.disable_grpo_std_normalization
    advantages = group_advantages(
        rewards, run.args.n_samples_per_prompt, normalize_std=normalize_std
    ).tolist()
    return [replace(s, advantage=a) for s, a in zip(samples, advantages, strict=True)]


def learn(run: Run, rollout_id: int, samples: Sequence[Sample]) -> dict[str, float]:
    """Step 4: old (and reference) logprobs of this rank's share, then one optimizer step per
    minibatch of --global-batch-size samples (split over ranks and micro-batches)."""
    args = run.args
    started = time.perf_counter()
    run.engine.release_memory()  # a colocated engine gives the GPU to the trainer until the sync
    per_rank = args.global_batch_size // run.backend.data_parallel[1]
    local, mismatch = with_old_logprobs(run, share_of_rank(run, samples))
    if args.ci_test and not args.use_rollout_logprobs:
        checks.check_logprob_agreement(
            rollout_id, mismatch["train/train_rollout_logprob_abs_diff"], args.ci_logprob_abs_diff_tol
        )
    steps = []
    for m in range(len(samples) // args.global_batch_size):
        steps.append(optimizer_step(run, local.rows(slice(m * per_rank, (m + 1) * per_rank))))
        step = steps[-1]
        run.skipped_streak.record(rollout_id, step["skipped"], step["loss"], step["grad_norm"], step["lr"])
        if m == 0 and args.ci_test and not args.ci_disable_kl_checker:
            kl, clipfrac, tokens = steps[0]["ppo_kl"], steps[0]["pg_clipfrac"], steps[0]["tokens"]
            checks.check_first_step(rollout_id, kl / tokens, clipfrac / tokens, args.ci_step0_kl_tol)
    metrics = report.train_metrics(steps, args.use_tis)
    metrics["train/skipped_steps"] = float(sum(step["skipped"] for step in steps))
    return metrics | mismatch | {"perf/train_time": time.perf_counter() - started}


def share_of_rank(run: Run, samples: Sequence[Sample]) -> TokenBatch:
    """This data-parallel rank's rows of every minibatch, minibatch after minibatch (strided, so
    groups spread); model-parallel peers get the same rows."""
    gbs = run.args.global_batch_size
    rank, size, _ = run.backend.data_parallel
    mine = [m * gbs + i for m in range(len(samples) // gbs) for i in range(rank, gbs, size)]
    return collate([samples[i] for i in mine], run.tokenizer.pad_token_id or 0)


def with_old_logprobs(run: Run, local: TokenBatch) -> tuple[TokenBatch, dict[str, float]]:
    """The batch with old (and reference) logprobs, and how far the rollout engine's are from
    the trainer's: mean |diff| and KL(rollout || trainer), over every data-parallel rank's tokens."""
    args = run.args
    trainer_logp = batched_logprobs(run, local, reference=False)
    ref_logp = batched_logprobs(run, local, reference=True) if args.use_kl_loss else None
    old_logp = local.rollout_logp if args.use_rollout_logprobs else trainer_logp
    mask = local.loss_mask
    diff_sum, kl_sum, tokens = all_reduce_sum(
        [
            float(((trainer_logp - local.rollout_logp).abs() * mask).sum()),
            float(((local.rollout_logp - trainer_logp) * mask).sum()),
            float(mask.sum()),
        ],
        group=run.backend.data_parallel[2],
    )
    mismatch = {
        "train/train_rollout_logprob_abs_diff": diff_sum / tokens,
        "train/train_rollout_kl": kl_sum / tokens,
    }
    return local.with_(old_logp=old_logp, ref_logp=ref_logp), mismatch


def optimizer_step(run: Run, minibatch: TokenBatch) -> dict[str, float]:
    """One AdamW step on this rank's part of a minibatch; loss terms summed over the data-parallel ranks."""
    args = run.args
    _, replicas, group = run.backend.data_parallel
    size = minibatch.size
    micro = [
        minibatch.rows(slice(i, i + args.micro_batch_size)) for i in range(0, size, args.micro_batch_size)
    ]
    # Each rank's loss is divided so that the data-parallel gradient average is the mean over
    # the global minibatch: per sample by default, per token with --calculate-per-token-loss.
    if args.calculate_per_token_loss:
        normalizer = all_reduce_sum([float(minibatch.loss_mask.sum())], group)[0] / replicas
    else:
        normalizer = size
    result = run.backend.train_step(micro, normalizer)
    local = [sum(getattr(t, k) for t in result.terms) for k in LOSS_SUMS]
    loss = sum(float(t.loss.detach()) for t in result.terms) / normalizer
    reduced = dict(zip([*LOSS_SUMS, "loss"], all_reduce_sum([*local, loss], group), strict=True))
    reduced["loss"] /= replicas
    return reduced | {"grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped}


def batched_logprobs(run: Run, batch: TokenBatch, *, reference: bool) -> torch.Tensor:
    """Logprobs of a whole local batch, computed --micro-batch-size rows at a time."""
    return run.backend.batch_logprobs(batch, run.args.micro_batch_size, reference=reference)


def sync_weights(run: Run, rollout_id: int) -> dict[str, float]:
    """Step 5: the rollout engine gets the trainer's new weights; with --ci-test, verified."""
    if (rollout_id + 1) % run.args.update_weights_interval:
        return {}
    started = time.perf_counter()
    check = run.args.ci_test or run.args.check_weight_update_equal
    stream = run.backend.full_weights(names=run.engine.weight_names)
    # Only a bit-exact check needs every tensor at once; otherwise they stream to the engine.
    weights = dict(stream) if check and run.engine.exact_weights else None
    run.engine.update_weights(weights.items() if weights is not None else stream)
    elapsed = time.perf_counter() - started
    if check:
        verify_weight_sync(run, rollout_id, weights)
    return {"perf/weight_sync_time": elapsed}


def verify_weight_sync(run: Run, rollout_id: int, weights: dict[str, torch.Tensor] | None) -> None:
    """The engine holds the trainer's weights, on every rank; all ranks fail together. Bit for
    bit where the engine exposes its tensors, else by the logprobs of fixed sequences."""
    failure = None
    try:
        if run.engine.exact_weights:
            checks.check_weights_equal(
                rollout_id, run.engine.named_weights(), weights, run.args.check_weight_update_skip_list
            )
        else:
            gap = checks.probe_logprob_gap(run.engine, run.backend, probe_prompts(run), run.sampling)
            checks.check_probe_logprobs(rollout_id, gap, run.args.ci_logprob_abs_diff_tol)
    except checks.CheckFailed as exc:
        failure = exc
    # Every rank must stop together, or the healthy ones would wait in the next collective.
    if all_reduce_sum([float(failure is not None)])[0]:
        raise failure or checks.CheckFailed(f"rollout {rollout_id}: the weight check failed on another rank")


def probe_prompts(run: Run) -> list[list[int]]:
    """The fixed sequences of the logprob weight check: the first prompts of the data set."""
    return [run.encode(p) for p in run.prompts[: checks.PROBE_PROMPTS]]


def maybe_save(run: Run, rollout_id: int) -> None:
    """--save every --save-interval rollouts and after the last one."""
    args, done = run.args, rollout_id + 1
    if not args.save or args.debug_rollout_only:
        return
    if done != args.num_rollout and not (args.save_interval and done % args.save_interval == 0):
        return
    state = checkpoint.state_of(args, done)
    path = checkpoint.save(run.backend, args.save, state, is_main=run.dist.is_main, barrier=barrier)
    run.log(f"miles.train: saved {path}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.dry_start:
            dry_start(args)
            return 0
        run = build_run(args)
        train(run)
    except FOR_PEOPLE as exc:
        print(f"miles.train: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown()
    return 0
