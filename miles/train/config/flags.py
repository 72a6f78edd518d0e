"""How a flag is declared: a section field, its argparse keywords, and the components that act on it.

A flag is declared once, as a field of one section: `flag(type=..., default=..., help=...,
by=...)`. `by` names the components of a run that act on it (the trainer, a training backend,
a rollout engine); a section's `used_by` covers the fields that name none. What a command
sets that no component of its run acts on is refused (miles.train.consumption), so a flag
nobody reads declares no consumer, and `why_not` says why where a reader would not guess it.
Standard library only.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

FLAG = "miles.flag"  # field metadata key: the add_argument keywords of a field that is a flag
BY = "miles.flag.by"  # field metadata key: the components that act on it
WHY_NOT = "miles.flag.why_not"  # field metadata key: why a component of a run may not act on it

# The components of a run, as `by` names them: the trainer, the --train-backend choices and the
# --rollout-engine choices (miles.train.consumption builds each).
TRAINER = "trainer"
FSDP, DDP, MEGATRON = "fsdp", "ddp", "megatron"
TORCH, SGLANG = "torch", "sglang"
DATA_PARALLEL = (FSDP, DDP)  # one class, miles.train.backends.torch_dp
EVERY_BACKEND = (FSDP, DDP, MEGATRON)
TRAINER_AND_BACKENDS = (TRAINER, *EVERY_BACKEND)
COMPONENTS = (TRAINER, *EVERY_BACKEND, TORCH, SGLANG)


# --- flag value types (argparse `type=`) ---------------------------------------------------


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _window(text: str) -> tuple[int, int]:
    """Megatron-LM's --window-size: two token counts, LEFT,RIGHT (a lone number would be a
    one-element tuple there, which its attention cannot use)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().lstrip("-").isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"must be LEFT,RIGHT (e.g. 512,0), got {text!r}")
    return int(parts[0]), int(parts[1])


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


# --- declaring a flag ----------------------------------------------------------------------


def flag(*, by: str | Iterable[str] | None = None, why_not: str = "", **options: Any) -> Any:
    """A section field that is the flag `--<field name with dashes>`; `options` are the keywords
    argparse's add_argument takes (type, default, choices, nargs, action, required, help). The
    field's own default is the flag's (False for a switch, a tuple for a list). `by`: the
    components that act on it (None: the section's `used_by`; () : none yet)."""
    value = False if options.get("action") == "store_true" else options.get("default")
    if isinstance(value, list):
        value = tuple(value)
    metadata: dict[str, Any] = {FLAG: options}
    if by is not None:
        metadata[BY] = _components((by,) if isinstance(by, str) else tuple(by))
    if why_not:
        metadata[WHY_NOT] = why_not
    return field(default=value, metadata=metadata)


def _components(names: tuple[str, ...]) -> frozenset[str]:
    unknown = sorted(set(names) - set(COMPONENTS))
    if unknown:
        raise ValueError(f"flag(by=...): no component {unknown}; components: {', '.join(COMPONENTS)}")
    return frozenset(names)


def _int(**by: Any) -> Any:
    return flag(type=int, **by)


def _float(**by: Any) -> Any:
    return flag(type=float, **by)


def _text(**by: Any) -> Any:
    return flag(**by)


def _switch(**by: Any) -> Any:
    return flag(action="store_true", **by)


@dataclass(frozen=True)
class Flag:
    """One command-line flag: its option string, the section field it fills, argparse's keywords,
    and the components that act on it."""

    option: str  # --rollout-batch-size
    dest: str  # rollout_batch_size: the argparse attribute and the section field
    section: str  # the name of the section it belongs to
    options: Mapping[str, Any]
    by: frozenset[str] = frozenset()  # the components that act on it
    why_not: str = ""  # why a component of a run may not act on it, where a reader would not guess

    @property
    def default(self) -> Any:
        """The value argparse gives when the flag is not passed."""
        return False if self.options.get("action") == "store_true" else self.options.get("default")


class Section:
    """A typed, frozen group of flags. `name` is its attribute on RunConfig, `title` the heading
    `--help` shows it under, `used_by` the components acting on the fields that name none."""

    name: ClassVar[str]
    title: ClassVar[str]
    used_by: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def flags(cls) -> tuple[Flag, ...]:
        default_by = _components(cls.used_by)
        return tuple(
            Flag(
                "--" + f.name.replace("_", "-"),
                f.name,
                cls.name,
                f.metadata[FLAG],
                f.metadata.get(BY, default_by),
                f.metadata.get(WHY_NOT, ""),
            )
            for f in fields(cls)  # type: ignore[arg-type]
            if FLAG in f.metadata
        )

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace):
        """The section's fields from the parsed flags (lists become tuples: sections are frozen)."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            if FLAG in f.metadata:
                value = getattr(namespace, f.name)
                values[f.name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def non_default(self) -> dict[str, Any]:
        """Option string -> value of each of the section's flags whose value is not its default:
        the section's share of the flags a command set (RunConfig.flags_set), and any value the
        validation filled in from another flag (--eps-clip-high from --eps-clip)."""
        defaults = {f.name: f.default for f in fields(self)}  # type: ignore[arg-type]
        return {
            f.option: getattr(self, f.dest) for f in self.flags() if getattr(self, f.dest) != defaults[f.dest]
        }
