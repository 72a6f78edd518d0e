"""Parallel layouts (tp, pp, cp, ep, etp, sp) and the Megatron rules that reject them.

`validate(config, world_size, model)` checks a layout without a GPU; `python -m miles.parallel
check ... --megatron` also runs megatron-core's own rank-grid construction under gloo to prove
the verdict. megatron-core is imported only by `miles.parallel.megatron`, and only there.
"""

from miles.parallel.layout import (
    RULE_IDS,
    LayoutError,
    ModelShape,
    ParallelConfig,
    Verdict,
    Violation,
    check,
    stage_sizes,
    validate,
)

__all__ = [
    "RULE_IDS",
    "LayoutError",
    "ModelShape",
    "ParallelConfig",
    "Verdict",
    "Violation",
    "check",
    "stage_sizes",
    "validate",
]
