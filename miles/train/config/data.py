"""The data and evaluation sections: the prompts a run trains on and the sets it is scored on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles.train.config.flags import (
    TRAINER,
    Section,
    _fraction,
    _non_negative_float,
    _positive_int,
    _text,
    flag,
)


@dataclass(frozen=True)
class DataConfig(Section):
    name: ClassVar[str] = "data"
    title: ClassVar[str] = "data"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    prompt_data: str = flag(
        default="synthetic:fixed",
        help="JSONL or Parquet file, or synthetic:<task> (tasks: fixed, copy, echo, arith)",
    )
    input_key: str = flag(default="prompt")
    label_key: str = flag(default="label")
    metadata_key: str = flag(default="metadata")
    tool_key: str | None = _text(by=())
    apply_chat_template: bool = flag(action="store_true", help="wrap each prompt in the chat template")
    system_prompt: str | None = flag(help="system message added when the chat template is applied")
    rollout_shuffle: bool = flag(action="store_true", help="shuffle prompts each epoch (seeded)")
    num_epoch: int | None = flag(by=(), type=_positive_int)


@dataclass(frozen=True)
class EvalConfig(Section):
    name: ClassVar[str] = "eval"
    title: ClassVar[str] = "evaluation"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    eval_prompt_data: tuple[str, ...] | None = flag(nargs="+", help="NAME PATH pairs, scored as eval/NAME")
    eval_interval: int | None = flag(type=_positive_int, help="evaluate after every N rollouts")
    n_samples_per_eval_prompt: int = flag(
        type=_positive_int, default=1, help="samples per eval prompt; above 1, pass@k is logged too"
    )
    eval_max_response_len: int | None = flag(type=_positive_int)
    eval_temperature: float | None = flag(type=_non_negative_float, help="0 = greedy")
    eval_top_p: float | None = flag(type=_fraction)
    eval_top_k: int | None = flag(type=int, help="-1 = off; 1 = greedy")
    eval_input_key: str | None = flag(help="prompt key of the eval sets (default: the training data's)")
    eval_label_key: str | None = flag(help="label key of the eval sets (default: the training data's)")
    skip_eval_before_train: bool = flag(
        action="store_true", help="no evaluation before the first rollout (by default there is one)"
    )
