"""A family's config.json schema: the type and range of each key it reads, and the rules between keys.

Each family declares its schema as data beside its facts rows (`Family.schema`): a tuple of the
rules below. `check_config` walks them in order (each key's own type and range first, then the
rules between keys), before anything does arithmetic on a value or builds a model from it, and
raises `ConfigRefused` naming the key, its value, the rule and the fix. A value null counts as
absent, as transformers' configs read it. The rules are the models' own (transformers'
configuration_*.py and what the modelling code indexes), never stricter. Standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LAYERS = "num_hidden_layers"
_SHOWN = 60  # characters of a value a refusal prints


class ConfigRefused(ValueError):
    """A config.json value breaks its family's schema: '<key> = <value>: <rule>; <fix>'."""

    def __init__(self, key: str, found: object, rule: str, fix: str) -> None:
        self.key, self.found, self.rule, self.fix = key, found, rule, fix
        super().__init__(f"{key} = {shown(found)}: {rule}; {fix}")


def shown(found: object) -> str:
    if found is _MISSING:
        return "(missing)"
    text = repr(found)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


_MISSING = object()


def _get(config: Mapping[str, Any], key: str) -> object:
    found = config.get(key, _MISSING)
    return _MISSING if found is None else found


def _whole(found: object) -> bool:
    return isinstance(found, int) and not isinstance(found, bool)


@dataclass(frozen=True)
class Int:
    """A whole number (not a bool, not 4096.0) of at least `low`."""

    key: str
    low: int = 1
    required: bool = True
    why: str = ""  # what the number counts, when the range needs saying

    def check(self, config: Mapping[str, Any]) -> None:
        found = _get(config, self.key)
        if found is _MISSING:
            if self.required:
                raise ConfigRefused(
                    self.key, found, "is required", f"write it (a whole number >= {self.low})"
                )
            return
        if not _whole(found) or found < self.low:  # type: ignore[operator]
            why = f" ({self.why})" if self.why else ""
            raise ConfigRefused(
                self.key, found, f"must be a whole number >= {self.low}{why}", "write the model's value"
            )


@dataclass(frozen=True)
class Real:
    """A number (int or float, not a bool) above `above` (None: any finite number)."""

    key: str
    above: float | None = 0.0
    required: bool = False

    def check(self, config: Mapping[str, Any]) -> None:
        found = _get(config, self.key)
        if found is _MISSING:
            if self.required:
                raise ConfigRefused(self.key, found, "is required", "write it (a number)")
            return
        ok = isinstance(found, int | float) and not isinstance(found, bool) and found == found
        ok = ok and abs(found) != float("inf") and (self.above is None or found > self.above)  # type: ignore[operator]
        if not ok:
            rule = "must be a finite number" + ("" if self.above is None else f" > {self.above:g}")
            raise ConfigRefused(self.key, found, rule, "write the model's value")


@dataclass(frozen=True)
class AtMost:
    """`key` <= `limit` (another key), e.g. the experts a token picks <= the experts there are."""

    key: str
    limit: str
    why: str

    def check(self, config: Mapping[str, Any]) -> None:
        found, limit = _get(config, self.key), _get(config, self.limit)
        if _whole(found) and _whole(limit) and found > limit:  # type: ignore[operator]
            raise ConfigRefused(
                self.key, found, f"exceeds {self.limit} = {limit} ({self.why})", f"make it at most {limit}"
            )


@dataclass(frozen=True)
class Divides:
    """`by` divides `key` (e.g. the KV heads divide the query heads: each serves a whole group)."""

    key: str
    by: str
    why: str

    def check(self, config: Mapping[str, Any]) -> None:
        found, by = _get(config, self.key), _get(config, self.by)
        if _whole(found) and _whole(by) and by and found % by:  # type: ignore[operator]
            raise ConfigRefused(
                self.key,
                found,
                f"is not a multiple of {self.by} = {by} ({self.why})",
                "write the model's values",
            )


