"""The command line of `python -m miles.train`: built from the sections' flags, parsed, validated.

Every flag is a field of one section of `miles.train.config` (the one list of every flag, by
concern); the parser here adds them, section by section, with argparse's keywords the fields
declare. Megatron model and performance flags are parsed for every backend, so a typo in one
is still an error (which flags a run's backend and engine act on: miles.train.consumption).
`--sglang-<name> [values]` is passed through to the SGLang engine unchanged, because SGLang's
own server arguments are its source of truth.

`parse_args(argv)` returns the validated namespace and `parse_config(argv)` the `RunConfig`
built from it, which is what the trainer, backends and engines take. Standard library only:
recipes and tests parse commands without importing torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from miles.parallel import ParallelLayout
from miles.train.config import FLAGS, SECTIONS, SGLANG_PREFIX, RunConfig, flags_set

PPO_FLAGS = (
    "--gamma", "--lambd", "--value-clip", "--critic-lr", "--critic-lr-warmup-iters", "--num-critic-only-steps",
)  # fmt: skip


class ArgsError(ValueError):
    """A flag value breaks a rule; the message names the flag(s), the rule and a fix."""

    same_on_every_rank = True  # every rank parses the same command


def launched_rank() -> int:
    """This process's rank as the launcher set it (0 when run directly), before any process group."""
    import os

    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class _Parser(argparse.ArgumentParser):
    raising = False  # True: a bad command is an ArgsError (a recipe checking what it renders)

    def error(self, message: str):
        if self.raising:
            raise ArgsError(message)
        # The full usage of ~235 flags would bury the one line that matters, and every rank parses
        # the same command, so only the first says it.
        text = f"{self.prog}: error: {message}\n(python -m miles.train --help lists every flag)\n"
        self.exit(2, text if launched_rank() == 0 else None)


def build_parser(*, raising: bool = False) -> argparse.ArgumentParser:
    """The trainer's parser: one argument group per section, one argument per flag field; with
    `raising`, a bad command raises ArgsError instead of exiting."""
    parser = _Parser(
        prog="python -m miles.train",
        description="GRPO/GSPO trainer: rollout, reward, advantage, clipped loss, step, weight sync.",
        epilog="--sglang-<name> [VALUE ...] is passed to the SGLang engine unchanged.",
        allow_abbrev=False,
    )
    parser.raising = raising
    for section in SECTIONS:
        group = parser.add_argument_group(section.title)
        for flag in section.flags():
            group.add_argument(flag.option, **flag.options)
    return parser


def split_sglang_args(
    argv: Sequence[str], known: set[str]
) -> tuple[list[str], dict[str, str | bool | list[str]]]:
    """Take `--sglang-<name> [values]` out of argv (except flags the parser defines itself).

    A flag followed by no value is a switch (True); one value is a string; several are a list.
    """
    rest: list[str] = []
    passthrough: dict[str, str | bool | list[str]] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if name.startswith(SGLANG_PREFIX) and name not in known:
            key = name[len(SGLANG_PREFIX) :].replace("-", "_")
            if eq:
                passthrough[key] = inline
                i += 1
                continue
            values = []
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            passthrough[key] = True if not values else values[0] if len(values) == 1 else values
            continue
        rest.append(token)
        i += 1
    return rest, passthrough


def parse_config(argv: Sequence[str] | None = None, *, raising: bool = False) -> RunConfig:
    """The run's configuration: every section, from validated flags (exits like parse_args, or
    with `raising` raises ArgsError)."""
    return RunConfig.from_namespace(parse_args(argv, raising=raising))


def parse_args(argv: Sequence[str] | None = None, *, raising: bool = False) -> argparse.Namespace:
    """Parse and validate the trainer's flags; exits with argparse's message on a bad flag (with
    `raising`: raises ArgsError with it)."""
    import sys

    parser = build_parser(raising=raising)
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, sglang = split_sglang_args(argv, {f.option for f in FLAGS})
    args = parser.parse_args(rest)
    args.sglang_args = sglang
    args.flags_set = flags_set(args)  # before validate() fills the defaults that follow from others
    try:
        validate(args)
    except ArgsError as exc:
        parser.error(str(exc))
    return args


