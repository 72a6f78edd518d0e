"""How miles' commands end on an error: one line on stderr and an exit code, never a traceback.

Exit codes of every command and invoke task: 0 fine, 1 it ran and failed or found problems
(a missing package or tool named with how to get it, a build that failed), 2 bad input (an
unknown name, a malformed value), 3 the machine cannot run a lane (preflight). A reader that
closes the output early (`python -m miles.ci list --json | head`) ends the command quietly
with 141, as SIGPIPE ends any other tool. Standard library only.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import tomllib
from pathlib import Path

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# Errors that mean the command was given something it cannot use, by class name, so that this
# module imports none of the packages that define them.
USAGE_ERRORS = (
    "UnknownName", "UsageError", "UnknownRecipe", "UnknownModel", "PlanError", "PolicyError", "BadTag",
    "BadSetting",
)  # fmt: skip
# Errors whose message already says what failed and why, in one line.
FAILURES = ("ImageError", "LockFailed", "CheckpointError", "StoreError", "StoreUnreachable")


class OneLineParser(argparse.ArgumentParser):
    """A command line whose usage errors are one line and exit 2: the flag and what is wrong,
    not the whole usage text. Flags are matched by their exact spelling (no abbreviations: a
    `--coloc` is refused, not taken for `--colocate`); subcommands' parsers are the same."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (--help lists the commands and flags)\n")


def quiet_broken_pipe() -> int:
    """Stop writing to a closed pipe: point stdout at /dev/null (so the interpreter's last
    flush cannot complain) and return the exit code SIGPIPE would give."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def describe(exc: BaseException, command: str) -> tuple[str, int] | None:
    """(the one line to print, the exit code) for an error a person can act on, or None for
    a bug, which keeps its traceback."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    if names & set(USAGE_ERRORS):
        return f"error: {exc}", EXIT_USAGE
    if names & set(FAILURES):
        return f"error: {exc}", EXIT_FAILED
    if isinstance(exc, ModuleNotFoundError):
        line = missing_package(exc, command)
        return (line, EXIT_FAILED) if line else None
    return None


def missing_package(exc: ModuleNotFoundError, command: str) -> str | None:
    """One line naming the package `command` needs and the extra of miles that installs it;
    None when the missing module is miles' own (a bug)."""
    top = (exc.name or "").split(".")[0]
    if not top or top == "miles":
        return None
    extras = extras_providing(top)
    how = (
        f"pip install 'miles[{','.join(extras)}]' or the lane's stack"
        if extras
        else f"pip install {top} or the lane's stack"
    )
    return (
        f"error: {command} needs the Python package '{top}', which is not installed here; "
        f"install it ({how}: pip install -r requirements/cpu.txt)"
    )


def extras_providing(module: str) -> list[str]:
    """The optional-dependency groups of miles (pyproject.toml) that install `module`."""
    groups = _extras()
    key = _normalize(module)
    return sorted(
        name
        for name, requirements in groups.items()
        if any(_normalize(r) == key or _normalize(r).startswith(key + "-") for r in requirements)
    )


def _extras() -> dict[str, list[str]]:
    """extra -> distribution names: from the source tree's pyproject.toml, else from the
    installed package's metadata."""
    try:
        with open(PYPROJECT, "rb") as fh:
            table = tomllib.load(fh)["project"]["optional-dependencies"]
        return {name: [_name_of(r) for r in reqs] for name, reqs in table.items()}
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        pass
    from importlib import metadata

    groups: dict[str, list[str]] = {}
    try:
        requirements = metadata.requires("miles") or []
    except metadata.PackageNotFoundError:
        return groups
    for requirement in requirements:
        extra = re.search(r"extra\s*==\s*['\"]([^'\"]+)['\"]", requirement)
        if extra:
            groups.setdefault(extra[1], []).append(_name_of(requirement))
    return groups


def _name_of(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement.strip(), maxsplit=1)[0]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
