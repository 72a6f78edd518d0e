"""Stacks and image variants, loaded from images.toml.

A stack is the pinned package set of one backend's lanes (`requirements/<stack>.txt`); a
variant is one container image built for a stack. Lanes come from the CI catalog: a lane runs
the stack of its backend, and a stack's Python is the one of the lane that bears its name.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

from miles.ci.registry.catalog import Catalog, UnknownName, load_catalog, unknown_name_message

IMAGES_PATH = Path(__file__).with_name("images.toml")
REQUIREMENTS_DIR = "requirements"


class ImageConfigError(ValueError):
    """images.toml breaks one of its own rules or disagrees with the catalog."""


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
    python: str  # from the catalog lane of the same name
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

    def lanes_of_stack(self, stack: str, catalog: Catalog | None = None) -> tuple[str, ...]:
        catalog = catalog or load_catalog()
        backend = self.stack(stack).backend
        return tuple(lane.name for lane in catalog.lanes.values() if lane.backend == backend)


def stack_for_lane(lane: str, config: ImageConfig | None = None, catalog: Catalog | None = None) -> Stack:
    """The pinned stack a lane runs: the one of the lane's backend."""
    catalog = catalog or load_catalog()
    config = config or load_images()
    return config.stack_of_backend(catalog.lane(lane).backend)


@lru_cache(maxsize=4)
def load_images(path: Path | str | None = None) -> ImageConfig:
    """Read images.toml and check it against the catalog; raises ImageConfigError."""
    path = Path(path) if path is not None else IMAGES_PATH
    with open(path, "rb") as fh:
        raw = tomllib.load(fh)
    catalog = load_catalog()
    problems: list[str] = []
    stacks = {}
    for name, entry in raw.get("stacks", {}).items():
        lane = catalog.lanes.get(name)
        if lane is None:
            problems.append(f"[stacks.{name}]: no catalog lane is called '{name}'; a stack takes its name")
            continue
        if entry.get("backend") != lane.backend:
            problems.append(f"[stacks.{name}]: backend {entry.get('backend')!r} but lane runs {lane.backend}")
        stacks[name] = Stack(
            name=name,
            backend=lane.backend,
            python=lane.python,
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
    for backend in {lane.backend for lane in catalog.lanes.values()}:
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
    )
