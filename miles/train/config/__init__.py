"""The trainer's configuration: typed, frozen sections, one per concern, and the flags they are.

Every flag of `python -m miles.train` is a field of exactly one section: the field
`rollout_batch_size` of `RolloutConfig` is the flag `--rollout-batch-size`, declared once with
argparse's own keywords and the components of a run that act on it
(`flag(type=..., default=..., help=..., by=...)`, miles.train.config.flags). The parser is built
from the sections (miles.train.args); which flags a run acts on follows from the `by` of each
(miles.train.consumption). Flag names follow the seeds' framework, so a recipe's command line
runs unchanged on the CPU trainer and on the Megatron trainer.

The sections live by concern: checkpoint.py, data.py (data, evaluation), rollout.py (rollout,
SGLang, reward), training.py (batches, algorithm, optimizer, FSDP/DDP), job.py (job, parallel
layout), megatron.py (model shape, Megatron options), checks.py (checks, logging); run.py joins
them into `RunConfig`. The small configs the algorithm code takes (`SamplingConfig`,
`LossConfig`, `OptimConfig`) are derived from the sections. Standard library only: recipes and
tests parse commands without importing torch.
"""

from miles.train.config.checkpoint import CheckpointConfig
from miles.train.config.checks import ChecksConfig, LoggingConfig
from miles.train.config.data import DataConfig, EvalConfig
from miles.train.config.engines import WEIGHT_CHECKSUMS, WEIGHT_TRANSFER_MODES, EnginesConfig
from miles.train.config.flags import (
    COMPONENTS,
    DATA_PARALLEL,
    EVERY_BACKEND,
    FLAG,
    MEGATRON,
    SERVERS,
    SGLANG,
    SGLANG_SERVERS,
    TORCH,
    TORCH_SERVERS,
    TRAINER,
    Flag,
    Section,
    _window,
    flag,
)
from miles.train.config.job import ROLLOUT_ENGINES, TRAIN_BACKENDS, JobConfig, ParallelFlags
from miles.train.config.megatron import MegatronConfig, ModelConfig
from miles.train.config.rollout import RewardConfig, RolloutConfig, SamplingConfig, SGLangConfig
from miles.train.config.run import (
    FLAGS,
    SECTION_NAMES,
    SECTIONS,
    SGLANG_PREFIX,
    RunConfig,
    flag_of,
    flags_set,
    optimizer_steps,
    step_sizes,
)
from miles.train.config.training import (
    ADVANTAGE_ESTIMATORS,
    KL_LOSS_TYPES,
    AlgorithmConfig,
    BatchConfig,
    LoraConfig,
    LossConfig,
    OptimConfig,
    OptimizerConfig,
    TorchDPConfig,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "COMPONENTS",
    "DATA_PARALLEL",
    "EVERY_BACKEND",
    "FLAG",
    "FLAGS",
    "KL_LOSS_TYPES",
    "MEGATRON",
    "ROLLOUT_ENGINES",
    "SECTIONS",
    "SECTION_NAMES",
    "SERVERS",
    "SGLANG",
    "SGLANG_PREFIX",
    "SGLANG_SERVERS",
    "TORCH",
    "TORCH_SERVERS",
    "WEIGHT_CHECKSUMS",
    "WEIGHT_TRANSFER_MODES",
    "EnginesConfig",
    "TRAINER",
    "TRAIN_BACKENDS",
    "AlgorithmConfig",
    "BatchConfig",
    "CheckpointConfig",
    "ChecksConfig",
    "DataConfig",
    "EvalConfig",
    "Flag",
    "JobConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "MegatronConfig",
    "ModelConfig",
    "OptimConfig",
    "OptimizerConfig",
    "ParallelFlags",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangConfig",
    "SamplingConfig",
    "Section",
    "TorchDPConfig",
    "_window",
    "flag",
    "flag_of",
    "flags_set",
    "optimizer_steps",
    "step_sizes",
]
