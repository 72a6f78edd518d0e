"""A rendered recipe command beside the reference command it follows, flag by flag, with a
reason for every difference.

A reference (`Reference`, read from miles/recipes/references/) is the command the seed
framework's launcher (radixark/miles) passes to its trainer for one configuration, quoted
token for token with the job's variables and the `Upstream` configuration it was read at.
`compare()` sets the command a recipe profile renders (what miles' launcher would run,
render-time additions included) beside it: a flag given twice with different values is an
error no reason can explain; every flag, variable or layout that differs must match a
`Deviation` (a flag name or fnmatch pattern, `env:NAME` or `layout:<GPUs>`) carrying a
one-line reason, or a `Rename` (the pinned stack spells the same setting differently: the
values are still compared); what nothing explains is UNEXPLAINED, and
`python -m miles.recipes diff` exits 1 on it.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from miles.families.facts import shown as facts_shown
from miles.parallel import ParallelLayout
from miles.recipes.args import Args, Value
from miles.recipes.upstream import Upstream

# Flags a layout comparison covers (parallel degrees, placement, engine size), kept out of the
# flag-by-flag comparison so each difference is reported once.
LAYOUT_FLAGS = frozenset(
    {flag for flag, _ in ParallelLayout().trainer_args()}
    | {"--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus-per-engine"}
)


@dataclass(frozen=True)
class Placement:
    """A parallel layout on `gpus` GPUs with rollout engines of `rollout_gpus_per_engine`."""

    gpus: int
    parallel: ParallelLayout
    rollout_gpus_per_engine: int
    hardware: str = ""  # what it runs on (H100, GB300, MI355X, ...)


@dataclass(frozen=True)
class Reference:
    """The seed framework's command for one configuration, quoted from its launcher."""

    platform: str  # cuda | rocm: the recipe form it is the reference of
    model: str  # our model name the command trains (its depth is that model's)
    source: Upstream  # where and how it was read
    argv: tuple[str, ...]  # the trainer's arguments exactly as the launcher passes them
    env: tuple[tuple[str, str], ...]  # the job's variables (see miles.recipes.upstream)

    @property
    def script(self) -> str:
        return self.source.cite()

    @property
    def args(self) -> Args:
        return pairs(self.argv)

    @property
    def layout(self) -> Placement:
        """The layout the command runs (its parallel flags; the last of a repeated one wins, as
        the trainer's argparse reads it)."""
        last = {flag: value for flag, value in self.args}

        def number(flag: str, default: int | None) -> int | None:
            value = last.get(flag)
            return default if value is None else int(str(value))

        parallel = ParallelLayout(
            tp=number("--tensor-model-parallel-size", 1), pp=number("--pipeline-model-parallel-size", 1),
            cp=number("--context-parallel-size", 1), ep=number("--expert-model-parallel-size", 1),
            etp=number("--expert-tensor-parallel-size", None), sp=last.get("--sequence-parallel") is True,
            first_stage_layers=number("--decoder-first-pipeline-num-layers", None),
            last_stage_layers=number("--decoder-last-pipeline-num-layers", None),
            vpp=number("--num-virtual-stages-per-pipeline-rank", None),
            cp_comm_type=None if last.get("--cp-comm-type") is None else str(last["--cp-comm-type"]),
        )  # fmt: skip
        gpus = number("--actor-num-nodes", 1) * number("--actor-num-gpus-per-node", 1)
        return Placement(gpus, parallel, number("--rollout-num-gpus-per-engine", 1), self.source.hardware)


@dataclass(frozen=True)
class Deviation:
    """Where a recipe is deliberately different from its reference, and why (one line)."""

    keys: tuple[str, ...]  # flags or fnmatch patterns, env:NAME, layout:<GPUs>
    reason: str
    platforms: tuple[str, ...] = ("cuda", "rocm")

    def explains(self, key: str, platform: str) -> bool:
        return platform in self.platforms and any(fnmatch.fnmatchcase(key, k) for k in self.keys)


@dataclass(frozen=True)
class Rename:
    """The same setting under another flag name in the pinned stack; the values still compare."""

    theirs: str
    ours: str
    reason: str
    platforms: tuple[str, ...] = ("cuda", "rocm")


def deviation(*keys: str, reason: str, platforms: tuple[str, ...] = ("cuda", "rocm")) -> Deviation:
    return Deviation(tuple(keys), reason, platforms)


def renamed(theirs: str, ours: str, *, reason: str, platforms: tuple[str, ...] = ("cuda", "rocm")) -> Rename:
    return Rename(theirs, ours, reason, platforms)


def pairs(tokens: Sequence[str]) -> Args:
    """argv tokens as (flag, value) pairs in order, repeats kept: a switch is True, several
    values a tuple."""
    out: list[tuple[str, Value]] = []
    for token in tokens:
        if token.startswith("--"):
            out.append((token, True))
            continue
        if not out:
            raise ValueError(f"value {token!r} before any flag in {' '.join(tokens)!r}")
        flag, value = out[-1]
        if value is True:
            value = token
        else:
            value = (*value, token) if isinstance(value, tuple) else (value, token)
        out[-1] = (flag, value)
    return tuple(out)