def validate(args: argparse.Namespace) -> None:
    """Rules that need more than one flag; each message names the flags and a value that fits."""
    if args.eps_clip_high is None:
        args.eps_clip_high = args.eps_clip
    if args.rollout_seed is None:
        args.rollout_seed = args.seed
    samples = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is None:
        args.global_batch_size = samples
    rest = samples % args.global_batch_size
    partial, keep = args.allow_partial_train_step, args.disable_rollout_trim_samples
    if partial and not keep:
        raise ArgsError(
            "--allow-partial-train-step trains the samples past the last whole --global-batch-size, but without "
            "--disable-rollout-trim-samples the rollout is trimmed to whole steps first; add "
            "--disable-rollout-trim-samples"
        )
    if keep and not partial and rest:
        raise ArgsError(
            f"--disable-rollout-trim-samples keeps the {rest} samples past the last whole --global-batch-size "
            f"({args.global_batch_size}), but without --allow-partial-train-step no step trains them; add "
            "--allow-partial-train-step"
        )
    if rest and not partial:
        raise ArgsError(
            f"--rollout-batch-size ({args.rollout_batch_size}) x --n-samples-per-prompt "
            f"({args.n_samples_per_prompt}) = {samples} samples per rollout must be a multiple of "
            f"--global-batch-size ({args.global_batch_size}); e.g. --global-batch-size {samples}, or train the "
            f"last {rest} as a smaller step with --allow-partial-train-step --disable-rollout-trim-samples"
        )
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        raise ArgsError(
            "--use-dynamic-batch-size fills each micro-batch up to a token budget, but no --max-tokens-per-gpu "
            "was given; e.g. --max-tokens-per-gpu 8192"
        )
    if args.use_dynamic_batch_size and "--micro-batch-size" in args.flags_set:
        raise ArgsError(
            f"--micro-batch-size {args.micro_batch_size} has no effect with --use-dynamic-batch-size (micro-batches "
            "hold as many samples as --max-tokens-per-gpu allows); drop one of them"
        )
    ppo_only = [f for f in PPO_FLAGS if f in args.flags_set]
    if ppo_only and args.advantage_estimator != "ppo":
        raise ArgsError(
            f"{' '.join(ppo_only)} configure PPO's critic, which --advantage-estimator {args.advantage_estimator} "
            "does not train; drop them, or use --advantage-estimator ppo"
        )
    lora_only = [f for f in ("--lora-alpha", "--lora-dropout", "--target-modules") if f in args.flags_set]
    if lora_only and args.lora_rank <= 0:
        raise ArgsError(
            f"{' '.join(lora_only)} shape LoRA adapters, but --lora-rank is {args.lora_rank} (no LoRA); "
            "set --lora-rank N or drop them"
        )
    if args.n_samples_per_prompt < 2 and args.advantage_estimator != "ppo":
        raise ArgsError(
            f"--advantage-estimator {args.advantage_estimator} normalises rewards within a group, so "
            f"--n-samples-per-prompt must be >= 2 (got {args.n_samples_per_prompt})"
        )
    if args.eps_clip_c is not None and args.eps_clip_c <= 1.0:
        raise ArgsError(
            f"--eps-clip-c must be > 1 (dual clip bounds the loss at c*|A|), got {args.eps_clip_c}"
        )
    if args.rollout_temperature <= 0:
        raise ArgsError(
            f"--rollout-temperature must be > 0 (got {args.rollout_temperature}); GRPO needs sampled groups"
        )
    if args.kl_coef:
        raise ArgsError(f"--kl-coef {args.kl_coef}: KL in the reward is not supported; use --use-kl-loss")
    _validate_opd(args)
    if args.tis_clip_low > args.tis_clip:
        raise ArgsError(f"--tis-clip-low ({args.tis_clip_low}) must not exceed --tis-clip ({args.tis_clip})")
    if args.train_backend != "megatron":
        model_parallel = {
            "--tensor-model-parallel-size": args.tensor_model_parallel_size,
            "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
            "--context-parallel-size": args.context_parallel_size,
            "--expert-model-parallel-size": args.expert_model_parallel_size,
        }
        wrong = {k: v for k, v in model_parallel.items() if v != 1}
        if wrong:
            shown = ", ".join(f"{k} {v}" for k, v in wrong.items())
            raise ArgsError(
                f"--train-backend {args.train_backend} is data-parallel only, but {shown} was given; "
                "use --train-backend megatron for model parallelism or set them to 1"
            )
    _validate_offload(args)
    sharded_only = {
        "--dp-replicate-size": args.dp_replicate_size > 1,
        "--fsdp-full-params": args.fsdp_full_params,
    }
    given = [flag for flag, on in sharded_only.items() if on]
    if given and args.train_backend != "fsdp":
        raise ArgsError(
            f"{' and '.join(given)} shape(s) how FSDP shards the model, but --train-backend is {args.train_backend}; "
            "use --train-backend fsdp"
        )
    args.layout = _megatron_layout(args) if args.train_backend == "megatron" else ParallelLayout()
    if (args.ci_metric_checker_key is None) != (args.ci_metric_checker_threshold is None):
        raise ArgsError("--ci-metric-checker-key and --ci-metric-checker-threshold go together")
    if args.eval_prompt_data and len(args.eval_prompt_data) % 2:
        raise ArgsError(
            f"--eval-prompt-data takes NAME PATH pairs, got {len(args.eval_prompt_data)} value(s): "
            f"{' '.join(args.eval_prompt_data)}"
        )
    if args.ci_save_model_hash and not args.save:
        raise ArgsError("--ci-save-model-hash writes beside each checkpoint, but no --save was given")
    if args.ci_check_model_hash and not args.load:
        raise ArgsError("--ci-check-model-hash checks the weights --load restores, but no --load was given")
    _validate_async(args)
    _validate_routing_replay(args)
    if args.eval_prompt_data and args.eval_interval is None:
        raise ArgsError(
            f"--eval-prompt-data names {len(args.eval_prompt_data) // 2} eval set(s) but no --eval-interval says when "
            "to score them; add --eval-interval N (they are also scored before the first rollout)"
        )
    if args.eval_interval is not None and not args.eval_prompt_data:
        raise ArgsError(
            f"--eval-interval {args.eval_interval} has no eval set to score; add --eval-prompt-data NAME PATH"
        )
    if args.debug_deterministic_collective and args.overlap_grad_reduce:
        raise ArgsError(
            "--debug-deterministic-collective folds each reduction as it is called, but --overlap-grad-reduce "
            "reduces gradient buckets asynchronously during the backward pass; drop --overlap-grad-reduce"
        )
    if args.load_debug_rollout_data and args.debug_rollout_only:
        raise ArgsError("--load-debug-rollout-data and --debug-rollout-only exclude each other")
    if args.load_debug_rollout_data:
        args.debug_train_only = True  # as in the seed framework: replayed rollouts need no engine
    if args.debug_train_only and not args.load_debug_rollout_data:
        raise ArgsError(
            "--debug-train-only trains with no rollout engine, so it needs saved rollouts: add "
            "--load-debug-rollout-data PATH (written by a run with --save-debug-rollout-data PATH)"
        )
    if args.debug_train_only and args.eval_prompt_data:
        raise ArgsError(
            "--eval-prompt-data needs the rollout engine, which --debug-train-only (or --load-debug-rollout-data) "
            "does not start; drop the evaluation from the replay"
        )
    _validate_dumps(args)
    if args.ci_save_grad_norm and args.ci_save_grad_norm == args.ci_load_grad_norm:
        raise ArgsError(
            f"--ci-save-grad-norm and --ci-load-grad-norm both name {args.ci_save_grad_norm}: the run would check "
            "its steps against what it writes; give the file it writes another name"
        )