@dataclass(frozen=True)
class PerLayer:
    """A list of one entry per decoder layer (num_hidden_layers of them), each one of `kinds`."""

    key: str
    kinds: tuple[str, ...]
    required: bool = False

    def check(self, config: Mapping[str, Any]) -> None:
        found, layers = _get(config, self.key), _get(config, LAYERS)
        if found is _MISSING:
            if self.required:
                raise ConfigRefused(self.key, found, "is required", f"write one of {self.kinds} per layer")
            return
        if not isinstance(found, list):
            raise ConfigRefused(
                self.key, found, "must be a list", f"write one of {', '.join(self.kinds)} per layer"
            )
        bad = next((k for k in found if k not in self.kinds), _MISSING)
        if bad is not _MISSING:
            raise ConfigRefused(
                self.key,
                found,
                f"entry {bad!r} is not a layer kind of this model ({', '.join(self.kinds)})",
                "write the model's kinds",
            )
        if _whole(layers) and len(found) != layers:
            raise ConfigRefused(
                self.key,
                found,
                f"has {len(found)} entries for {LAYERS} = {layers}",
                "write one entry per decoder layer",
            )


@dataclass(frozen=True)
class LayerIds:
    """A list of distinct decoder-layer indices, each in [0, num_hidden_layers)."""

    key: str

    def check(self, config: Mapping[str, Any]) -> None:
        found, layers = _get(config, self.key), _get(config, LAYERS)
        if found is _MISSING:
            return
        if not isinstance(found, list) or not all(_whole(i) for i in found):
            raise ConfigRefused(self.key, found, "must be a list of layer indices", "write whole numbers")
        if _whole(layers):
            bad = next((i for i in found if not 0 <= i < layers), None)  # type: ignore[operator]
            if bad is not None:
                raise ConfigRefused(
                    self.key,
                    found,
                    f"names layer {bad}, outside 0..{layers - 1} ({LAYERS} = {layers})",  # type: ignore[operator]
                    "name existing layers only",
                )
        twice = next((i for n, i in enumerate(found) if i in found[:n]), None)
        if twice is not None:
            raise ConfigRefused(self.key, found, f"names layer {twice} twice", "name each layer once")


Rule = Int | Real | AtMost | Divides | PerLayer | LayerIds
_OWN = (Int, Real)  # a key's own type and range: checked before the rules between keys


def check_config(schema: tuple[Rule, ...], config: Mapping[str, Any]) -> None:
    """Raise ConfigRefused for the first rule of `schema` that `config` (the decoder's config,
    aliases resolved) breaks: every key's type and range first, then the rules between keys."""
    if not isinstance(config, Mapping):
        raise ConfigRefused("config", config, "must be a JSON object", "write the model's config.json")
    for rule in schema:
        if isinstance(rule, _OWN):
            rule.check(config)
    for rule in schema:
        if not isinstance(rule, _OWN):
            rule.check(config)


# --- rules shared by families ----------------------------------------------------------------

COMMON_SCHEMA: tuple[Rule, ...] = (
    Int(LAYERS, why="decoder layers"),
    Int("hidden_size"),
    Int("num_attention_heads"),
    Int("vocab_size"),
    Int("max_position_embeddings", required=False),
    Real("rms_norm_eps"),
    Real("rope_theta"),
)
GQA_SCHEMA: tuple[Rule, ...] = (
    Int("intermediate_size"),
    Int("num_key_value_heads", required=False),
    Int("head_dim", required=False),
    Divides(
        "num_attention_heads",
        "num_key_value_heads",
        "each key/value head serves a whole group of query heads",
    ),
)
TOPK = "the experts a token picks are among the routed experts"
# Qwen2/Qwen3 (transformers' Qwen2Config/Qwen3Config): full or sliding-window attention per layer
QWEN_SCHEMA: tuple[Rule, ...] = (
    *COMMON_SCHEMA,
    *GQA_SCHEMA,
    Int("sliding_window", required=False),
    Int("max_window_layers", 0, required=False),
    PerLayer("layer_types", ("full_attention", "sliding_attention")),
)
