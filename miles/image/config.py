"""Stacks and image variants, loaded from images.toml.

A stack is the pinned package set of one backend's lanes (`requirements/<stack>.txt`); a
variant is one container image built for a stack. The lanes are the CI's (its catalog): the
caller passes them in (`load_images(lanes=...)`, miles.ci.machine.stacks builds them from the
catalog), and then a lane runs the stack of its backend and a stack's Python is the one of the
lane that bears its name. Loaded without lanes, a stack knows no Python and nothing is checked
against the lanes. Standard library only; this package imports nothing of miles.ci.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

IMAGES_PATH = Path(__file__).with_name("images.toml")
REQUIREMENTS_DIR = "requirements"


class ImageConfigError(ValueError):
    """images.toml breaks one of its own rules or disagrees with the lanes it was loaded with."""


class UnknownName(KeyError):
    """A stack or variant images.toml does not define (bad input: exit 2, miles.exits)."""

    def __str__(self) -> str:
        return str(self.args[0])


def unknown_name_message(kind: str, name: str, known) -> str:
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"; did you mean '{close[0]}'?" if close else ";"
    return f"{kind} '{name}' is not in {IMAGES_PATH.name}{hint} known: {', '.join(known)}"


@dataclass(frozen=True)
class LaneFacts:
    """What images.toml needs of one CI lane: its name, backend and Python."""

    name: str
    backend: str
    python: str


def normalize(name: str) -> str:
    """PEP 503 form of a distribution name, so `PyYAML`, `pyyaml` and `py_yaml` compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class SourceBuild:
    """A package the stack's image builds from source (no wheel of it exists for the stack's
    platform on the index the lock resolves on), pinned by a Dockerfile ARG."""

    dist: str  # normalized distribution name, as installed
    module: str  # what the engine imports
    pin: str  # the Dockerfile ARG that pins its source (a commit or a release)
    repo: str  # where the source comes from


@dataclass(frozen=True)
class Stack:
    name: str
    backend: str
    python: str | None  # from the lane of the same name; None when loaded without the lanes
    platform: str  # wheel platform the lock is resolved for
    torch_index: str
    torch_build: str = ""  # local version tag added to `retag` packages, e.g. rocm7.2
    retag: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    exclude: tuple[str, ...] = ()
    source_builds: tuple[SourceBuild, ...] = ()
    engine_modules: tuple[str, ...] = ()  # what the lanes' rollout engine imports (preflight imports each)

    @property
    def lock_path(self) -> str:
        return f"{REQUIREMENTS_DIR}/{self.name}.txt"

    @property
    def input_path(self) -> str:
        return f"{REQUIREMENTS_DIR}/{self.name}.in"

    def excluded(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(normalize(name), pattern) for pattern in self.exclude)


@dataclass(frozen=True)
class Variant:
    name: str
    stack: str
    dockerfile: str
    platform: str
    patches: tuple[str, ...]  # directories of *.patch files, relative to the project root
    build_args: tuple[tuple[str, str], ...]
    description: str


@dataclass(frozen=True)
class ImageConfig:
    path: Path
    image: str
    build_scripts: tuple[str, ...]
    stacks: Mapping[str, Stack]
    variants: Mapping[str, Variant]
    lanes: tuple[LaneFacts, ...] = ()  # the lanes it was loaded with

    def stack(self, name: str) -> Stack:
        if name not in self.stacks:
            raise UnknownName(unknown_name_message("stack", name, self.stacks))
        return self.stacks[name]

    def variant(self, name: str) -> Variant:
        if name not in self.variants:
            raise UnknownName(unknown_name_message("image variant", name, self.variants))
        return self.variants[name]

    def stack_of_backend(self, backend: str) -> Stack:
        for stack in self.stacks.values():
            if stack.backend == backend:
                return stack
        raise UnknownName(f"no stack in {self.path.name} serves backend '{backend}'")

    def lanes_of_stack(self, stack: str) -> tuple[str, ...]:
        """The lanes (of those it was loaded with) that run `stack`: the lanes of its backend."""
        backend = self.stack(stack).backend
        return tuple(lane.name for lane in self.lanes if lane.backend == backend)


@lru_cache(maxsize=4)
def load_images(path: Path | str | None = None, lanes: tuple[LaneFacts, ...] | None = None) -> ImageConfig:
    """Read images.toml and, given the CI's `lanes`, check it against them; raises ImageConfigError."""
    path = Path(path) if path is not None else IMAGES_PATH
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    by_name = {lane.name: lane for lane in lanes or ()}
    problems: list[str] = []
    stacks = {}
    for name, entry in raw.get("stacks", {}).items():
        lane = by_name.get(name)
        if lanes is not None and lane is None:
            problems.append(f"[stacks.{name}]: no catalog lane is called '{name}'; a stack takes its name")
            continue
        if lane is not None and entry.get("backend") != lane.backend:
            problems.append(f"[stacks.{name}]: backend {entry.get('backend')!r} but lane runs {lane.backend}")
        stacks[name] = Stack(
            name=name,
            backend=lane.backend if lane is not None else entry.get("backend", ""),
            python=lane.python if lane is not None else None,
            platform=entry["platform"],
            torch_index=entry["torch_index"],
            torch_build=entry.get("torch_build", ""),
            retag=tuple(normalize(n) for n in entry.get("retag", ())),
            rename=tuple((normalize(k), v) for k, v in entry.get("rename", {}).items()),
            exclude=tuple(entry.get("exclude", ())),
            source_builds=tuple(
                SourceBuild(normalize(b["dist"]), b["module"], b["pin"], b.get("repo", ""))
                for b in entry.get("source_builds", ())
            ),
            engine_modules=tuple(entry.get("engine_modules", ())),
        )
        if stacks[name].retag and not stacks[name].torch_build:
            problems.append(f"[stacks.{name}]: `retag` needs `torch_build`")
    backends = {lane.backend for lane in by_name.values()} or {s.backend for s in stacks.values()}
    for backend in sorted(backends):
        serving = [s.name for s in stacks.values() if s.backend == backend]
        if len(serving) != 1:
            problems.append(f"backend '{backend}' needs exactly one stack, has {serving or 'none'}")
    variants = {}
    for name, entry in raw.get("variants", {}).items():
        if entry.get("stack") not in stacks:
            problems.append(f"[variants.{name}]: stack {entry.get('stack')!r} is not in [stacks]")
        variants[name] = Variant(
            name=name,
            stack=entry.get("stack", ""),
            dockerfile=entry["dockerfile"],
            platform=entry.get("platform", "linux/amd64"),
            patches=tuple(entry.get("patches", ())),
            build_args=tuple(sorted(entry.get("build_args", {}).items())),
            description=entry.get("description", ""),
        )
    if problems:
        raise ImageConfigError(f"{path}: " + "; ".join(problems))
    return ImageConfig(
        path=path,
        image=raw["image"],
        build_scripts=tuple(raw.get("build_scripts", ())),
        stacks=MappingProxyType(stacks),
        variants=MappingProxyType(variants),
        lanes=tuple(lanes or ()),
    )


def stack_python(stack: Stack) -> str:
    """The stack's Python version; a config loaded without the lanes has none."""
    if stack.python is None:
        raise ImageConfigError(
            f"stack '{stack.name}' has no Python here: load images.toml with the CI's lanes "
            "(miles.ci.machine.stacks.image_config())"
        )
    return stack.python