def _validate_offload(args: argparse.Namespace) -> None:
    """--offload-train's companions act only with it (or with optimizer streaming); the disk forms
    need a directory (--offload-train-disk-dir, or $SCRATCH)."""
    import os

    train = args.offload_train or args.offload
    disk = args.offload_train_target == "disk"
    if disk and not train:
        raise ArgsError(
            "--offload-train-target disk says where --offload-train puts the trainer's state; add --offload-train"
        )
    if args.stream_optimizer_state_to_disk and train and not disk:
        raise ArgsError(
            "--stream-optimizer-state-to-disk with --offload-train needs --offload-train-target disk: a run whose "
            "optimizer state does not fit the device during the step will not hold a host copy of the whole trainer"
        )
    uses_disk = disk or args.stream_optimizer_state_to_disk
    dangling = [
        f for f in ("--offload-train-disk-dir", "--offload-train-disk-chunk-mb") if f in args.flags_set
    ]
    if dangling and not uses_disk:
        raise ArgsError(
            f"{' '.join(dangling)} shape(s) the disk offload, which this command does not ask for; add "
            "--offload-train --offload-train-target disk or --stream-optimizer-state-to-disk, or drop them"
        )
    if uses_disk and not args.offload_train_disk_dir:
        scratch = os.environ.get("SCRATCH")
        if not scratch:
            raise ArgsError(
                "the disk offload needs a directory: pass --offload-train-disk-dir (a fast local disk; a tmpfs "
                "such as /tmp on many hosts keeps the bytes in memory and defeats it), or set $SCRATCH"
            )
        args.offload_train_disk_dir = os.path.join(scratch, f"miles_train_offload_{os.getuid()}")
    if args.stream_optimizer_state_to_disk and (
        args.optimizer_cpu_offload or args.use_precision_aware_optimizer
    ):
        raise ArgsError(
            "--stream-optimizer-state-to-disk streams the Adam state megatron-core's optimizer keeps in its own "
            "tensors; --optimizer-cpu-offload and --use-precision-aware-optimizer keep it elsewhere: drop one"
        )


