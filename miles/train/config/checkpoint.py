"""The checkpoint section: the model a run starts from, its reference, and where it saves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from miles.train.config.flags import (
    COMPONENTS,
    MEGATRON,
    TRAINER,
    TRAINER_AND_BACKENDS,
    Section,
    _positive_int,
    flag,
)


@dataclass(frozen=True)
class CheckpointConfig(Section):
    name: ClassVar[str] = "checkpoint"
    title: ClassVar[str] = "checkpoint"
    used_by: ClassVar[tuple[str, ...]] = (TRAINER,)

    hf_checkpoint: str = flag(
        by=COMPONENTS, required=True, help="Hugging Face model dir: weights, config, tokenizer"
    )
    # the backends load it, the trainer verifies it before any model loads
    ref_load: str | None = flag(
        by=TRAINER_AND_BACKENDS, help="reference model: an HF dir, or a torch_dist dir (megatron backend)"
    )
    load: str | None = flag(help="resume from the latest checkpoint here (fresh start when there is none)")
    save: str | None = flag(help="write checkpoints here")
    save_interval: int | None = flag(type=_positive_int, help="save every N rollouts (and after the last)")
    ckpt_step: int | None = flag(type=int, help="resume from this rollout instead of the latest")
    no_save_optim: bool = flag(action="store_true", help="save model weights only")
    no_load_optim: bool = flag(action="store_true", help="resume weights but start a fresh optimizer")
    ckpt_format: str = flag(by=(), default="torch_dist", choices=("torch_dist", "torch"))
    megatron_to_hf_mode: str = flag(by=MEGATRON, default="raw", choices=("raw", "bridge"))
    keep_old_actor: bool = flag(by=(), action="store_true")
    finetune: bool = flag(by=(), action="store_true", help="(megatron) load weights without iteration state")
