"""Model facts, one table per family: config.json keys <-> Megatron flags, switches, tiny sizes.

Each family is one module here defining `FAMILY` (a `miles.models.facts.Family`); adding a
module adds the family. `family(name)` and `family_of(config)` find one; `keys_of(config)`
is the rows that read a config.json (its family's, or every family's for a config whose
model_type no family claims). Standard library only: the recipes' fact check, the layout
checker, the Megatron backend's flag check and the converter all read these tables.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any

from miles.models.facts import Family, Key, text_config

_NOT_FAMILIES = ("facts",)


def _load() -> dict[str, Family]:
    out = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name not in _NOT_FAMILIES:
            found = importlib.import_module(f"{__name__}.{info.name}").FAMILY
            if found.name != info.name:
                raise ValueError(
                    f"miles/models/{info.name}.py defines family {found.name!r}; name them alike"
                )
            out[found.name] = found
    return out


FAMILY_TABLES: Mapping[str, Family] = _load()
FAMILIES: tuple[str, ...] = tuple(FAMILY_TABLES)


class UnknownFamily(ValueError):
    pass


def family(name: str) -> Family:
    try:
        return FAMILY_TABLES[name]
    except KeyError:
        raise UnknownFamily(f"unknown model family '{name}'; known: {', '.join(FAMILIES)}") from None


def family_of(config: Mapping[str, Any]) -> Family | None:
    """The family whose model types include the config's model_type (None: no family claims it)."""
    model_type = config.get("model_type")
    return next((f for f in FAMILY_TABLES.values() if model_type in f.model_types), None)


def _every_key() -> tuple[Key, ...]:
    seen: dict[tuple[str, str], Key] = {}
    for f in FAMILY_TABLES.values():
        for row in f.keys:
            seen.setdefault((row.key, row.flag), row)
    return tuple(seen.values())


ANY_FAMILY: tuple[Key, ...] = _every_key()


def keys_of(config: Mapping[str, Any]) -> tuple[Key, ...]:
    """The rows that read `config`: its family's, else every family's."""
    found = family_of(text_config(config))
    return found.keys if found else ANY_FAMILY


__all__ = [
    "ANY_FAMILY",
    "FAMILIES",
    "FAMILY_TABLES",
    "Family",
    "Key",
    "UnknownFamily",
    "family",
    "family_of",
    "keys_of",
]