ASYNC_FLAGS = (
    "--max-weight-staleness", "--async-data-buffer-capacity-factor", "--async-unused-samples-handler",
    "--async-max-concurrent-samples",
)  # fmt: skip


def _validate_routing_replay(args: argparse.Namespace) -> None:
    """--use-rollout-routing-replay needs the engine in the trainer's processes, which records the
    experts; the engines in processes of their own return none yet."""
    if args.use_rollout_routing_replay and args.rollout_num_gpus and not args.colocate:
        raise ArgsError(
            "--use-rollout-routing-replay with --rollout-num-gpus and no --colocate: the rollout engines in "
            "processes of their own do not return the routed experts yet; colocate the engine (--colocate) or "
            "drop the flag"
        )


def _validate_async(args: argparse.Namespace) -> None:
    """--fully-async needs engines that keep generating while the trainer trains (the seed
    framework's rules, miles/utils/arguments.py at 31f1ca961)."""
    given = [f for f in ASYNC_FLAGS if f in args.flags_set]
    if given and not args.fully_async:
        raise ArgsError(
            f"{' '.join(given)} set the fully asynchronous rollout; add --fully-async or drop them"
        )
    if not args.fully_async:
        return
    if not args.rollout_num_gpus or args.colocate:
        raise ArgsError(
            "--fully-async needs engines on devices of their own (--rollout-num-gpus N without --colocate): "
            "the rollout keeps generating while the trainer trains"
        )
    if args.custom_generate_function_path:
        raise ArgsError(
            f"--custom-generate-function-path {args.custom_generate_function_path} with --fully-async: the rollout "
            "worker samples each group itself; drop one of them"
        )
    if args.use_opd:
        raise ArgsError(
            "--use-opd with --fully-async: the rollout worker scores each finished group with --rm-type's rule "
            "and asks no teacher for per-token log-probs; run distillation without --fully-async"
        )
    if args.pause_generation_mode == "abort":
        raise ArgsError(
            "--fully-async cannot use --pause-generation-mode abort: generation is always in flight, so every "
            "weight sync would discard it; use retract or in_place"
        )
    if args.max_weight_staleness is not None and args.max_weight_staleness < 0:
        raise ArgsError(f"--max-weight-staleness must be >= 0, got {args.max_weight_staleness}")
    if args.async_data_buffer_capacity_factor * args.rollout_batch_size < 1:
        raise ArgsError(
            f"--async-data-buffer-capacity-factor {args.async_data_buffer_capacity_factor} x --rollout-batch-size "
            f"{args.rollout_batch_size} holds no group; use a factor of at least {1 / args.rollout_batch_size:g}"
        )


OPD_FLAGS = (
    "--opd-type",
    "--opd-kl-coef",
    "--opd-log-prob-top-k",
    "--opd-top-k-strategy",
    "--opd-reward-weight-mode",
)


def _validate_opd(args: argparse.Namespace) -> None:
    """On-policy distillation's flags: the teacher at --rm-url, scored by the seed's reward functions."""
    from miles.train.distillation import STRATEGIES

    given = [f for f in OPD_FLAGS if f in args.flags_set]
    if not args.use_opd:
        if given:
            raise ArgsError(f"{' '.join(given)} configure on-policy distillation; add --use-opd or drop them")
        if args.custom_reward_post_process_path:
            raise ArgsError(
                f"--custom-reward-post-process-path {args.custom_reward_post_process_path} reads the answers of a "
                "reward function that scores whole samples (on-policy distillation's); add --use-opd or drop it"
            )
        if args.rm_url:
            raise ArgsError(
                f"--rm-url {args.rm_url}: a remote reward model serves only on-policy distillation's teacher here "
                "(--use-opd --opd-type sglang); use --rm-type or --custom-rm-path for a rule"
            )
        return
    module = "miles.rollout.on_policy_distillation"
    fix = (
        f"--opd-type sglang --rm-url http://HOST:PORT/generate --custom-rm-path {module}.reward_func "
        f"--custom-reward-post-process-path {module}.post_process_rewards"
    )
    if args.opd_type != "sglang":
        raise ArgsError(
            f"--use-opd with --opd-type {args.opd_type}: the teacher must be a server that scores the samples "
            f"(the megatron type, a teacher loaded in the trainer, is not supported); use {fix}"
        )
    if not (args.rm_url and args.custom_rm_path and args.custom_reward_post_process_path):
        raise ArgsError(
            f"--use-opd needs the teacher's URL and the functions that ask it and read its answers: {fix}"
        )
    if args.opd_log_prob_top_k < 0:
        raise ArgsError(f"--opd-log-prob-top-k must be >= 0, got {args.opd_log_prob_top_k}")
    if args.opd_log_prob_top_k and args.opd_top_k_strategy not in STRATEGIES:
        raise ArgsError(
            f"--opd-top-k-strategy {args.opd_top_k_strategy} needs the policy scored on the teacher's top tokens, "
            f"which the rollout does not serve; use one of {', '.join(STRATEGIES)}"
        )