def flags(text: str) -> Args:
    """A command line as (flag, value) pairs (see `pairs`)."""
    return pairs(shlex.split(text))


def grouped(tokens: Sequence[str]) -> list[str]:
    """argv as one shell-quoted `--flag value...` string per flag (how references store it)."""
    out: list[list[str]] = []
    for token in tokens:
        if token.startswith("--") or not out:
            out.append([token])
        else:
            out[-1].append(token)
    return [shlex.join(group) for group in out]


@dataclass(frozen=True)
class Line:
    kind: str  # "~" differs, "+" ours only, "-" reference only, "=" renamed, "!" an error in our command
    key: str
    ours: str
    theirs: str
    reason: str | None  # None: unexplained

    def render(self) -> str:
        if self.kind == "~":
            text = f"~ {self.key}: ours {self.ours}, reference {self.theirs}"
        elif self.kind == "+":
            text = f"+ {self.key}{_value(self.ours)}: ours only"
        elif self.kind == "-":
            text = f"- {self.key}{_value(self.theirs)}: reference only"
        elif self.kind == "=":
            text = f"= {self.key} {self.ours}: the reference's {self.theirs}"
        else:
            text = f"! {self.key}: {self.ours}"
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


_PATTERN_PART = re.compile(r"^\[(\d)\]\*(\d+)$")


def shown(value: object, flag: str = "") -> str:
    """A flag value as the comparison prints it: as the facts table shows it (numbers by value,
    1e-06 == 0.000001), Megatron's --moe-layer-freq patterns by the layers they describe
    ([1]*4 == [1,1,1,1]), and a directory with or without its trailing slash alike."""
    if flag == "--moe-layer-freq" and isinstance(value, str):
        expanded = _layer_pattern(value)
        if expanded is not None:
            return expanded
    text = facts_shown(value)
    if isinstance(value, str) and text == value and len(text) > 1 and text.endswith("/") and "/" in text[:-1]:
        return text[:-1]  # a dir is a dir
    return text


def _layer_pattern(text: str) -> str | None:
    """`[0]*3+[1]*2` or `[0,0,0,1,1]` as `[0,0,0,1,1]`; None for anything else."""
    text = text.replace(" ", "")
    if re.fullmatch(r"\[[01](,[01])*\]", text):
        return text
    layers: list[str] = []
    for part in text.split("+"):
        match = _PATTERN_PART.match(part)
        if match is None:
            return None
        layers += [match[1]] * int(match[2])
    return "[" + ",".join(layers) + "]"


def duplicates(args: Args) -> list[tuple[str, list[str]]]:
    """Flags given more than once with different values, with the values in order."""
    seen: dict[str, list[str]] = {}
    for flag, value in args:
        seen.setdefault(flag, []).append(shown(value, flag))
    return [(flag, values) for flag, values in seen.items() if len(set(values)) > 1]


def twice(values: Sequence[str]) -> str:
    return f"given {len(values)} times with different values ({' then '.join(values)}); the trainer keeps the last"


def compare(
    ours_argv: Sequence[str],
    ours_env: Mapping[str, str],
    ours_layout: Placement,
    reference: Reference,
    deviations: Iterable[Deviation | Rename],
) -> Comparison:
    """A rendered command beside `reference`; each difference carries the reason of the first
    deviation that explains it (on `reference.platform`), or None."""
    platform = reference.platform
    explained = [d for d in deviations if isinstance(d, Deviation)]
    renames = {r.theirs: r for r in deviations if isinstance(r, Rename) and platform in r.platforms}

    def why(key: str) -> str | None:
        return next((d.reason for d in explained if d.explains(key, platform)), None)

    ours_args = pairs(ours_argv)
    lines = [Line("!", flag, twice(values), "", None) for flag, values in duplicates(ours_args)]
    agree = 0
    ours = {flag: shown(v, flag) for flag, v in ours_args if flag not in LAYOUT_FLAGS}
    theirs = {flag: shown(v, flag) for flag, v in reference.args if flag not in LAYOUT_FLAGS}
    for old, rename in renames.items():
        if old in theirs and rename.ours in ours and rename.ours not in theirs:
            theirs[rename.ours] = theirs.pop(old)
            if theirs[rename.ours] == ours[rename.ours]:
                lines.append(Line("=", rename.ours, ours[rename.ours], old, rename.reason))
                del theirs[rename.ours], ours[rename.ours]
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
    mine, theirs_layout = _layout_text(ours_layout), _layout_text(reference.layout)
    if mine == theirs_layout:
        agree += 1
    else:
        key = f"layout:{ours_layout.gpus}"
        lines.append(Line("~", key, mine, theirs_layout, why(key)))
    return Comparison(reference, agree, tuple(lines))


def _layout_text(layout: Placement) -> str:
    return (
        f"{layout.gpus} GPU(s) {layout.parallel.describe()}, "
        f"{layout.rollout_gpus_per_engine} GPU(s) per rollout engine"
    )
