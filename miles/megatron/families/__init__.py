"""The megatron-core GPT mapping of each model family, found by config.json's model_type.

A mapping says what megatron-core needs to build a family's model that the facts table
(`miles.models`) does not: the TransformerConfig switches megatron-core spells its own way
(normalisation, qk-norm, which layers are MoE, how top-k weights are renormalised), the
config values it refuses, and where every row of a decoder layer's megatron weights comes
from in the Hugging Face checkpoint; and, for a family megatron-core's GPT layers do not
build as they are, its own layer spec, what it adds to a built model chunk, and where the
weights outside the decoder layers come from. Adding a family: one module here defining
`MAPPINGS`.
Importing this package imports no torch and no megatron-core.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from miles.megatron.hf_names import Weights


class UnmappedModel(ValueError):
    """A config megatron-core's GPTModel cannot be built from (the message names the key and the fix)."""


@dataclass(frozen=True)
class GPTMapping:
    family: str  # the miles.models family it builds
    model_types: tuple[str, ...]
    refuse_unmapped: Callable[[Mapping[str, Any]], None]  # raises UnmappedModel for what it cannot map
    # the TransformerConfig fields of the model (the facts table's, and what the family adds)
    transformer_fields: Callable[[Mapping[str, Any]], dict]
    # one decoder layer's weights: (config, layer index, megatron prefix)
    layer_weights: Callable[[Mapping[str, Any], int, str], Weights]
    # megatron.core.transformer's config class the fields fill (MLA models: "MLATransformerConfig")
    config_class: str = "TransformerConfig"
    # The family's own decoder block spec, (TransformerConfig, config, vp_stage, *, impl) -> the
    # spec, `impl` as miles.megatron.spec names it (None: megatron-core's Transformer Engine GPT
    # spec, miles.megatron.spec)
    block_spec: Callable[..., Any] | None = None
    # What it adds to a built model chunk, already in the parameter dtype (carried MTP layers,
    # frozen or float32 parameters) and refuses (a chunk that cannot run alone):
    # (model, TransformerConfig, config, vp_stage, *, impl) -> None
    finish_model: Callable[..., None] | None = None
    # The weights outside the decoder layers it adds (MTP layers): (config) -> Weights
    extra_weights: Callable[[Mapping[str, Any]], Weights] | None = None
    # Megatron-LM arguments common.pt records beyond the shared ones: (config) -> {name: value}
    lm_args: Callable[[Mapping[str, Any]], dict] | None = None
    # The first stage's weights beyond the word embedding (an embedding norm): (config) -> Weights
    embedding_weights: Callable[[Mapping[str, Any]], Weights] | None = None
    # GPTModel's position_embedding_type ("none": position comes from the layers themselves)
    position_embedding_type: str = "rope"
    # The checkpoint's names of the word embedding, final norm and output layer, when they are not
    # model.embed_tokens / model.norm / lm_head: (config) -> (embedding, norm, head)
    outer_names: Callable[[Mapping[str, Any]], tuple[str, str, str]] | None = None
    # config.json as the decoder's config the rest reads (a multimodal release nests it under
    # text_config with keys of its own): (config.json) -> config
    decoder_config: Callable[[Mapping[str, Any]], dict] | None = None
    # Checkpoint tensors outside the decoder that megatron's model leaves out, by name prefix:
    # ((prefix, what they are), ...); the conversion names them in its report
    not_decoder: tuple[tuple[str, str], ...] = ()
    # A family whose model is not a GPTModel builds its chunks itself:
    # (TransformerConfig, config, vocab_size, vp_stage, *, impl) -> this rank's model chunk, in the
    # parameter dtype (block_spec and finish_model are then unused)
    build_model: Callable[..., Any] | None = None
    # That model's weights, all of them (embedding, layers, head, extras), in place of the GPT
    # layout built from layer_weights: (config) -> Weights
    weights: Callable[[Mapping[str, Any]], Weights] | None = None
    # The name a checkpoint holding `present` tensors gives one of `weights`' HF names, for a family
    # whose published files spell names another way: (name, present) -> name, UnmappedModel if absent
    source_name: Callable[[str, Collection[str]], str] | None = None
    # The transformers class's name of one of `weights`' HF (checkpoint file) names, for a family
    # whose class renames its checkpoint's tensors on load (the built-in rollout engine loads these):
    # (name) -> name; None: the class keeps the checkpoint's names
    model_name: Callable[[str], str] | None = None
    # How many rows a pipeline stage sends the next per sequence row: a model carrying several
    # residual streams between layers sends them as [s, rows x streams, d] (megatron-core's
    # schedules size their p2p buffers from micro_batch_size): (config) -> int
    pipeline_rows: Callable[[Mapping[str, Any]], int] | None = None
    # Tokens the conversion's logit check runs through: long enough to reach every attention path
    probe_length: int = 24


@cache
def mappings() -> dict[str, GPTMapping]:
    """Every mapping, by model_type: each module of this package defines MAPPINGS."""
    out: dict[str, GPTMapping] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        for mapping in importlib.import_module(f"{__name__}.{info.name}").MAPPINGS:
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


def decoder_config(config: Mapping[str, Any]) -> dict:
    """A config.json as its family's mapping, the weight layout, the model flags' check and the
    trainer read it: the decoder's own config, normalised as transformers normalises it (a model
    type without a mapping, or whose mapping reads config.json as it is, is returned as it is)."""
    mapping = mappings().get(config.get("model_type"))
    if mapping is None or mapping.decoder_config is None:
        return dict(config)
    return mapping.decoder_config(config)


def read_config(hf_dir: str | Path) -> dict:
    """`decoder_config` of the config.json in a Hugging Face model directory."""
    return decoder_config(json.loads((Path(hf_dir) / "config.json").read_text()))


def has_mapping(family: str) -> bool:
    """Whether megatron-core builds this miles.models family here (torch_dist then holds megatron's keys)."""
    return any(m.family == family for m in mappings().values())