DUMP_FLAGS = ("--dumper-dir", "--dumper-max-bytes")


def _validate_dumps(args: argparse.Namespace) -> None:
    """--dumper-fwd-only / --dumper-fwd-bwd parse (miles.train.dumps); a dump flag needs a phase that dumps."""
    from miles.train.dumps import DumpConfigError, phases_of

    try:
        phases = phases_of(args)
    except DumpConfigError as exc:
        raise ArgsError(str(exc)) from exc
    given = [f for f in DUMP_FLAGS if f in args.flags_set]
    if given and not any(p.enable for p in phases.values()):
        raise ArgsError(
            f"{' '.join(given)} configure tensor dumps, but no phase dumps: add --dumper-enable "
            "(or --dumper-fwd-bwd enable=1) or drop them"
        )


def _megatron_layout(args: argparse.Namespace) -> ParallelLayout:
    """The Megatron layout, parsed once; it must fit the GPUs the job asks for, checked before
    anything starts."""
    from miles.train.layout import parallel_layout

    world = args.actor_num_nodes * args.actor_num_gpus_per_node
    try:
        return parallel_layout(args, world)
    except ValueError as exc:  # InvalidParallelism, or virtual pipeline flags Megatron-LM refuses
        raise ArgsError(
            f"{exc} (world = --actor-num-nodes {args.actor_num_nodes} x --actor-num-gpus-per-node "
            f"{args.actor_num_gpus_per_node})"
        ) from exc


def validate_world(config: RunConfig, world_size: int) -> None:
    """Rules that need the number of ranks (known once the process group is up)."""
    batch = config.batch
    try:
        dp = config.layout.dp(world_size)  # the data-parallel backends' layout: dp = every rank
    except ValueError as exc:
        raise ArgsError(f"{exc} (the process group has {world_size} rank(s))") from exc
    gbs = batch.global_batch_size
    if gbs % dp:
        raise ArgsError(
            f"--global-batch-size ({gbs}) must split evenly over {dp} data-parallel ranks; e.g. "
            f"--global-batch-size {gbs + dp - gbs % dp}"
        )
    replicas = config.fsdp.dp_replicate_size
    if world_size % replicas:
        raise ArgsError(
            f"--dp-replicate-size {replicas} must divide the {world_size} ranks (each replica shards the model over "
            f"world / replicas ranks); e.g. --dp-replicate-size {max(d for d in range(1, replicas + 1) if world_size % d == 0)}"
        )
    # A partial step splits evenly too: every rank rolls out whole groups (below), so the
    # rollout's samples, and what a whole number of steps leaves of them, divide by dp.
    if config.rollout.rollout_batch_size % world_size:
        raise ArgsError(
            f"--rollout-batch-size ({config.rollout.rollout_batch_size}) must split evenly over {world_size} "
            "ranks (each rank rolls out whole groups)"
        )


def world_note(config: RunConfig, world_size: int) -> str | None:
    """A start-up note when the job flags ask for another number of ranks than were launched (a
    command run directly is a world of one whatever they say, which is how one rank is debugged)."""
    job = config.job
    given = {"--actor-num-nodes", "--actor-num-gpus-per-node"} & set(config.flags_set)
    if not given or job.world_size == world_size:
        return None
    checked = " (the parallel layout was checked against those)" if job.train_backend == "megatron" else ""
    return (
        f"the process group has {world_size} rank(s), not the {job.world_size} that --actor-num-nodes "
        f"{job.actor_num_nodes} x --actor-num-gpus-per-node {job.actor_num_gpus_per_node} ask for{checked}"
    )
