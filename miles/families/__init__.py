"""Model families: one folder each, found by config.json's model_type, never listed by hand.

A family's folder (`miles/families/<model_type>/`) holds everything the family is: its facts
(config.json keys <-> Megatron flags, switches, tiny sizes), its weight mapping as data, its
layout limits, the megatron-core modules GPTModel cannot build for it, and its published
models. Its `__init__.py` defines `FAMILY` (miles.families.family); adding a folder adds the
family.

    family("qwen3")                 # by name
    family_of(config)               # by config.json's model_type (None: no family claims it)
    megatron_family(config)         # ... one megatron-core builds here, else UnmappedModel
    keys_of(config)                 # the facts rows that read a config.json

Importing this package imports no torch and no megatron-core.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from miles.families.facts import Key, text_config
from miles.families.family import Family, GPTFamily, OwnModelFamily, UnmappedModel
from miles.families.weights import Weights
from miles.parallel import ModelShape


class UnknownFamily(ValueError):
    pass


@cache
def _discover() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.ispkg:
            continue
        family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
        if family.name != info.name:
            raise ValueError(f"miles/families/{info.name}/ defines family {family.name!r}; name them alike")
        found[family.name] = family
    return found


def families() -> Mapping[str, Family]:
    """Every family, by name."""
    return _discover()


def names() -> tuple[str, ...]:
    return tuple(_discover())


def family(name: str) -> Family:
    try:
        return _discover()[name]
    except KeyError:
        raise UnknownFamily(f"unknown model family '{name}'; known: {', '.join(names())}") from None


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family whose model types include the config's model_type (None: no family claims it)."""
    model_type = config.get("model_type")
    return next((f for f in _discover().values() if model_type in f.model_types), None)


def megatron_family(config: Mapping[str, Any]) -> Family:
    """The family of a config.json that megatron-core builds here, or UnmappedModel naming the
    model types it builds."""
    found = family_of(config)
    if found is None or not found.megatron:
        built = ", ".join(sorted(t for f in _discover().values() if f.megatron for t in f.model_types))
        raise UnmappedModel(
            f"no megatron model for model_type {config.get('model_type')!r}; megatron builds: {built}"
        )
    return found


def builds_with_megatron(name: str) -> bool:
    """Whether megatron-core builds this family here (its torch_dist then holds megatron's keys)."""
    return family(name).megatron


def _every_key() -> tuple[Key, ...]:
    seen: dict[tuple[str, str], Key] = {}
    for f in _discover().values():
        for row in f.keys:
            seen.setdefault((row.key, row.flag), row)
    return tuple(seen.values())


def keys_of(config: Mapping[str, Any]) -> tuple[Key, ...]:
    """The rows that read `config`: its family's, else every family's."""
    found = family_of(text_config(config))
    return found.keys if found else _every_key()


def decoder_config(config: Mapping[str, Any]) -> dict:
    """A config.json as its family, the weight layout, the model flags' check and the trainer
    read it: the decoder's own config, normalised as transformers normalises it (a model type no
    family claims is returned as it is)."""
    found = family_of(config)
    return dict(config) if found is None else found.decoder_config(config)


def trunk_config(config: Mapping[str, Any]) -> dict:
    """config.json as the transformers class that loads the checkpoint reads it (its family's
    `trunk_config`: MiMo's trunk is Qwen2's); unchanged for a model type no family claims."""
    found = family_of(config)
    return dict(config) if found is None else found.trunk_config(config)


def transformers_config(source: str | Path | Mapping[str, Any]):
    """transformers' config object of a checkpoint directory (or of a config.json's dict) for the
    class that loads it: AutoConfig's own, or, for a family whose release class transformers lacks
    (`trunk_model_type`), the trunk's model type's, with no remote code run."""
    from transformers import AutoConfig

    if isinstance(source, Mapping):
        clean = {k: v for k, v in trunk_config(source).items() if k != "auto_map"}
        return AutoConfig.for_model(**clean)
    raw = json.loads((Path(source) / "config.json").read_text())
    found = family_of(raw)
    if found is None or found.trunk_model_type is None:
        return AutoConfig.from_pretrained(source)
    return transformers_config(raw)


def trunk_loads(config: Mapping[str, Any]) -> bool:
    """Whether transformers loads the checkpoint as another model type's class (`trunk_model_type`)."""
    found = family_of(config)
    return found is not None and found.trunk_model_type is not None


def read_config(hf_dir: str | Path) -> dict:
    """`decoder_config` of the config.json in a Hugging Face model directory."""
    return decoder_config(json.loads((Path(hf_dir) / "config.json").read_text()))


def model_shape(config: Mapping[str, Any], name: str) -> ModelShape:
    """What the parallel layout rules need of the model a config.json describes (through its
    family's facts table), with the family's own limits; ValueError when the config says too
    little (no depth or heads) or no family claims it."""
    from miles.families.facts import flag_values, shared_index_layers

    config = decoder_config(config)
    found = family_of(config)
    if found is None:
        raise ValueError(
            f"{name}: config.json model_type {config.get('model_type')!r} is no family's; known: {', '.join(names())}"
        )
    flags = flag_values(found.keys, config)
    layers, heads = flags.get("--num-layers"), flags.get("--num-attention-heads")
    if not layers or not heads:
        raise ValueError(f"{name}: config.json gives no num_hidden_layers or num_attention_heads")
    return ModelShape(
        name, int(layers), int(heads), flags.get("--num-query-groups"), flags.get("--num-experts"),
        found.attention, bias=not flags.get("--disable-bias-linear", True),
        moe_ffn_hidden_size=flags.get("--moe-ffn-hidden-size"),
        shared_index_layers=shared_index_layers(config, int(layers)), limits=found.limits(config),
        vocab_size=flags.get("--vocab-size"),
    )  # fmt: skip


def layout(config: Mapping[str, Any]) -> Weights:
    """(megatron name, pieces) for every weight of the whole model of a megatron-built family."""
    return megatron_family(config).weights(config)


# Every family's name, found once when the package is imported (the families' facts are light).
FAMILIES: tuple[str, ...] = names()

__all__ = [
    "FAMILIES",
    "Family",
    "GPTFamily",
    "OwnModelFamily",
    "UnknownFamily",
    "UnmappedModel",
    "builds_with_megatron",
    "decoder_config",
    "families",
    "family",
    "family_of",
    "keys_of",
    "layout",
    "megatron_family",
    "model_shape",
    "names",
    "read_config",
    "transformers_config",
    "trunk_config",
    "trunk_loads",
]
