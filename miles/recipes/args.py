"""Trainer flags as data: ordered (flag, value) pairs that overlays can set, change or remove.

A value of True is a bare switch, None (or False) means "not passed" (an overlay uses it to
remove a flag), a tuple is a flag with several values, anything else is one value. Strings
may name fields of the run in braces (`{hf_checkpoint}`), filled in when the command is built.
"""

from __future__ import annotations

import string
from collections.abc import Mapping

Value = str | int | float | bool | tuple[str, ...] | None
Args = tuple[tuple[str, Value], ...]


class ArgsError(ValueError):
    pass


def merge(base: Args, override: Args) -> Args:
    """`base` with `override` applied: a shared flag keeps its place and takes the new value,
    a new flag is appended, a None value removes the flag."""
    changes = dict(override)
    out = [(flag, changes.pop(flag) if flag in changes else value) for flag, value in base]
    out += list(changes.items())
    return tuple((flag, value) for flag, value in out if value is not None and value is not False)


def drop(args: Args, prefix: str) -> Args:
    return tuple((flag, value) for flag, value in args if not flag.startswith(prefix))


def render(args: Args) -> list[str]:
    """argv tokens for the flags."""
    out: list[str] = []
    for flag, value in args:
        if value is None or value is False:
            continue
        out.append(flag)
        if value is True:
            continue
        if isinstance(value, tuple):
            out.extend(str(v) for v in value)
        else:
            out.append(_text(value))
    return out


def _text(value: Value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value)) if value else "0"
    return str(value)


def fill(args: Args, fields: Mapping[str, object], where: str) -> Args:
    """Replace `{name}` in string values with the run's fields; an unknown name is an error."""
    out = []
    for flag, value in args:
        if isinstance(value, str) and "{" in value:
            value = _format(value, fields, f"{where}: {flag}")
        out.append((flag, value))
    return tuple(out)


def _format(text: str, fields: Mapping[str, object], where: str) -> str:
    names = [name for _, name, _, _ in string.Formatter().parse(text) if name]
    missing = [n for n in names if n not in fields]
    if missing:
        raise ArgsError(
            f"{where}: unknown field {{{missing[0]}}} in {text!r}; known: {', '.join(sorted(fields))}"
        )
    return text.format(**fields)
