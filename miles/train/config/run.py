"""The run's configuration: one instance of every section, built once from the parsed flags."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from miles.parallel import ParallelLayout
from miles.train.config.checkpoint import CheckpointConfig
from miles.train.config.checks import ChecksConfig, LoggingConfig
from miles.train.config.data import DataConfig, EvalConfig
from miles.train.config.engines import EnginesConfig
from miles.train.config.flags import Flag, Section
from miles.train.config.job import JobConfig, ParallelFlags
from miles.train.config.megatron import MegatronConfig, ModelConfig
from miles.train.config.rollout import RewardConfig, RolloutConfig, SGLangConfig
from miles.train.config.training import (
    AlgorithmConfig,
    BatchConfig,
    LoraConfig,
    OptimizerConfig,
    TorchDPConfig,
)

SGLANG_PREFIX = "--sglang-"

# The sections, in the order --help shows them.
SECTIONS: tuple[type[Section], ...] = (
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    RolloutConfig,
    BatchConfig,
    SGLangConfig,
    EnginesConfig,
    RewardConfig,
    AlgorithmConfig,
    OptimizerConfig,
    LoraConfig,
    JobConfig,
    ParallelFlags,
    TorchDPConfig,
    ModelConfig,
    MegatronConfig,
    ChecksConfig,
    LoggingConfig,
)
FLAGS: tuple[Flag, ...] = tuple(f for section in SECTIONS for f in section.flags())
SECTION_NAMES: tuple[str, ...] = tuple(s.name for s in SECTIONS)


def flag_of(option: str) -> Flag | None:
    """The flag an option string names (None: not a flag of the trainer)."""
    return _BY_OPTION.get(option)


_BY_OPTION = {f.option: f for f in FLAGS}


# --- the run's configuration ---------------------------------------------------------------


@dataclass(frozen=True)
class RunConfig:
    """Every section of one command, built once from its parsed flags. `layout` is the section
    of the layout flags as the one `ParallelLayout`; `flags_set` the options the command sets to
    a value other than their default (in section order, then the `--sglang-<name>` ones)."""

    checkpoint: CheckpointConfig
    data: DataConfig
    eval: EvalConfig
    rollout: RolloutConfig
    batch: BatchConfig
    sglang: SGLangConfig
    engines: EnginesConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    optimizer: OptimizerConfig
    lora: LoraConfig
    job: JobConfig
    layout: ParallelLayout
    fsdp: TorchDPConfig
    model: ModelConfig
    megatron: MegatronConfig
    checks: ChecksConfig
    logging: LoggingConfig
    flags_set: tuple[str, ...] = ()

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> RunConfig:
        """The sections of a namespace `miles.train.args.parse_args` returned (validated, with
        the layout resolved and the flags it sets recorded)."""
        sections: dict[str, Any] = {
            s.name: s.from_namespace(namespace) for s in SECTIONS if s is not ParallelFlags
        }
        return cls(**sections, layout=namespace.layout, flags_set=tuple(namespace.flags_set))

    def section(self, name: str) -> Any:
        """The section called `name` (a name of SECTION_NAMES)."""
        if name not in SECTION_NAMES:
            raise KeyError(f"no section {name!r}; sections: {', '.join(SECTION_NAMES)}")
        return getattr(self, name)


def flags_set(namespace: argparse.Namespace) -> tuple[str, ...]:
    """The options whose parsed value is not their default, and every passed-through `--sglang-*`."""
    changed = [f.option for f in FLAGS if getattr(namespace, f.dest, f.default) != f.default]
    passthrough = [SGLANG_PREFIX + k.replace("_", "-") for k in getattr(namespace, "sglang_args", {})]
    return tuple(changed + passthrough)


def step_sizes(samples: int, global_batch_size: int, *, partial: bool = False) -> list[int]:
    """The samples of each optimizer step of a rollout of `samples`: whole --global-batch-size
    steps, then, with `partial` (--allow-partial-train-step with --disable-rollout-trim-samples),
    the rest as one smaller step (as the seed framework plans them: radixark/miles 31f1ca961,
    miles/utils/dp_schedule.py)."""
    sizes = [global_batch_size] * (samples // global_batch_size)
    rest = samples % global_batch_size
    return sizes + [rest] if rest and partial else sizes


def optimizer_steps(rollout: RolloutConfig, batch: BatchConfig) -> int:
    """Optimizer steps of the whole run (the learning-rate schedule's length; a partial step counts)."""
    partial = batch.allow_partial_train_step and batch.disable_rollout_trim_samples
    return rollout.num_rollout * len(step_sizes(rollout.samples, batch.global_batch_size, partial=partial))
