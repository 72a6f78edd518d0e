"""Every difference between a recipe's shared form and a platform form of it."""

from __future__ import annotations

from miles.recipes.args import Args
from miles.recipes.recipe import GROUPS, Recipe


def recipe_diff(shared: Recipe, other: Recipe) -> list[str]:
    """Lines `+ added`, `- removed`, `~ changed` for flags by group, environment, profiles and
    pins; an empty list means the two forms are the same."""
    lines: list[str] = []
    for group in GROUPS:
        lines += _section(group, _pairs(shared.group(group)), _pairs(other.group(group)), " ")
    lines += _section("env", dict(shared.env), dict(other.env), "=")
    lines += _section("pins", dict(shared.pins), dict(other.pins), "==")
    lines += _profiles(shared, other)
    return lines


def _pairs(args: Args) -> dict[str, str]:
    return {flag: _shown(value) for flag, value in args}


def _shown(value) -> str:
    if value is True:
        return ""
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def _section(title: str, old: dict[str, str], new: dict[str, str], sep: str) -> list[str]:
    def item(key: str, value: str) -> str:
        return key if value == "" else f"{key}{sep}{value}"

    body = []
    for key in old:
        if key not in new:
            body.append(f"  - {item(key, old[key])}")
        elif old[key] != new[key]:
            body.append(f"  ~ {item(key, old[key])} -> {item(key, new[key])}")
    body += [f"  + {item(key, value)}" for key, value in new.items() if key not in old]
    return [f"{title}:", *body] if body else []


def _profiles(shared: Recipe, other: Recipe) -> list[str]:
    old = {p.key: p for p in shared.profiles}
    new = {p.key: p for p in other.profiles}
    body = [f"  - {p.describe()}" for k, p in old.items() if k not in new]
    for k, p in new.items():
        if k not in old:
            body.append(f"  + {p.describe()}  [{p.evidence()}]")
        elif old[k] != p:
            body.append(f"  ~ {old[k].describe()} -> {p.describe()}")
    return ["profiles:", *body] if body else []
