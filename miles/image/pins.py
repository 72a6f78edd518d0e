"""Read pinned requirement files and compare them with what is installed or declared.

The lock (`requirements/<stack>.txt`) is the one statement of a lane's versions. Installed
packages (a session, the CI image) and Dockerfiles are checked against it; every
difference is reported with the lock's file:line so the fix is obvious.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from miles.image.config import normalize

_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?\s*==\s*(?P<version>[^\s;#]+)")
# `name==version` inside a RUN line of a Dockerfile (pip/uv install arguments)
_INLINE_PIN = re.compile(
    r"(?<![\w./-])(?P<name>[A-Za-z][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==(?P<version>[\w.+!-]+)"
)
# ARG <PACKAGE>_VERSION=<version>: a Dockerfile that names a version states a pin
_ARG_VERSION = re.compile(r"^\s*ARG\s+(?P<arg>[A-Z0-9_]+)_VERSION\s*=\s*(?P<version>\S+)\s*$")
_ARG = re.compile(r"^\s*ARG\s+(?P<name>[A-Za-z0-9_]+)(?:\s*=\s*(?P<value>\S*))?\s*$")


class LockError(ValueError):
    """A requirement file that is not a full pin list."""


@dataclass(frozen=True)
class Pin:
    name: str  # normalized
    version: str
    line: int


@dataclass(frozen=True)
class Lock:
    path: str
    pins: Mapping[str, Pin]

    def where(self, name: str) -> str:
        return f"{self.path}:{self.pins[name].line}"


@dataclass(frozen=True)
class Mismatch:
    """One package whose installed or declared version differs from the lock."""

    name: str
    expected: str | None  # None: not in the lock
    found: str | None  # None: missing
    where: str  # the lock line, or the file:line that states the other version

    def __str__(self) -> str:
        if self.found is None:
            return f"{self.name}: missing, lock pins {self.expected} ({self.where})"
        if self.expected is None:
            return f"{self.name}: {self.found} is not in the lock ({self.where})"
        return f"{self.name}: found {self.found}, lock pins {self.expected} ({self.where})"


def parse_lock(path: Path | str, *, root: Path | None = None) -> Lock:
    """Every `name==version` line of a requirement file; anything unpinned is an error."""
    path = Path(path)
    shown = path.relative_to(root).as_posix() if root else path.as_posix()
    pins: dict[str, Pin] = {}
    problems = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        text = raw.split(" #", 1)[0].strip()
        if not text or text.startswith("#"):
            continue
        if text.startswith("-"):
            problems.append(f"{shown}:{number}: option {text!r}; a lock names packages only")
            continue
        match = _PIN.match(text)
        if not match:
            problems.append(f"{shown}:{number}: {text!r} is not pinned as name==version")
            continue
        name = normalize(match["name"])
        if name in pins:
            problems.append(f"{shown}:{number}: {name} is pinned twice (also line {pins[name].line})")
        pins[name] = Pin(name, match["version"], number)
    if problems:
        raise LockError("\n".join(problems))
    return Lock(shown, pins)


def installed_versions() -> dict[str, str]:
    """Normalized name -> version of every distribution the running interpreter sees."""
    from importlib import metadata

    found = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            found.setdefault(normalize(name), dist.version)
    return found


def versions_match(expected: str, found: str) -> bool:
    """Equal versions; a lock pin without a local tag (+cpu) also accepts a tagged build."""
    if expected == found:
        return True
    return "+" not in expected and found.split("+", 1)[0] == expected


def diff_installed(
    lock: Lock, installed: Mapping[str, str], *, ignore: Iterable[str] = ("miles",)
) -> list[Mismatch]:
    """Lock pins that are missing or at another version; extra packages are not a mismatch."""
    skip = {normalize(n) for n in ignore}
    out = []
    for name, pin in sorted(lock.pins.items()):
        if name in skip:
            continue
        found = installed.get(name)
        if found is None or not versions_match(pin.version, found):
            out.append(Mismatch(name, pin.version, found, lock.where(name)))
    return out


def extra_installed(lock: Lock, installed: Mapping[str, str], *, ignore: Iterable[str] = ()) -> list[str]:
    skip = {normalize(n) for n in ignore} | {"pip", "setuptools", "wheel"}
    return sorted(n for n in installed if n not in lock.pins and n not in skip)


@dataclass(frozen=True)
class DeclaredPin:
    name: str
    version: str
    where: str  # dockerfile:line
    from_arg: bool  # ARG <PKG>_VERSION=..., as opposed to pkg==version in a RUN line


def dockerfile_pins(path: Path | str, *, root: Path | None = None) -> list[DeclaredPin]:
    """Versions a Dockerfile states: `ARG <PKG>_VERSION=` lines and `pkg==version` in RUN."""
    path = Path(path)
    shown = path.relative_to(root).as_posix() if root else path.as_posix()
    declared = []
    in_run = False
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        arg = _ARG_VERSION.match(line)
        if arg:
            name = normalize(arg["arg"].replace("_", "-"))
            declared.append(DeclaredPin(name, arg["version"], f"{shown}:{number}", True))
            continue
        in_run = stripped.upper().startswith("RUN ") or (in_run and bool(stripped))
        if in_run:
            for match in _INLINE_PIN.finditer(stripped):
                pin = DeclaredPin(normalize(match["name"]), match["version"], f"{shown}:{number}", False)
                declared.append(pin)
        in_run = in_run and stripped.endswith("\\")
    return declared


def check_dockerfile(dockerfile: Path | str, lock: Lock, *, root: Path | None = None) -> list[Mismatch]:
    """Versions the Dockerfile states for packages the lock pins, where they disagree.

    An `ARG X_VERSION` for something the lock does not pin (a ROCm or CUDA release) is not a
    package pin and is ignored; a `pkg==version` for a package outside the lock is reported,
    because the image would then carry a version nothing else checks.
    """
    out = []
    for declared in dockerfile_pins(dockerfile, root=root):
        pin = lock.pins.get(declared.name)
        if pin is None:
            if not declared.from_arg:
                out.append(Mismatch(declared.name, None, declared.version, declared.where))
            continue
        if not versions_match(pin.version, declared.version):
            out.append(
                Mismatch(
                    declared.name,
                    pin.version,
                    declared.version,
                    f"{declared.where} vs {lock.where(pin.name)}",
                )
            )
    return out


def dockerfile_args(path: Path | str, *, root: Path | None = None) -> dict[str, tuple[str, str]]:
    """Every `ARG NAME=default` of a Dockerfile: name -> (default, file:line); the last one wins."""
    path = Path(path)
    shown = path.relative_to(root).as_posix() if root else path.as_posix()
    found = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _ARG.match(line)
        if match and match["value"]:
            found[match["name"]] = (match["value"], f"{shown}:{number}")
    return found
