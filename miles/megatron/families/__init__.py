"""The megatron-core GPT mapping of each model family, found by config.json's model_type.

A mapping says what megatron-core needs to build a family's model that the facts table
(`miles.models`) does not: the TransformerConfig switches megatron-core spells its own way
(normalisation, qk-norm, which layers are MoE, how top-k weights are renormalised), the
config values it refuses, and where every row of a decoder layer's megatron weights comes
from in the Hugging Face checkpoint. Adding a family: one module here, listed in `_MODULES`.
Importing this package imports no torch and no megatron-core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

from miles.megatron.hf_names import Weights

# The modules that define mappings, each with a MAPPINGS tuple.
_MODULES = ("miles.megatron.families.qwen3",)


class UnmappedModel(ValueError):
    """A config megatron-core's GPTModel cannot be built from (the message names the key and the fix)."""


@dataclass(frozen=True)
class GPTMapping:
    family: str  # the miles.models family it builds
    model_types: tuple[str, ...]
    refuse_unmapped: Callable[[Mapping[str, Any]], None]  # raises UnmappedModel for what it cannot map
    transformer_fields: Callable[[Mapping[str, Any]], dict]  # family-specific TransformerConfig fields
    layer_weights: Callable[
        [Mapping[str, Any], int, str], Weights
    ]  # one decoder layer's: (config, layer, prefix)


@cache
def mappings() -> dict[str, GPTMapping]:
    """Every mapping, by model_type."""
    out: dict[str, GPTMapping] = {}
    for name in _MODULES:
        for mapping in importlib.import_module(name).MAPPINGS:
            for model_type in mapping.model_types:
                out[model_type] = mapping
    return out


def mapping_of(config: Mapping[str, Any]) -> GPTMapping:
    """The mapping of a config.json, or `UnmappedModel` naming the mapped model types."""
    model_type = config.get("model_type")
    found = mappings().get(model_type)
    if found is None:
        known = ", ".join(sorted(mappings()))
        raise UnmappedModel(f"no megatron GPT mapping for model_type {model_type!r}; mapped: {known}")
    return found


def has_mapping(family: str) -> bool:
    """Whether megatron-core builds this miles.models family here (torch_dist then holds megatron's keys)."""
    return any(m.family == family for m in mappings().values())
