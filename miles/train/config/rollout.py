"""The rollout, SGLang and reward sections: how samples are generated and scored."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from miles.train.config.flags import (
    EVERY_BACKEND,
    SGLANG,
    SGLANG_SERVERS,
    TORCH,
    TORCH_SERVERS,
    TRAINER,
    TRAINER_AND_BACKENDS,
    Section,
    _fraction,
    _positive_int,
    _switch,
    _text,
    flag,
)

# What every training backend reads of the rollout beside the trainer: its size (the learning-rate
# schedule's length) and its temperature (trainer and engine logprobs agree).
_SHAPE = TRAINER_AND_BACKENDS


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float
    top_p: float
    top_k: int
    max_response_len: int
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0  # also return the top k (logprob, token id) of every response position


@dataclass(frozen=True)
class RolloutConfig(Section):
    name: ClassVar[str] = "rollout"
    title: ClassVar[str] = "rollout"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    num_rollout: int = flag(
        by=_SHAPE, type=_positive_int, default=10, help="training steps (rollouts) in all"
    )
    rollout_batch_size: int = flag(by=_SHAPE, type=_positive_int, default=8, help="prompts per rollout")
    n_samples_per_prompt: int = flag(by=_SHAPE, type=_positive_int, default=8, help="group size")
    rollout_max_response_len: int = flag(type=_positive_int, default=64)
    rollout_max_prompt_len: int | None = flag(type=_positive_int)
    rollout_temperature: float = flag(by=_SHAPE, type=float, default=1.0)
    rollout_top_p: float = flag(type=_fraction, default=1.0)
    rollout_top_k: int = flag(type=int, default=-1, help="-1 = off")
    rollout_stop_token_ids: tuple[int, ...] = flag(type=int, nargs="*", default=[])
    rollout_seed: int | None = flag(
        by=(TRAINER, SGLANG, SGLANG_SERVERS), type=int, help="sampling seed (default: --seed)"
    )
    rollout_function_path: str | None = flag(by=(), help="(GPU lanes) custom rollout function, dotted path")
    over_sampling_batch_size: int | None = flag(by=(), type=_positive_int)
    dynamic_sampling_filter_path: str | None = _text(by=())
    partial_rollout: bool = _switch(by=())
    update_weights_interval: int = flag(type=_positive_int, default=1)
    custom_generate_function_path: str | None = flag(
        help="module.func(context, requests) -> pieces per request (miles.train.generate; e.g. "
        "miles.train.generate_hub.compact_split)"
    )
    # routing replay (miles.train.routing_replay): the engine records, the training backend replays
    use_rollout_routing_replay: bool = flag(
        by=(TRAINER, *EVERY_BACKEND, TORCH, SGLANG),
        action="store_true",
        why_not="the rollout engines in processes of their own do not return the routed experts yet",
        help="(R3) the rollout engine records each token's experts at every MoE layer and the trainer's "
        "routers replay them instead of their own top-k (their weighting of the experts kept)",
    )
    use_routing_replay: bool = flag(
        by=(),
        action="store_true",
        why_not="miles.train does not record the routing of its old-logprob forward to replay it in training "
        "(R2); --use-rollout-routing-replay replays the rollout engine's",
        help="(R2, not in miles.train) replay the old-logprob forward's routing in the training forwards",
    )

    @property
    def samples(self) -> int:
        """Samples per rollout: prompts x group size."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    def sampling_config(self, eos_token_ids: Sequence[int] = ()) -> SamplingConfig:
        """What the rollout engine samples with; the model's end-of-sequence ids stop it too."""
        return SamplingConfig(
            temperature=self.rollout_temperature,
            top_p=self.rollout_top_p,
            top_k=self.rollout_top_k,
            max_response_len=self.rollout_max_response_len,
            stop_token_ids=tuple(dict.fromkeys([*self.rollout_stop_token_ids, *eos_token_ids])),
        )


@dataclass(frozen=True)
class SGLangConfig(Section):
    """The SGLang rollout engine; `server_args` are the `--sglang-<name> [values]` flags the
    parser does not define itself, passed to SGLang's ServerArgs unchanged."""

    name: ClassVar[str] = "sglang"
    title: ClassVar[str] = "SGLang rollout engine"
    used_by: ClassVar[tuple[str, ...]] = (SGLANG, SGLANG_SERVERS)

    rollout_num_gpus_per_engine: int = flag(
        by=(SGLANG, SGLANG_SERVERS, TORCH_SERVERS), type=_positive_int, default=1
    )
    update_weight_buffer_size: int | None = flag(
        by=(SGLANG, SGLANG_SERVERS, TORCH_SERVERS),
        type=_positive_int,
        help="bytes per weight push to the engines (512 MiB)",
    )
    sglang_mem_fraction_static: float | None = flag(type=_fraction, help="SGLang KV-cache memory share")
    # Speculative decoding with the checkpoint's MTP layers, by SGLang's names (the seed's recipes
    # pass them): SGLang takes them as server arguments, the built-in engine drafts with its own
    # MTP drafter (miles.train.speculative), which refuses what it cannot do
    sglang_speculative_algorithm: str | None = flag(
        by=(SGLANG, SGLANG_SERVERS, TORCH), help="EAGLE (or NEXTN): draft with the checkpoint's MTP layers"
    )
    sglang_speculative_num_steps: int | None = flag(
        by=(SGLANG, SGLANG_SERVERS, TORCH), type=_positive_int, help="drafted tokens per verifying forward"
    )
    sglang_speculative_eagle_topk: int | None = flag(
        by=(SGLANG, SGLANG_SERVERS, TORCH), type=_positive_int, help="drafts per step (the built-in engine: 1)"
    )
    sglang_speculative_num_draft_tokens: int | None = flag(
        by=(SGLANG, SGLANG_SERVERS, TORCH), type=_positive_int, help="tokens verified per step (num-steps + 1)"
    )
    server_args: Mapping[str, str | bool | list[str]] = field(default_factory=dict)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> SGLangConfig:
        base = super().from_namespace(namespace)
        return cls(**{**vars(base), "server_args": dict(getattr(namespace, "sglang_args", {}))})


@dataclass(frozen=True)
class RewardConfig(Section):
    name: ClassVar[str] = "reward"
    title: ClassVar[str] = "reward"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    rm_type: str = flag(
        default="synthetic",
        help="math | deepscaler | dapo | gsm8k | synthetic | a dotted path module.func / module:func",
    )
    custom_rm_path: str | None = flag(help="dotted path of a reward function; wins over --rm-type")
    reward_key: str | None = flag(help="when the reward function returns a dict, the key to train on")
    rm_url: str | None = flag(
        by=TRAINER,
        help="(on-policy distillation) the teacher's SGLang /generate endpoint that scores the samples",
    )
    custom_reward_post_process_path: str | None = flag(
        by=TRAINER, help="dotted path of a function that turns a rollout's reward answers into rewards"
    )
