"""`python -m miles.train`: group-relative policy optimisation (or PPO), one rollout per iteration.

    for rollout k = start .. num_rollout-1:
        1. rollout    for each prompt of the batch, sample G responses with the current policy
        2. reward     score each response with the rule (--rm-type)
        3. advantage  A_i = (r_i - mean(r_group)) / std(r_group); PPO: GAE over the critic's
                      values of each response token (miles.train.critic)
        4. learn      for each minibatch: clipped policy loss (+ KL to the reference,
                      - entropy bonus), AdamW step with gradient clipping; PPO: a value step
                      of the critic too (alone for the first --num-critic-only-steps rollouts)
        5. sync       push the new weights to the rollout engine
        evaluate every --eval-interval rollouts; log the metrics; save every --save-interval

With --fully-async, steps 1-2 run in a persistent worker (miles.train.async_rollout) that
generates rollout k+1 while step 4 of rollout k trains; the loss's truncated importance ratio
(--use-tis) corrects for the behaviour policy's older weights.

Ranks split the prompts for step 1-2, gather the samples, and split them again for step 4
(data parallel, FSDP2 or DDP). The machinery lives in runtime.py (setup), checks.py,
checkpoint.py and report.py; this file is the algorithm.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

import torch

from miles import children, phases
from miles.metrics.capture import RecordDirError
from miles.train import checkpoint, checks, critic, evaluation, guards, report
from miles.train.algorithm import LOSS_SUMS, group_advantages
from miles.train.args import ArgsError, parse_config
from miles.train.async_rollout import AsyncRollouts
from miles.train.backends import BackendUnavailable
from miles.train.batch import Sample, TokenBatch, collate, executions, load_samples, save_samples
from miles.train.config import step_sizes
from miles.train.data import SYNTHETIC_PREFIX, DataError, batch_for_rollout
from miles.train.distributed import (
    all_gather_objects,
    all_reduce_sum,
    barrier,
    current_rank,
    sampling_seed,
    shutdown,
)
from miles.train.dumps import FWD_BWD, FWD_ONLY
from miles.train.inputs import CheckpointRefused
from miles.train.model import ModelLoadError
from miles.train.rewards import RewardError
from miles.train.rollout import RolloutEngineError, weights_for
from miles.train.routing_replay import RoutingReplayError
from miles.train.runtime import Run, build_run, dry_start
from miles.train.sglang_engine import SGLangUnavailable

# Errors whose message names the file or flag, the rule and the fix: one line and exit 1.
FOR_PEOPLE = (
    ArgsError,
    RecordDirError,
    BackendUnavailable,
    checkpoint.CheckpointError,
    CheckpointRefused,
    checks.CheckFailed,
    DataError,
    guards.NonFiniteTraining,
    ModelLoadError,
    RewardError,
    RolloutEngineError,
    RoutingReplayError,
    SGLangUnavailable,
)


def train(run: Run) -> None:
    """The loop of this module's docstring, from the first rollout not yet done to --num-rollout."""
    cfg, checked = run.config, run.config.checks
    eval_sets = evaluation.eval_sets(cfg.eval, cfg.data)
    watched: dict[int, float] = {}  # --ci-metric-checker-key's values by rollout
    if evaluation.due_before_training(cfg.eval):
        evaluation.before_training(run, eval_sets)
    # --fully-async: a persistent worker generates step k+1 while step k trains
    run.async_rollouts = AsyncRollouts(run) if cfg.engines.fully_async else None
    for rollout_id in range(run.start_rollout, cfg.rollout.num_rollout):
        started = time.perf_counter()
        run.backend.sleep()  # --offload-train: the trainer's state off the device while the engine generates
        if run.critic is not None:
            run.critic.sleep()  # PPO's critic too
        with phases.phase(phases.ROLLOUT), report.peak_host_memory() as peak:
            samples = generate_and_score(run, rollout_id)  # 1 rollout, 2 reward
        samples = with_advantages(run, samples)  # 3 advantage
        metrics = report.rollout_metrics(
            samples, time.perf_counter() - started, exact=cfg.data.prompt_data.startswith(SYNTHETIC_PREFIX)
        )
        metrics |= peak
        if run.engine is not None:  # --debug-train-only replays rollouts: no engine generated them
            metrics |= run.engine.rollout_metrics()
        if run.async_rollouts is not None:
            metrics |= run.async_rollouts.metrics()
        if not checked.debug_rollout_only:
            with phases.phase(phases.TRAIN):
                metrics |= learn(run, rollout_id, samples)  # 4 loss and optimizer steps
            if not critic.policy_waits(run, rollout_id):
                metrics |= sync_weights(run, rollout_id)  # 5 sync
        metrics["perf/step_time"] = time.perf_counter() - started
        if evaluation.due(cfg.eval, rollout_id):
            metrics |= evaluation.evaluate(run, eval_sets, rollout_id)
        if run.dist.is_main:
            report.record(rollout_id, metrics)
            run.log(report.console_line(rollout_id, cfg.rollout.num_rollout, metrics))
        if checked.ci_metric_checker_key in metrics:
            watched[rollout_id] = metrics[checked.ci_metric_checker_key]
        with phases.phase(phases.TRAIN):
            maybe_save(run, rollout_id)
    if run.async_rollouts is not None:
        run.async_rollouts.close()
    if checked.ci_metric_checker_key:
        checks.check_metric_threshold(
            checked.ci_metric_checker_key, watched, checked.ci_metric_checker_threshold
        )


