"""What a recipe asks the checkpoint pipeline to prepare.

A recipe (miles.recipes) builds a CheckpointPlan for one of its models; the pipeline
(miles.ckpt.pipeline) runs the plan's steps in order. The plan is pure data so that
`--dry` can print it and a rerun can compare it with what is already on disk.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.families import FAMILIES

__all__ = ["FAMILIES", "STEPS", "TINY_SOURCE_PREFIX", "CheckpointPlan"]

STEPS = ("fetch", "validate", "trim", "fp8", "torch_dist", "stage")
TINY_SOURCE_PREFIX = "tiny:"  # source "tiny:<family>" builds a tiny random checkpoint locally


@dataclass(frozen=True)
class CheckpointPlan:
    family: str  # one of FAMILIES
    model_name: str  # e.g. "Qwen3-4B", "Inkling-Small-4layer"; prepared dirs are named after it
    source: str  # Hugging Face repo id, local path, or "tiny:<family>"
    model_dir: str  # parent of <model_name>, <model_name>_fp8 and <model_name>_torch_dist
    num_layers: int | None = None  # N of an -Nlayer slice; trim applies when the source is deeper
    steps: tuple[str, ...] = ("fetch", "validate")
    stage_dir: str | None = None  # node-local directory the stage step copies to
    allow_auto_map: bool = False  # allow config.json auto_map (remote code) for this model
    datasets: tuple[str, ...] = ()  # prompt datasets the fetch step also fetches (miles.ckpt.datasets)
    data_dir: str | None = None  # where they go: <data_dir>/<dataset>/

    def __post_init__(self) -> None:
        unknown = [s for s in self.steps if s not in STEPS]
        if unknown:
            raise ValueError(f"unknown checkpoint step(s) {unknown}; known: {', '.join(STEPS)}")
        order = [STEPS.index(s) for s in self.steps]
        if order != sorted(order):
            raise ValueError(f"steps {list(self.steps)} are out of order; the order is {', '.join(STEPS)}")
        if self.family not in FAMILIES:
            raise ValueError(f"family '{self.family}' is not one of {', '.join(FAMILIES)}")
        if "stage" in self.steps and not self.stage_dir:
            raise ValueError("the stage step needs stage_dir")
        if self.datasets and not self.data_dir:
            raise ValueError("a plan that fetches datasets needs data_dir")

    @property
    def hf_dir(self) -> str:
        return f"{self.model_dir}/{self.model_name}"

    @property
    def fp8_dir(self) -> str:
        return f"{self.model_dir}/{self.model_name}_fp8"

    @property
    def torch_dist_dir(self) -> str:
        return f"{self.model_dir}/{self.model_name}_torch_dist"
