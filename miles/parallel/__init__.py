"""Parallel layouts (tp, pp, vpp, cp, ep, etp, sp) and the Megatron rules that reject them.

`validate(config, world_size, model)` checks a layout without a GPU; `python -m miles.parallel
check ... --megatron` also runs megatron-core's own rank-grid construction under gloo to prove
the verdict. megatron-core is imported only by `miles.parallel.megatron`, and only there.
"""

from miles.parallel.layout import ATTENTION_KINDS, CP_COMM_TYPES, ModelShape, ParallelConfig
from miles.parallel.rules import RULE_IDS, RULES, layers_per_virtual_stage, stage_sizes
from miles.parallel.verdict import (
    DEVICE_MAX_CONNECTIONS,
    LayoutError,
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
    "RULES",
    "RULE_IDS",
    "LayoutError",
    "ModelShape",
    "ParallelConfig",
    "Verdict",
    "Violation",
    "check",
    "env_problems",
    "layers_per_virtual_stage",
    "required_env",
    "stage_sizes",
    "validate",
]