def generate_and_score(run: Run, rollout_id: int) -> list[Sample]:
    """The rollout's samples, scored, on every rank: each rank's share of the prompts, G samples
    each, gathered in order; or, fully async, the groups the persistent worker finished."""
    cfg = run.config
    if cfg.checks.load_debug_rollout_data:
        return load_samples(cfg.checks.load_debug_rollout_data.format(rollout_id=rollout_id))
    if run.async_rollouts is not None:
        gathered = run.async_rollouts.batch(rollout_id)
    else:
        gathered = [s for part in all_gather_objects(sample_share(run, rollout_id)) for s in part]
    if cfg.checks.save_debug_rollout_data and run.dist.is_main:
        save_samples(cfg.checks.save_debug_rollout_data.format(rollout_id=rollout_id), gathered)
    if cfg.checks.ci_test:  # every request answered once, whichever engine answered it
        rollout = cfg.rollout
        checks.check_rollout_complete(
            rollout_id, gathered, rollout.rollout_batch_size, rollout.n_samples_per_prompt
        )
    return gathered


def sample_share(run: Run, rollout_id: int) -> list[Sample]:
    """This rank's share of the rollout's prompts, G samples each, scored."""
    cfg, rank, world = run.config, run.dist.rank, run.dist.world_size
    prompts = batch_for_rollout(
        run.prompts,
        rollout_id,
        cfg.rollout.rollout_batch_size,
        seed=cfg.job.seed,
        shuffle=cfg.data.rollout_shuffle,
    )
    per_rank = len(prompts) // world
    mine = prompts[rank * per_rank : (rank + 1) * per_rank]
    group_size = cfg.rollout.n_samples_per_prompt
    requests = [run.encode(p) for p in mine for _ in range(group_size)]
    seed = sampling_seed(cfg.rollout.rollout_seed, rollout_id, rank)
    executions = run.generate(requests, seed)  # the pieces each request is trained as (usually one)
    asked = [mine[i // group_size] for i in range(len(executions))]
    # each execution scored whole (its last piece); on-policy distillation's per-token signal too
    scored = run.score_all(asked, [pieces[-1].generation for pieces in executions], group_size)
    samples = []
    for i, (prompt, pieces, (text, reward, signal)) in enumerate(zip(asked, executions, scored, strict=True)):
        if signal is not None and len(pieces) > 1:
            raise RolloutEngineError(
                f"--custom-generate-function-path {cfg.rollout.custom_generate_function_path} split request {i} "
                f"into {len(pieces)} samples, but on-policy distillation's teacher scores each token of one "
                "sample; run distillation with the default generate function"
            )
        group = rank * per_rank + i // group_size
        for piece in pieces:
            samples.append(
                Sample(prompt.index, group, piece.generation, text, prompt.label, reward, opd_reverse_kl=signal,
                       execution=rank * len(requests) + i, siblings=len(pieces), loss_mask=piece.loss_mask)
            )  # fmt: skip
    return samples


def with_advantages(run: Run, samples: Sequence[Sample]) -> list[Sample]:
    """Step 3: each execution's advantage within its group of --n-samples-per-prompt (the samples
    an execution was split into share it; PPO's come from the critic's values of each token, in
    `learn`)."""
    if run.critic is not None:
        return list(samples)
    by_execution = executions(samples)
    rewards = torch.tensor([samples[e[0]].reward for e in by_execution])
    normalize_std = not run.config.algorithm.disable_grpo_std_normalization
    advantages = group_advantages(
        rewards, run.config.rollout.n_samples_per_prompt, normalize_std=normalize_std
    ).tolist()
    out = list(samples)
    for execution, advantage in zip(by_execution, advantages, strict=True):
        for i in execution:
            out[i] = replace(samples[i], advantage=advantage)
    return out


def learn(run: Run, rollout_id: int, samples: Sequence[Sample]) -> dict[str, float]:
    """Step 4: old (and reference) logprobs of this rank's share, then one optimizer step per
    minibatch of --global-batch-size samples (split over ranks and micro-batches).

    The first minibatch is trained on the very weights its old logprobs would be computed with
    (no step comes between), so where the backend's training forward is deterministic, that
    forward's own detached logprobs are the old ones (the ratio is exactly 1) and it gets no
    separate old-logprob forward. The trainer/rollout mismatch then comes from the same
    forward; --ci-test still runs the separate forward and checks the two against each other."""
    cfg, checked = run.config, run.config.checks
    started = time.perf_counter()
    if run.engine is not None and run.engine.colocated:
        run.engine.release_memory()  # it gives the GPU to the trainer until the sync
    run.backend.wake_up()  # --offload-train: the trainer's state back, once the engine's memory is free
    if run.critic is not None:
        run.critic.wake_up()
    local, plan = share_of_rank(run, samples)
    local, values = per_token_advantages(run, local, plan)
    if critic.policy_waits(run, rollout_id):
        steps = [
            critic.value_step(run, micro, normalizer_of(run, micro)) for micro in minibatches(local, plan)
        ]
        return values | critic.value_metrics(steps) | {"perf/train_time": time.perf_counter() - started}
    # the fwd_only dump is of the logprob forward, so it runs even where the training forward's could stand in
    reuse = run.backend.forward_is_deterministic and not dumping(run, FWD_ONLY)
    own_old = reuse and not cfg.algorithm.use_rollout_logprobs  # else the engine's are the old ones
    with dumped(run, FWD_ONLY, rollout_id):
        local, trainer_logp = with_old_logprobs(run, local, plan, skip_first=reuse and not checked.ci_test)
    steps, value_steps, mismatch = [], [], {}
    with dumped(run, FWD_BWD, rollout_id):
        for m, micro in enumerate(plan):
            batches = [local.rows(rows) for rows in micro]
            if run.critic is not None:
                value_steps.append(critic.value_step(run, batches, normalizer_of(run, batches)))
            if m == 0 and own_old:
                batches = [mb.with_(old_logp=None) for mb in batches]  # the forward's own (batch_loss)
            step, logprobs = optimizer_step(run, batches)
            if m == 0 and reuse and not checked.ci_test:
                trainer_logp = with_rows(trainer_logp, micro, logprobs)
            elif m == 0 and own_old:
                step |= first_step_against_scoring(
                    run, batches, logprobs, [trainer_logp[rows] for rows in micro]
                )
            steps.append(step)
            run.step_record(rollout_id, m, step)
            run.skipped_streak.record(
                rollout_id, step["skipped"], step["loss"], step["grad_norm"], step["lr"]
            )
            if m == 0:
                mismatch = rollout_mismatch(run, local, trainer_logp)
                checked_first_step(run, rollout_id, step, mismatch)
    metrics = report.train_metrics(steps, cfg.algorithm.use_tis)
    metrics["train/skipped_steps"] = float(sum(step["skipped"] for step in steps))
    metrics["train/optimizer_steps"] = float(len(steps))
    metrics["perf/micro_batches_per_step"] = sum(map(len, plan)) / len(plan)
    if value_steps:
        metrics |= values | critic.value_metrics(value_steps)
    return metrics | mismatch | {"perf/train_time": time.perf_counter() - started}


def dumping(run: Run, phase: str) -> bool:
    return run.dumper is not None and run.dumper.wants(phase)


def dumped(run: Run, phase: str, rollout_id: int):
    """--dumper-enable: the policy's forwards inside the block dumped as `phase` (miles.train.dumps)."""
    if not dumping(run, phase):
        return contextlib.nullcontext()
    return run.dumper.phase(phase, rollout_id, run.backend.dump_chunks())


def per_token_advantages(
    run: Run, local: TokenBatch, plan: Sequence[Sequence[Sequence[int]]]
) -> tuple[TokenBatch, dict[str, float]]:
    """PPO: the advantages, returns and old values of each response token from the critic (and
    its explained variance); on-policy distillation: less --opd-kl-coef times each token's reverse
    KL to the teacher; with --normalize-advantages, whitened over every rank's tokens."""
    metrics: dict[str, float] = {}
    algorithm = run.config.algorithm
    if run.critic is not None:
        local, metrics = critic.with_gae(run, local, plan, local.rewards)
    if algorithm.use_opd:  # each token's advantage less its reverse KL to the teacher (distillation)
        advantages = local.advantages
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1).expand_as(local.loss_mask)
        local = local.with_(
            advantages=(advantages - algorithm.opd_kl_coef * local.opd_reverse_kl) * local.loss_mask
        )
    if algorithm.normalize_advantages:
        local = critic.whitened(run, local)
    return local, metrics


def minibatches(local: TokenBatch, plan: Sequence[Sequence[Sequence[int]]]) -> list[list[TokenBatch]]:
    """Each minibatch of the plan as its micro-batches."""
    return [[local.rows(rows) for rows in micro] for micro in plan]


def share_of_rank(run: Run, samples: Sequence[Sample]) -> tuple[TokenBatch, list[list[list[int]]]]:
    """This data-parallel rank's rows of every minibatch (--global-batch-size samples, the last
    one smaller with --allow-partial-train-step), minibatch after minibatch, and each minibatch's
    micro-batches (lists of rows of the returned batch) as the backend cuts them;
    model-parallel peers get the same rows and micro-batches."""
    batch = run.config.batch
    partial = batch.allow_partial_train_step and batch.disable_rollout_trim_samples
    by_execution = executions(samples)  # steps count executions: an execution's samples stay in one
    mine: list[int] = []
    plan = []
    start = 0
    for size in step_sizes(len(by_execution), batch.global_batch_size, partial=partial):
        members = [i for execution in by_execution[start : start + size] for i in execution]
        lengths = [
            len(samples[i].generation.prompt_ids) + len(samples[i].generation.response_ids) for i in members
        ]
        rows, micro = run.backend.split_minibatch(lengths)
        plan.append([[len(mine) + i for i in part] for part in micro])
        mine += [members[i] for i in rows]
        start += size
    return collate([samples[i] for i in mine], run.tokenizer.pad_token_id or 0), plan


def with_old_logprobs(
    run: Run, local: TokenBatch, plan: Sequence[Sequence[Sequence[int]]], *, skip_first: bool = False
) -> tuple[TokenBatch, torch.Tensor]:
    """The batch with old (and reference) logprobs, and the trainer's own logprobs of it: each
    minibatch's micro-batches of `plan` scored together, exactly as its training step gets them.
    With `skip_first` the first minibatch is not scored (zeros): its training forward gives them
    (see `learn`)."""
    algorithm = run.config.algorithm
    trainer_logp = batched_logprobs(run, local, plan[1:] if skip_first else plan, reference=False)
    ref_logp = batched_logprobs(run, local, plan, reference=True) if algorithm.use_kl_loss else None
    old_logp = local.rollout_logp if algorithm.use_rollout_logprobs else trainer_logp
    return local.with_(old_logp=old_logp, ref_logp=ref_logp), trainer_logp


def rollout_mismatch(run: Run, local: TokenBatch, trainer_logp: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's logprobs are from the trainer's (before any step of the
    rollout): mean |diff| and KL(rollout || trainer), over every data-parallel rank's tokens."""
    mask = local.loss_mask
    diff_sum, kl_sum, tokens = all_reduce_sum(
        [
            float(((trainer_logp - local.rollout_logp).abs() * mask).sum()),
            float(((local.rollout_logp - trainer_logp) * mask).sum()),
            float(mask.sum()),
        ],
        group=run.backend.data_parallel[2],
    )
    return {
        "train/train_rollout_logprob_abs_diff": diff_sum / tokens,
        "train/train_rollout_kl": kl_sum / tokens,
    }


def checked_first_step(run: Run, rollout_id: int, step: dict[str, float], mismatch: dict[str, float]) -> None:
    """--ci-test's checks of a rollout's first step: the trainer's logprobs agree with the rollout
    engine's, and the policy ratio was 1 (the old logprobs came from the weights being trained)."""
    cfg, checked = run.config, run.config.checks
    if not checked.ci_test:
        return
    # a fully-async batch made (in part) by older weights differs from the trainer's by design
    fresh = run.async_rollouts is None or run.async_rollouts.fresh
    if not cfg.algorithm.use_rollout_logprobs and fresh:
        checks.check_logprob_agreement(
            rollout_id, mismatch["train/train_rollout_logprob_abs_diff"], checked.ci_logprob_abs_diff_tol
        )
    if not checked.ci_disable_kl_checker:
        kl, clipfrac, tokens = step["ppo_kl"], step["pg_clipfrac"], step["tokens"]
        checks.check_first_step(rollout_id, kl / tokens, clipfrac / tokens, checked.ci_step0_kl_tol)


def first_step_against_scoring(
    run: Run, batches: Sequence[TokenBatch], trained: Sequence[torch.Tensor], scored: Sequence[torch.Tensor]
) -> dict[str, float]:
    """ppo_kl and pg_clipfrac of the first step as the separate old-logprob forward (`scored`)
    sees the training forward's logprobs (`trained`), summed over the data-parallel ranks: what
    the step reports when its old logprobs come from a forward of their own."""
    from miles.train.algorithm import policy_loss

    cfg = run.config
    # the two statistics read no reference or rollout logprobs
    loss_cfg = replace(
        cfg.algorithm.loss_config(cfg.rollout.rollout_temperature), use_kl_loss=False, use_tis=False
    )
    kl = clipfrac = 0.0
    for mb, logp, old in zip(batches, trained, scored, strict=True):
        width = logp.shape[1]
        terms = policy_loss(
            logp, torch.zeros_like(logp), old[:, :width], mb.advantages, mb.loss_mask[:, :width], loss_cfg
        )
        kl, clipfrac = kl + terms.ppo_kl, clipfrac + terms.pg_clipfrac
    kl, clipfrac = all_reduce_sum([kl, clipfrac], run.backend.data_parallel[2])
    return {"ppo_kl": kl, "pg_clipfrac": clipfrac}


def optimizer_step(
    run: Run, micro: Sequence[TokenBatch]
) -> tuple[dict[str, float], tuple[torch.Tensor, ...]]:
    """One AdamW step on this rank's micro-batches of a minibatch; loss terms summed over the
    data-parallel ranks. Also each micro-batch's logprobs from the training forward."""
    _, replicas, group = run.backend.data_parallel
    normalizer = normalizer_of(run, micro)
    result = run.backend.train_step(micro, normalizer)
    local = [sum(getattr(t, k) for t in result.terms) for k in LOSS_SUMS]
    loss = sum(float(t.loss.detach()) for t in result.terms) / normalizer
    reduced = dict(zip([*LOSS_SUMS, "loss"], all_reduce_sum([*local, loss], group), strict=True))
    reduced["loss"] /= replicas
    step = reduced | {"grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped}
    return step, result.logprobs


def normalizer_of(run: Run, micro: Sequence[TokenBatch]) -> float:
    """What each rank divides its loss by so that the data-parallel gradient average is the mean
    over the minibatch's own samples (a partial step's too, as the seed framework normalises by
    a step's true count), or its tokens with --calculate-per-token-loss."""
    _, replicas, group = run.backend.data_parallel
    if run.config.algorithm.calculate_per_token_loss:
        count = sum(float(mb.loss_mask.sum()) for mb in micro)
    else:  # executions, not samples: an execution split into k samples weighs 1/k each
        count = sum(float(mb.size) if mb.weights is None else float(mb.weights.sum()) for mb in micro)
    return all_reduce_sum([count], group)[0] / replicas


def batched_logprobs(
    run: Run, local: TokenBatch, plan: Sequence[Sequence[Sequence[int]]], *, reference: bool
) -> torch.Tensor:
    """Logprobs [B, T-1] of the local batch's rows in `plan`'s minibatches (zeros elsewhere): one
    call per minibatch, with the micro-batches its training step gets, in the same shapes."""
    out = torch.zeros_like(local.loss_mask)
    for micro in plan:
        _write_rows(
            out, micro, run.backend.batch_logprobs([local.rows(r) for r in micro], reference=reference)
        )
    return out


def with_rows(
    out: torch.Tensor, micro: Sequence[Sequence[int]], values: Sequence[torch.Tensor]
) -> torch.Tensor:
    """A copy of `out` [B, T-1] with each micro-batch's values [rows, width-1] in its rows."""
    out = out.clone()
    _write_rows(out, micro, values)
    return out


def _write_rows(out: torch.Tensor, micro: Sequence[Sequence[int]], values: Sequence[torch.Tensor]) -> None:
    for rows, value in zip(micro, values, strict=True):
        out[torch.as_tensor(list(rows), dtype=torch.long), : value.shape[1]] = value.to(out.dtype)


def sync_weights(run: Run, rollout_id: int) -> dict[str, float]:
    """Step 5: the rollout engine gets the trainer's new weights; with --ci-test, verified (no
    engine under --debug-train-only: the rollouts are replayed)."""
    if run.engine is None or (rollout_id + 1) % run.config.rollout.update_weights_interval:
        return {}
    started = time.perf_counter()
    check = run.config.checks.ci_test or run.config.checks.check_weight_update_equal
    stream = weights_for(run.engine, run.backend)
    # Only a bit-exact check needs every tensor at once; otherwise they stream to the engine.
    exact = run.engine.exact_weights or run.engine.checksummed
    weights = dict(stream) if check and exact else None
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
        skip = run.config.checks.check_weight_update_skip_list
        if run.engine.exact_weights:
            checks.check_weights_equal(rollout_id, run.engine.named_weights(), weights, skip)
        elif run.engine.checksummed:
            checks.check_weight_checksums(rollout_id, run.engine.weight_checksums(), weights, skip)
        else:
            gap = checks.probe_logprob_gap(run.engine, run.backend, probe_prompts(run), run.sampling)
            checks.check_probe_logprobs(rollout_id, gap, run.config.checks.ci_logprob_abs_diff_tol)
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
    cfg, done = run.config, rollout_id + 1
    ckpt = cfg.checkpoint
    if not ckpt.save or cfg.checks.debug_rollout_only:
        return
    if done != cfg.rollout.num_rollout and not (ckpt.save_interval and done % ckpt.save_interval == 0):
        return
    state = checkpoint.state_of(cfg, done)
    hashes = checkpoint.model_hashes(run.backend) if cfg.checks.ci_save_model_hash else None
    path = checkpoint.save(
        run.backend,
        ckpt.save,
        state,
        is_main=run.dist.is_main,
        barrier=barrier,
        hashes=hashes,
        critic=run.critic,
    )
    run.log(f"miles.train: saved {path}")


def main(argv: Sequence[str] | None = None) -> int:
    children.arm()  # what the run forks (checkpoint writers) dies with it, even on SIGKILL
    phases.started()
    config = parse_config(argv)
    try:
        if config.checks.dry_start:
            with phases.phase(phases.INIT):
                dry_start(config)
            return 0
        with phases.phase(phases.INIT):
            run = build_run(config)
        train(run)
    except FOR_PEOPLE as exc:
        # An error every rank raises alike is said once, by rank 0.
        if not getattr(exc, "same_on_every_rank", False) or current_rank() == 0:
            print(f"miles.train: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        with phases.phase(phases.TEARDOWN):
            shutdown()
    return 0
