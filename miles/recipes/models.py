"""Model specs: each architecture's Megatron flags, its published config.json, and what
megatron-core lacks to build it.

A recipe names a model; `resolve_model()` turns the name into a spec at a depth: an
`-Nlayer` slice by keyword (`Inkling-Small-4layer`), else `MODEL_ARGS_NUM_LAYERS`, else the
full depth. The MoE layer pattern (`--moe-layer-freq`) is regenerated for the chosen depth,
so a slice keeps the model's leading dense layers. `tiny` is a two-layer random checkpoint of
the same family that the CPU lane builds locally.

Each spec carries the published config.json values (`Published`, typed in once with their
source) and the `Gap`s: what the model needs that the pinned megatron-core cannot express.
`python -m miles.recipes facts NAME` sets the flags beside the config (miles.recipes.facts);
each spec lives in the recipe module that trains it (miles/recipes/library/).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from miles.families import family
from miles.families.facts import moe_layer_freq, shared_index_layers
from miles.parallel import ModelShape
from miles.recipes.args import Args

TINY = "tiny"
DEPTH_ENV = "MODEL_ARGS_NUM_LAYERS"
_SLICE_RE = re.compile(r"^(?P<base>.+)-(?P<layers>\d+)layers?$")


@dataclass(frozen=True)
class Published:
    """A model's published config.json values, typed in once, with where they were read."""

    source: str  # the config.json (or the document that tabulates it)
    values: tuple[tuple[str, object], ...]
    sources: tuple[tuple[str, str], ...] = ()  # a different source for single keys

    def value(self, key: str) -> object:
        return dict(self.values)[key]

    def source_of(self, key: str) -> str:
        return dict(self.sources).get(key, self.source)


@dataclass(frozen=True)
class Gap:
    """Something the model needs that the pinned megatron-core cannot express, and how the
    reference recipe gets it instead."""

    feature: str
    why: str
    keys: tuple[str, ...] = ()  # the config.json keys it covers (they map to no flag)


@dataclass(frozen=True)
class ModelSpec:
    """One architecture at full depth."""

    name: str  # e.g. "Qwen3-30B-A3B"
    family: str  # a miles.families family
    hf_repo: str  # where the full checkpoint is published
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # KV heads; None = MHA (or MLA, where Megatron ignores it)
    num_experts: int | None = None
    first_k_dense: int = 0  # leading dense layers before the MoE layers start
    arch_args: Args = ()  # depth-independent Megatron architecture flags
    # Kernel choices (fused or grouped GPU kernels): passed on GPUs only.
    kernel_args: Args = ()
    published: Published | None = None
    gaps: tuple[Gap, ...] = ()
    # config.json keys the recipe trains with a different value on purpose, and why
    choices: tuple[tuple[str, str], ...] = ()
    # where the rollout engine computes the model otherwise than the trainer, which follows
    # transformers' class: (what, how much and why)
    known_differences: tuple[tuple[str, str], ...] = ()

    @property
    def attention(self) -> str:
        """gqa | mla | dsa: its family's (miles.families)."""
        return family(self.family).attention

    def shape(self, num_layers: int | None = None, name: str | None = None) -> ModelShape:
        layers = num_layers or self.num_layers
        name = name or (self.name if layers == self.num_layers else f"{self.name}-{layers}layer")
        flags = dict(self.arch_args)
        published = dict(self.published.values) if self.published else {}
        return ModelShape(
            name, layers, self.num_attention_heads, self.num_query_groups, self.num_experts, self.attention,
            bias=not flags.get("--disable-bias-linear"), moe_ffn_hidden_size=flags.get("--moe-ffn-hidden-size"),
            shared_index_layers=shared_index_layers({**published, "num_hidden_layers": layers}),
            limits=family(self.family).limits(published), vocab_size=flags.get("--vocab-size"),
        )  # fmt: skip

    def model_args(self, num_layers: int | None = None, kernels: bool = True) -> Args:
        """Megatron model flags at `num_layers` (full depth when None); `kernels` adds the GPU
        kernel choices."""
        layers = num_layers or self.num_layers
        out: list = [("--num-layers", layers), ("--num-attention-heads", self.num_attention_heads)]
        if self.num_query_groups is not None:
            out += [("--group-query-attention", True), ("--num-query-groups", self.num_query_groups)]
        if self.num_experts is not None:
            out += [
                ("--num-experts", self.num_experts),
                ("--moe-layer-freq", moe_layer_freq(self.first_k_dense, layers)),
            ]
        return (*out, *self.arch_args, *(self.kernel_args if kernels else ()))


@dataclass(frozen=True)
class ResolvedModel:
    """A spec at a chosen depth, under the name its prepared checkpoint directory gets."""

    spec: ModelSpec
    name: str  # "Inkling-Small-4layer", "Qwen3-4B", "Qwen3-30B-A3B-tiny"
    num_layers: int
    how: str  # why this depth: "keyword", "MODEL_ARGS_NUM_LAYERS=4", "full depth", "tiny"

    @property
    def tiny(self) -> bool:
        return self.how == TINY

    @property
    def is_slice(self) -> bool:
        return not self.tiny and self.num_layers < self.spec.num_layers

    @property
    def shape(self) -> ModelShape:
        return self.spec.shape(self.num_layers, self.name)

    def model_args(self, kernels: bool = True) -> Args:
        return self.spec.model_args(self.num_layers, kernels)


class UnknownModel(ValueError):
    pass


def resolve_model(name: str, spec: ModelSpec, env: Mapping[str, str] = os.environ) -> ResolvedModel:
    """`name` (the spec's name, an `-Nlayer` slice of it, or `tiny`) -> the spec at a depth."""
    if name == TINY:
        return ResolvedModel(spec, f"{spec.name}-{TINY}", family(spec.family).tiny_layers, TINY)
    match = _SLICE_RE.match(name)
    if match and match["base"] == spec.name:
        layers = int(match["layers"])
        _check_depth(spec, layers, f"model name {name}")
        return ResolvedModel(spec, name, layers, "keyword")
    if name != spec.name:
        raise UnknownModel(f"model '{name}' is not {spec.name}, {spec.name}-<N>layer or {TINY}")
    depth = env.get(DEPTH_ENV, "").strip()
    if not depth:
        return ResolvedModel(spec, name, spec.num_layers, "full depth")
    if not depth.isdigit():
        raise UnknownModel(f"{DEPTH_ENV}={depth!r} is not a layer count")
    layers = int(depth)
    _check_depth(spec, layers, f"{DEPTH_ENV}={depth}")
    sliced = f"{name}-{layers}layer" if layers < spec.num_layers else name
    return ResolvedModel(spec, sliced, layers, f"{DEPTH_ENV}={depth}")


def _check_depth(spec: ModelSpec, layers: int, origin: str) -> None:
    if not 1 <= layers <= spec.num_layers:
        raise UnknownModel(
            f"{origin}: {spec.name} has {spec.num_layers} layers; a slice needs 1..{spec.num_layers}"
        )
