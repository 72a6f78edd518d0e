"""What every subcommand shares: UsageError (one line, exit 2) and the --root argument."""

from __future__ import annotations

import argparse
from pathlib import Path


class UsageError(Exception):
    """Bad input from the command line; printed as one line, exit 2."""


def add_root_argument(parser: argparse.ArgumentParser) -> None:
    """--root of a command that discovers tests: it must hold a tests/ directory."""
    parser.add_argument("--root", type=Path, default=Path("."), help="project root (default: .)")
    parser.set_defaults(needs_tests=True)


def check_root(root: Path, *, needs_tests: bool) -> None:
    """UsageError unless `root` is a directory (holding tests/ when `needs_tests`): a
    mistyped --root must not read as an empty project that passes."""
    if not root.exists():
        raise UsageError(f"--root {root} does not exist")
    if not root.is_dir():
        raise UsageError(f"--root {root} is not a directory")
    if needs_tests and not (root / "tests").is_dir():
        raise UsageError(f"--root {root} has no tests/ directory; point --root at the project root")
