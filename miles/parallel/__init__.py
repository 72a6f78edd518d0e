"""Parallel layouts (tp, pp, vpp, cp, ep, etp, sp) and the Megatron rules that reject them.

`ParallelLayout` is the one record of a job's layout (parsed from the trainer's flags, turned
into megatron-core's arguments and back into flags in one place); `validate(layout,
world_size, model)` checks it without a GPU; `python -m miles.parallel check ... --megatron`
also runs megatron-core's own rank-grid construction under gloo to prove the verdict (through
the Megatron adapter, `miles.megatron`). Standard library only.
"""

from miles.parallel.layout import (
    ATTENTION_KINDS,
    CP_COMM_TYPES,
    FamilyLimits,
    ModelShape,
    ParallelLayout,
    VirtualPipelineError,
)
from miles.parallel.rules import RULE_IDS, RULES, layers_per_virtual_stage, stage_sizes
from miles.parallel.verdict import (
    DEVICE_MAX_CONNECTIONS,
    InvalidParallelism,
    Verdict,
    Violation,
    check,
    env_problems,
    required_env,
    validate,
)

__all__ = [
    "ATTENTION_KINDS",
    "CP_COMM_TYPES",
    "DEVICE_MAX_CONNECTIONS",
    "FamilyLimits",
    "RULES",
    "RULE_IDS",
    "InvalidParallelism",
    "ModelShape",
    "ParallelLayout",
    "Verdict",
    "VirtualPipelineError",
    "Violation",
    "check",
    "env_problems",
    "layers_per_virtual_stage",
    "required_env",
    "stage_sizes",
    "validate",
]
