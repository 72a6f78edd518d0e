"""Everything a training run holds, built once from the flags: the machinery around the loop.

`build_run(args)` joins the process group, loads tokenizer, prompts, reward rule, training
backend and rollout engine, and restores `--load`'s checkpoint when there is one. `dry_start(args)`
(--dry-start) stops after the training backend: the flags checked against the world and the
model, the model built at the layout and its starting weights loaded.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from miles.train import checkpoint, data, guards
from miles.train.args import SamplingConfig, run_notes, sampling_config, validate_world
from miles.train.backends import TrainBackend, make_backend
from miles.train.distributed import DistInfo, init_distributed, seed_everything
from miles.train.rewards import RewardFn, load_reward, score
from miles.train.rollout import Generation, RolloutEngine


@dataclass
class Run:
    args: argparse.Namespace
    dist: DistInfo
    tokenizer: object
    prompts: list[data.Prompt]
    reward_fn: RewardFn
    backend: TrainBackend
    engine: RolloutEngine
    sampling: SamplingConfig
    start_rollout: int = 0
    skipped_streak: guards.SkippedStreak = field(default_factory=lambda: guards.SkippedStreak(3))
    _encoded: dict[int, list[int]] = field(default_factory=dict)

    def prompt_ids(self, prompt: data.Prompt) -> list[int]:
        """Token ids of any prompt (training or evaluation), through the chat template if asked."""
        return data.encode_prompt(
            prompt,
            self.tokenizer,
            apply_chat_template=self.args.apply_chat_template,
            system_prompt=self.args.system_prompt,
        )

    def encode(self, prompt: data.Prompt) -> list[int]:
        """Token ids of a training prompt (cached by its index); over --rollout-max-prompt-len is an error."""
        ids = self._encoded.get(prompt.index)
        if ids is None:
            ids = self.prompt_ids(prompt)
            limit = self.args.rollout_max_prompt_len
            if limit and len(ids) > limit:
                raise data.DataError(
                    f"--prompt-data {self.args.prompt_data}: prompt {prompt.index} has {len(ids)} tokens, over "
                    f"--rollout-max-prompt-len {limit}; filter the dataset or raise the limit"
                )
            self._encoded[prompt.index] = ids
        return ids

    def score(self, prompt: data.Prompt, generation: Generation, sample: int = 0) -> tuple[str, float]:
        """The decoded response and its reward under the run's rule (`sample`: its index in the group)."""
        text = self.tokenizer.decode(list(generation.response_ids), skip_special_tokens=True)
        where = f"prompt {prompt.index} of --prompt-data, sample {sample}"
        return text, score(
            self.reward_fn, text, prompt.label, prompt.metadata, self.args.reward_key, where=where
        )

    def log(self, message: str) -> None:
        if self.dist.is_main:
            print(message, flush=True)


def build_run(args: argparse.Namespace) -> Run:
    import torch

    from miles.train.model import eos_token_ids, load_tokenizer

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dist_info = init_distributed(args.distributed_backend)
    validate_world(args, dist_info.world_size)
    if args.load:  # before any model loads: a mistyped --load fails in a second
        checkpoint.check_load_dir(args.load, args.save)
    seed_everything(args.seed)
    tokenizer = load_tokenizer(args.hf_checkpoint)
    prompts = data.load_prompts(
        args.prompt_data, input_key=args.input_key, label_key=args.label_key, metadata_key=args.metadata_key
    )
    reward_fn = load_reward(args.custom_rm_path or args.rm_type)
    backend = make_backend(args, dist_info)
    engine = make_engine(args, dist_info)
    engine_model = getattr(engine, "model", None)
    sampling = sampling_config(
        args, eos_token_ids(engine_model, tokenizer) if engine_model is not None else ()
    )
    run = Run(args, dist_info, tokenizer, prompts, reward_fn, backend, engine, sampling)
    run.skipped_streak = guards.SkippedStreak(args.max_skipped_steps)
    if engine_model is not None:
        warn_if_not_causal(run)
    run.start_rollout = resume(run)
    engine.update_weights(backend.full_weights(names=engine.weight_names))
    kl = f", KL {args.kl_loss_type} x {args.kl_loss_coef} vs {getattr(backend, 'ref_source', '-')}"
    run.log(
        f"miles.train: {args.advantage_estimator} on {args.hf_checkpoint} | {args.train_backend} x "
        f"{dist_info.world_size} ({dist_info.backend}, {dist_info.device}) | rollout {type(engine).__name__} | "
        f"data {args.prompt_data} ({len(prompts)} prompts) | reward {args.custom_rm_path or args.rm_type}"
        f"{kl if args.use_kl_loss else ''} | rollouts {run.start_rollout}..{args.num_rollout}"
    )
    engine_name = "sglang" if type(engine).__name__.startswith("SGLang") else "torch"
    notes = run_notes(args, engine_name)
    if getattr(engine, "seeded", True) is False:
        notes.append(
            "SGLang samples with --rollout-seed only under --sglang-enable-deterministic-inference; "
            "without it the seed reaches the server (random_seed) and rollouts are not reproducible"
        )
    for note in notes:
        run.log(f"miles.train: note: {note}")
    return run


