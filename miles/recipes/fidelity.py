"""A recipe beside the reference recipe it follows, flag by flag, with a reason for every difference.

The reference is the seed framework's own recipe (radixark/miles: `scripts/run_<name>.py`,
`scripts/amd/run_<name>.py` and the model scripts they load), typed in as facts: the trainer
flags it passes for the CI shape, the environment it sets (its launcher's included) and the
parallel layout it verified per GPU count (`Reference`, in miles/recipes/references/).
`compare()` sets a recipe form beside it: every flag, variable or layout that differs must
match a `Deviation` (a flag name or fnmatch pattern, `env:NAME` or `layout:<GPUs>`) carrying
a one-line reason; what none explains is UNEXPLAINED, and `python -m miles.recipes diff`
exits 1 on it.
"""

from __future__ import annotations

import fnmatch
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from miles.models.facts import shown
from miles.parallel import ParallelLayout
from miles.recipes.args import Args, Value

# Flags a layout comparison covers (parallel degrees, placement, engine size), kept out of the
# flag-by-flag comparison so each difference is reported once.
LAYOUT_FLAGS = frozenset(
    {flag for flag, _ in ParallelLayout().trainer_args()}
    | {"--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus-per-engine"}
)


@dataclass(frozen=True)
class Placement:
    """A parallel layout the reference runs on `gpus` GPUs (one node unless `nodes`)."""

    gpus: int
    parallel: ParallelLayout
    rollout_gpus_per_engine: int
    hardware: str = ""  # what the reference states it for (H100, GB200, MI355X, ...)


@dataclass(frozen=True)
class Reference:
    platform: str  # cuda | rocm
    script: str  # repository, path and commit it was read from
    model_script: str  # where the model flags come from
    model: str  # our model name the flags are for (the depth of --num-layers)
    args: Args  # trainer flags, model flags included; paths as {fields}
    env: tuple[tuple[str, str], ...]  # variables the script and its launcher set
    layouts: tuple[Placement, ...]


@dataclass(frozen=True)
class Deviation:
    """Where a recipe is deliberately different from its reference, and why (one line)."""

    keys: tuple[str, ...]  # flags or fnmatch patterns, env:NAME, layout:<GPUs>
    reason: str
    platforms: tuple[str, ...] = ("cuda", "rocm")

    def explains(self, key: str, platform: str) -> bool:
        return platform in self.platforms and any(fnmatch.fnmatchcase(key, k) for k in self.keys)


def deviation(*keys: str, reason: str, platforms: tuple[str, ...] = ("cuda", "rocm")) -> Deviation:
    return Deviation(tuple(keys), reason, platforms)


def flags(text: str) -> Args:
    """A command line as (flag, value) pairs: a switch is True, several values a tuple."""
    out: list[tuple[str, Value]] = []
    for token in shlex.split(text):
        if token.startswith("--"):
            out.append((token, True))
            continue
        if not out:
            raise ValueError(f"value {token!r} before any flag in {text!r}")
        flag, value = out[-1]
        if value is True:
            value = token
        else:
            value = (*value, token) if isinstance(value, tuple) else (value, token)
        out[-1] = (flag, value)
    return tuple(out)


@dataclass(frozen=True)
class Line:
    kind: str  # "~" differs, "+" ours only, "-" reference only
    key: str
    ours: str
    theirs: str
    reason: str | None  # None: unexplained

    def render(self) -> str:
        if self.kind == "~":
            text = f"~ {self.key}: ours {self.ours}, reference {self.theirs}"
        elif self.kind == "+":
            text = f"+ {self.key}{_value(self.ours)}: ours only"
        else:
            text = f"- {self.key}{_value(self.theirs)}: reference only"
        return f"{text}  [{self.reason}]" if self.reason else f"{text}  UNEXPLAINED"


def _value(text: str) -> str:
    return "" if text in ("", "on") else f" {text}"


@dataclass(frozen=True)
class Comparison:
    reference: Reference
    agree: int  # flags, variables and layouts that are the same
    lines: tuple[Line, ...]

    @property
    def unexplained(self) -> tuple[Line, ...]:
        return tuple(line for line in self.lines if line.reason is None)


def compare(
    ours_args: Args,
    ours_env: Mapping[str, str],
    ours_layouts: Iterable[Placement],
    reference: Reference,
    deviations: Iterable[Deviation],
) -> Comparison:
    """`ours` beside `reference`; each difference carries the reason of the first deviation
    that explains it (platform `reference.platform`), or None."""
    deviations = tuple(deviations)
    platform = reference.platform

    def why(key: str) -> str | None:
        return next((d.reason for d in deviations if d.explains(key, platform)), None)

    lines: list[Line] = []
    agree = 0
    ours = {flag: shown(v) for flag, v in ours_args if flag not in LAYOUT_FLAGS}
    theirs = {flag: shown(v) for flag, v in reference.args if flag not in LAYOUT_FLAGS}
    for flag in (*ours, *(f for f in theirs if f not in ours)):
        if flag in ours and flag in theirs:
            if ours[flag] == theirs[flag]:
                agree += 1
            else:
                lines.append(Line("~", flag, ours[flag], theirs[flag], why(flag)))
        elif flag in ours:
            lines.append(Line("+", flag, ours[flag], "", why(flag)))
        else:
            lines.append(Line("-", flag, "", theirs[flag], why(flag)))
    ref_env = dict(reference.env)
    for name in (*ours_env, *(n for n in ref_env if n not in ours_env)):
        key = f"env:{name}"
        if ours_env.get(name) == ref_env.get(name):
            agree += 1
        elif name in ours_env and name in ref_env:
            lines.append(Line("~", key, ours_env[name], ref_env[name], why(key)))
        elif name in ours_env:
            lines.append(Line("+", key, f"={ours_env[name]}", "", why(key)))
        else:
            lines.append(Line("-", key, "", f"={ref_env[name]}", why(key)))
    ours_by_gpus = {layout.gpus: layout for layout in ours_layouts}
    ref_by_gpus = {layout.gpus: layout for layout in reference.layouts}
    for gpus in sorted(set(ours_by_gpus) | set(ref_by_gpus)):
        key = f"layout:{gpus}"
        mine, theirs_layout = ours_by_gpus.get(gpus), ref_by_gpus.get(gpus)
        if mine and theirs_layout and _layout_text(mine) == _layout_text(theirs_layout):
            agree += 1
        elif mine and theirs_layout:
            lines.append(Line("~", key, _layout_text(mine), _layout_text(theirs_layout), why(key)))
        elif mine:
            lines.append(Line("+", key, _layout_text(mine), "", why(key)))
        else:
            lines.append(Line("-", key, "", _layout_text(theirs_layout), why(key)))
    return Comparison(reference, agree, tuple(lines))


def _layout_text(layout: Placement) -> str:
    return f"{layout.parallel.describe()}, {layout.rollout_gpus_per_engine} GPU(s) per rollout engine"
