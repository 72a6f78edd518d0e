"""Everything a training run holds, built once from the flags: the machinery around the loop.

`build_run(config)` joins the process group, loads tokenizer, prompts, reward rule, training
backend and rollout engine (each given only the sections it consumes), and restores `--load`'s
checkpoint when there is one. `dry_start(config)` (--dry-start) stops after the training
backend: the flags checked against the world and the model, the model built at the layout and
its starting weights loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from miles.metrics.capture import check_record_dir
from miles.train import checkpoint, checks, data, guards
from miles.train.args import ArgsError, validate_world, world_note
from miles.train.backends import CRITIC, BackendUnavailable, TrainBackend, make_backend
from miles.train.config import RunConfig, SamplingConfig
from miles.train.consumption import build, disaggregated, refusal
from miles.train.distributed import DistInfo, init_distributed, seed_everything
from miles.train.inputs import verify_checkpoints
from miles.train.rewards import RewardFn, load_reward, score, scores_samples
from miles.train.rollout import Generation, RolloutEngine, weights_for

SCORING_THREADS = 16  # a rank's concurrent requests to a teacher that scores whole samples


@dataclass
class Run:
    config: RunConfig
    dist: DistInfo
    tokenizer: object
    prompts: list[data.Prompt]
    reward_fn: RewardFn
    backend: TrainBackend
    engine: RolloutEngine | None  # None under --debug-train-only (replayed rollouts)
    sampling: SamplingConfig
    critic: TrainBackend | None = None  # PPO's value model (miles.train.critic)
    rule: RewardFn | None = None  # --rm-type's rule, when reward_fn scores whole samples (distillation)
    post_process: object = None  # --custom-reward-post-process-path's function
    start_rollout: int = 0
    async_rollouts: object | None = None  # --fully-async: miles.train.async_rollout.AsyncRollouts
    skipped_streak: guards.SkippedStreak = field(default_factory=lambda: guards.SkippedStreak(3))
    step_record: checks.StepRecord = field(default_factory=lambda: checks.StepRecord(None, None, False))
    dumper: object | None = None  # --dumper-enable: miles.train.dumps.Dumper
    _encoded: dict[int, list[int]] = field(default_factory=dict)

    def prompt_ids(self, prompt: data.Prompt) -> list[int]:
        """Token ids of any prompt (training or evaluation), through the chat template if asked."""
        return data.encode_prompt(
            prompt,
            self.tokenizer,
            apply_chat_template=self.config.data.apply_chat_template,
            system_prompt=self.config.data.system_prompt,
        )

    def encode(self, prompt: data.Prompt) -> list[int]:
        """Token ids of a training prompt (cached by its index); over --rollout-max-prompt-len is an error."""
        ids = self._encoded.get(prompt.index)
        if ids is None:
            ids = self.prompt_ids(prompt)
            limit = self.config.rollout.rollout_max_prompt_len
            if limit and len(ids) > limit:
                raise data.DataError(
                    f"--prompt-data {self.config.data.prompt_data}: prompt {prompt.index} has {len(ids)} tokens, over "
                    f"--rollout-max-prompt-len {limit}; filter the dataset or raise the limit"
                )
            self._encoded[prompt.index] = ids
        return ids

    def generate(self, requests: list[list[int]], seed: int) -> list:
        """The pieces each request is trained as (miles.train.generate; --custom-generate-function-path)."""
        from miles.train.generate import GenerateContext, checked, load_generate

        path = self.config.rollout.custom_generate_function_path
        context = GenerateContext(self.engine, self.sampling, seed, self.tokenizer)
        return checked(path, requests, load_generate(path)(context, requests))

    def score(self, prompt: data.Prompt, generation: Generation, sample: int = 0) -> tuple[str, float]:
        """The decoded response and its reward under the run's rule (`sample`: its index in the group);
        under on-policy distillation, the rule --rm-type names (what evaluation scores by)."""
        text = self.tokenizer.decode(list(generation.response_ids), skip_special_tokens=True)
        where = f"prompt {prompt.index} of --prompt-data, sample {sample}"
        rule = self.rule if scores_samples(self.reward_fn) else self.reward_fn
        return text, score(
            rule, text, prompt.label, prompt.metadata, self.config.reward.reward_key, where=where
        )

    def score_all(
        self, prompts: list[data.Prompt], generations: list[Generation], group_size: int
    ) -> list[tuple[str, float, tuple[float, ...] | None]]:
        """Every generation's text, reward and per-token signal (on-policy distillation's reverse KL
        to the teacher; None for a rule). A reward function that scores whole samples is asked about
        all of them at once (concurrently), and --custom-reward-post-process-path reads its answers."""
        if not scores_samples(self.reward_fn):
            return [
                (*self.score(p, g, i % group_size), None)
                for i, (p, g) in enumerate(zip(prompts, generations, strict=True))
            ]
        from concurrent.futures import ThreadPoolExecutor

        from miles.train.distillation import ScoringRequest

        requests = [
            ScoringRequest(g.prompt_ids, g.response_ids, g.logprobs, g.top_logprobs) for g in generations
        ]
        with ThreadPoolExecutor(max_workers=SCORING_THREADS) as pool:
            answers = list(pool.map(lambda r: self.reward_fn(self.config, r), requests))
        rewards, signals = self.post_process(self.config, requests, answers)
        texts = [self.tokenizer.decode(list(g.response_ids), skip_special_tokens=True) for g in generations]
        return [(t, float(r), tuple(s)) for t, r, s in zip(texts, rewards, signals, strict=True)]

    def log(self, message: str) -> None:
        if self.dist.is_main:
            print(message, flush=True)


def check_flags(config: RunConfig, world_size: int, engine: str) -> None:
    """The flags against the world size and against what the run acts on with `engine` (a flag
    no component of the run consumes is refused); raises ArgsError."""
    validate_world(config, world_size)
    refused = refusal(config, engine)
    if refused:  # a flag the run would not act on
        raise ArgsError(f"python -m miles.train: {refused}")


def check_before_loading(config: RunConfig, dist_info: DistInfo, engine: str) -> None:
    """What a start checks before any model loads, each failing in seconds: the flags
    (`check_flags`), the CI gate's record folder, the checkpoints it starts from against their
    digests and config, and the load directory."""
    check_flags(config, dist_info.world_size, engine)
    check_record_dir()  # a CI gate record folder it could not write would fail after the first rollout
    verify_checkpoints(config, dist_info)
    ckpt = config.checkpoint
    if ckpt.load:  # a mistyped --load
        checkpoint.check_load_dir(ckpt.load, ckpt.save)


def start(config: RunConfig, *, dry: bool = False) -> DistInfo:
    """Threads, the process group, the checks made before anything loads, the seeds. A dry start
    checks the flags against the engine the command names, `auto` as a GPU machine with SGLang
    resolves it (the command is checked for where it will run, not for this machine)."""
    import torch

    if config.job.num_threads:
        torch.set_num_threads(config.job.num_threads)
    if config.job.deterministic_mode:
        from miles.train.deterministic import enable_deterministic_algorithms

        enable_deterministic_algorithms()
    dist_info = init_distributed(
        config.job.distributed_backend, deterministic=config.job.debug_deterministic_collective
    )
    choice = config.job.rollout_engine
    engine = ("sglang" if choice == "auto" else choice) if dry else engine_choice(config, dist_info)
    check_before_loading(config, dist_info, engine)
    seed_everything(config.job.seed)
    return dist_info


def dumper_of(checked, dist_info: DistInfo):
    """The tensor dumper of --dumper-enable (or a phase's enable=1), or None."""
    from pathlib import Path

    from miles.train.dumps import Dumper, phases_of

    phases = phases_of(checked)
    if not any(p.enable for p in phases.values()):
        return None
    return Dumper(
        Path(checked.dumper_dir), phases, dist_info.rank, dist_info.world_size, checked.dumper_max_bytes
    )


def build_run(config: RunConfig) -> Run:
    from miles.train.model import eos_token_ids, load_tokenizer

    job, ckpt = config.job, config.checkpoint
    dist_info = start(config)
    tokenizer = load_tokenizer(ckpt.hf_checkpoint)
    d = config.data
    prompts = data.load_prompts(
        d.prompt_data, input_key=d.input_key, label_key=d.label_key, metadata_key=d.metadata_key
    )
    reward = config.reward.custom_rm_path or config.reward.rm_type
    reward_fn = load_reward(reward)
    post_process = config.reward.custom_reward_post_process_path
    backend = make_backend(config, dist_info)
    critic = make_backend(config, dist_info, role=CRITIC) if config.algorithm.uses_critic else None
    replay = config.checks.debug_train_only
    engine = None if replay else make_engine(config, dist_info)
    if engine is not None and backend.trains_mtp and not engine.holds_mtp_layers:
        raise BackendUnavailable(
            f"--enable-mtp-training: the {engine.name} rollout engine holds no MTP layers to take the trained "
            "ones (the built-in engine holds them to draft with); add --sglang-speculative-algorithm EAGLE, "
            "or roll out with --rollout-engine sglang"
        )
    model = engine.local_model if engine is not None else None
    sampling = config.rollout.sampling_config(eos_token_ids(model or ckpt.hf_checkpoint, tokenizer))
    if config.algorithm.use_opd:  # the engine also returns each position's top tokens for the top-k KL
        sampling = replace(sampling, top_logprobs=config.algorithm.opd_log_prob_top_k)
    run = Run(config, dist_info, tokenizer, prompts, reward_fn, backend, engine, sampling, critic)
    if scores_samples(reward_fn):
        run.rule, run.post_process = load_reward(config.reward.rm_type), load_reward(post_process)
    if config.algorithm.use_opd:
        run.log(
            f"miles.train: on-policy distillation: the {config.algorithm.opd_type} teacher at {config.reward.rm_url} "
            "scores every sample"
        )
    run.skipped_streak = guards.SkippedStreak(config.optimizer.max_skipped_steps)
    checked = config.checks
    run.dumper = dumper_of(checked, dist_info)
    run.step_record = checks.StepRecord(
        checked.ci_save_grad_norm, checked.ci_load_grad_norm, dist_info.is_main
    )
    if model is not None:
        warn_if_not_causal(run)
    run.start_rollout = resume(run)
    if engine is not None:
        push_initial_weights(run)
    algorithm = config.algorithm
    kl = f", KL {algorithm.kl_loss_type} x {algorithm.kl_loss_coef} vs {backend.ref_source or '-'}"
    rollout = f"replayed from {checked.load_debug_rollout_data}" if replay else engine.name
    run.log(
        f"miles.train: {algorithm.advantage_estimator} on {ckpt.hf_checkpoint} | {job.train_backend} x "
        f"{dist_info.world_size} ({dist_info.backend}, {dist_info.device}) | rollout {rollout}"
        f"{' (colocated)' if engine is not None and engine.colocated else ''} | data {d.prompt_data} ({len(prompts)} prompts) | "
        f"reward {reward}{kl if algorithm.use_kl_loss else ''} | rollouts {run.start_rollout}..{config.rollout.num_rollout}"
    )
    notes = []
    world = world_note(config, dist_info.world_size)
    if world:
        notes.append(world)
    if engine is not None and not engine.seeded:
        notes.append(
            "SGLang samples with --rollout-seed only under --sglang-enable-deterministic-inference; "
            "without it the seed reaches the server (random_seed) and rollouts are not reproducible"
        )
    for note in notes:
        run.log(f"miles.train: note: {note}")
    return run


def dry_start(config: RunConfig) -> None:
    """The checks a start makes before any rollout, and nothing after them: the flags against the
    world size, the load directory, the training backend's model built at the layout (the Megatron
    backend: every rank's model chunks, its model flags against config.json) with its starting
    weights loaded (--ref-load's torch_dist)."""
    job, ckpt = config.job, config.checkpoint
    dist_info = start(config, dry=True)
    backend = make_backend(config, dist_info)
    source = getattr(backend, "source", ckpt.hf_checkpoint)
    if dist_info.is_main:
        print(
            f"miles.train: dry start: the {job.train_backend} model of {ckpt.hf_checkpoint} is built on "
            f"{dist_info.world_size} rank(s) ({dist_info.device}) and holds {source}; no rollout",
            flush=True,
        )


def push_initial_weights(run: Run) -> None:
    """The engine gets the trainer's weights; with --ci-test on a fresh run, they are checked
    against --hf-checkpoint's files as the engine holds them (miles.train.checks, check 5)."""
    from miles.train import checks
    from miles.train.distributed import all_gather_objects

    engine, cfg = run.engine, run.config
    stream = weights_for(engine, run.backend)
    against = cfg.checks.ci_test and run.start_rollout == 0
    comparison = None
    if against and run.dist.is_main:
        comparison = checks.CheckpointComparison(
            cfg.checkpoint.hf_checkpoint, cfg.checks.check_weight_update_skip_list
        )
        if not engine.exact_weights:  # it cannot hand its tensors back: compare what it is given
            stream = comparison.teed(stream)
    engine.update_weights(stream)
    if not against:
        return
    verdict = None
    if comparison is not None:
        if engine.exact_weights:
            from miles.train.backends.torch_dp import checkpoint_names

            held = checkpoint_names(engine.local_model, dict(engine.named_weights()))
            for name, tensor in held.items():
                comparison.add(name, tensor)
            verdict = comparison.verdict(f"the {engine.name} rollout engine's weights")
        else:
            verdict = comparison.verdict(f"the weights given to the {engine.name} rollout engine")
    found = [v for v in all_gather_objects(verdict) if v]
    if found:
        raise checks.NotTheCheckpoint(found[0])


def warn_if_not_causal(run: Run) -> None:
    """Say up front when the model's forward is not causal: the logprob check would otherwise
    blame the weight sync for a gap no engine can close."""
    from miles.train.model import causality_probe

    leak, tolerance = causality_probe(run.engine.model)  # the tolerance follows the engine's dtype
    if leak > tolerance:
        run.log(
            f"miles.train: warning: {run.engine.model.config.model_type}'s forward is not causal here: logits "
            f"of earlier positions change by up to {leak:.2g} when tokens are appended (24 -> 40 tokens; float "
            f"noise in its dtype stays under {tolerance:.2g}), so "
            "rollout and trainer logprobs differ on long sequences; keep prompt + response short (a tiny "
            "glm_moe_dsa: within its index_topk) or raise --ci-logprob-abs-diff-tol"
        )


def make_engine(config: RunConfig, dist_info: DistInfo) -> RolloutEngine:
    """The --rollout-engine (auto: sglang on a GPU machine that has it, else the built-in one),
    given the sections it consumes: in the trainer's processes, or in processes of its own."""
    kind = "remote" if disaggregated(config) else "engine"
    return build(kind, engine_choice(config, dist_info), config, dist_info)


def engine_choice(config: RunConfig, dist_info: DistInfo) -> str:
    """What --rollout-engine resolves to on this machine (auto: sglang on a GPU that has it)."""
    choice = config.job.rollout_engine
    if choice == "auto":
        choice = "sglang" if dist_info.device != "cpu" and _sglang_installed() else "torch"
    return choice


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def resume(run: Run) -> int:
    """Restore `--load`'s checkpoint; returns the first rollout id to run."""
    ckpt = run.config.checkpoint
    if not ckpt.load:
        return 0
    state = checkpoint.read_state(ckpt.load, ckpt.ckpt_step)
    if state is None:
        if run.config.checks.ci_check_model_hash:
            raise checkpoint.CheckpointError(
                f"--ci-check-model-hash: --load {ckpt.load} holds no checkpoint, so no loaded weights to check"
            )
        run.log(f"miles.train: no checkpoint in --load {ckpt.load}; starting from --hf-checkpoint")
        return 0
    checkpoint.check_compatible(state, run.config)
    checkpoint.check_files(ckpt.load, state.rollouts_done)
    with_optimizer = state.with_optimizer and not ckpt.no_load_optim
    directory = checkpoint.iteration_dir(ckpt.load, state.rollouts_done)
    run.backend.load(str(directory), with_optimizer=with_optimizer)
    if run.critic is not None:
        run.critic.load(str(directory / checkpoint.CRITIC_DIR), with_optimizer=with_optimizer)
    if run.config.checks.ci_check_model_hash:
        from miles.train.checks import CheckFailed
        from miles.train.distributed import all_gather_objects

        hashes = checkpoint.model_hashes(run.backend)
        verdict = checkpoint.hash_problem(directory, hashes) if hashes is not None else None
        found = [v for v in all_gather_objects(verdict) if v]  # every rank stops together
        if found:
            raise CheckFailed(found[0])
        run.log(f"miles.train: the loaded weights hash as {directory / checkpoint.HASH_FILE} records")
    run.log(f"miles.train: resumed from {directory}")
    return state.rollouts_done