def dry_start(args: argparse.Namespace) -> None:
    """The checks a start makes before any rollout, and nothing after them: the flags against the
    world size, the load directory, the training backend's model built at the layout (the Megatron
    backend: every rank's model chunks, its model flags against config.json) with its starting
    weights loaded (--ref-load's torch_dist)."""
    import torch

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dist_info = init_distributed(args.distributed_backend)
    validate_world(args, dist_info.world_size)
    if args.load:
        checkpoint.check_load_dir(args.load, args.save)
    seed_everything(args.seed)
    backend = make_backend(args, dist_info)
    source = getattr(backend, "source", args.hf_checkpoint)
    if dist_info.is_main:
        print(
            f"miles.train: dry start: the {args.train_backend} model of {args.hf_checkpoint} is built on "
            f"{dist_info.world_size} rank(s) ({dist_info.device}) and holds {source}; no rollout",
            flush=True,
        )


def warn_if_not_causal(run: Run) -> None:
    """Say up front when the model's forward is not causal: the logprob check would otherwise
    blame the weight sync for a gap no engine can close."""
    from miles.train.model import CAUSALITY_TOL, causality_leak

    leak = causality_leak(run.engine.model)
    if leak > CAUSALITY_TOL:
        run.log(
            f"miles.train: warning: {run.engine.model.config.model_type}'s forward is not causal here: logits "
            f"of earlier positions change by up to {leak:.2g} when tokens are appended (24 -> 40 tokens), so "
            "rollout and trainer logprobs differ on long sequences; keep prompt + response short (a tiny "
            "glm_moe_dsa: within its index_topk) or raise --ci-logprob-abs-diff-tol"
        )


def make_engine(args: argparse.Namespace, dist_info: DistInfo) -> RolloutEngine:
    choice = args.rollout_engine
    if choice == "auto":
        choice = "sglang" if dist_info.device != "cpu" and _sglang_installed() else "torch"
    if choice == "sglang":
        from miles.train.sglang_engine import SGLangRolloutEngine

        return SGLangRolloutEngine(args, dist_info)
    from miles.train.model import load_causal_lm, load_tokenizer
    from miles.train.rollout import TorchRolloutEngine

    model = load_causal_lm(args.hf_checkpoint, dtype=_rollout_dtype(args, dist_info), device=dist_info.device)
    pad = load_tokenizer(args.hf_checkpoint).pad_token_id
    return TorchRolloutEngine(model, pad_token_id=pad or 0)


def _rollout_dtype(args, dist_info):
    from miles.train.model import train_dtype

    return train_dtype(args.bf16)  # the engine samples in the trainer's compute dtype


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def resume(run: Run) -> int:
    """Restore `--load`'s checkpoint; returns the first rollout id to run."""
    args = run.args
    if not args.load:
        return 0
    state = checkpoint.read_state(args.load, args.ckpt_step)
    if state is None:
        run.log(f"miles.train: no checkpoint in --load {args.load}; starting from --hf-checkpoint")
        return 0
    checkpoint.check_compatible(state, args)
    with_optimizer = state.with_optimizer and not args.no_load_optim
    run.backend.load(
        str(checkpoint.iteration_dir(args.load, state.rollouts_done)), with_optimizer=with_optimizer
    )
    run.log(f"miles.train: resumed from {checkpoint.iteration_dir(args.load, state.rollouts_done)}")
    return state.rollouts_done
