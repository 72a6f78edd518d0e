"""Find test files and read their registrations from the syntax tree, never importing them.

`discover()` walks `tests/` for `test_*.py`, reads the top-level `register_*_ci(...)` and
`register_ci_gate(...)` calls, checks every rule the catalog implies, and returns frozen
records plus the problems it found. Each problem names file:line, the value, the rule and
the fix.
"""

from __future__ import annotations

import ast
import io
import os
import re
import stat
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from miles.ci.register import BACKEND_OF_MARKER, MARKERS
from miles.ci.registry.catalog import Catalog, load_catalog
from miles.ci.registry.discover_cache import DiscoveryCache
from miles.ci.registry.registration import GateDeclaration, Problem, Registration, TestFile
from miles.ci.registry.rules import disabled_reason_problem, read_test_file

__all__ = [
    "Discovery",
    "DiscoveryError",
    "GateDeclaration",
    "Problem",
    "Registration",
    "TestFile",
    "disabled_reason_problem",
    "discover",
    "iter_test_files",
    "parse_test_file",
]

MAX_SOURCE_BYTES = 64 << 20  # a test file larger than this is refused unread

_MARKER_RE = re.compile(r"\b(?:" + "|".join(MARKERS) + r")\b")
# A line that can start a new top-level statement: column 0, not blank, not a comment,
# not a closing bracket of the statement before it.
_TOP_LEVEL_LINE = re.compile(r"\n(?=[^\s#)\]}])")


class DiscoveryError(ValueError):
    def __init__(self, problems: tuple[Problem, ...]):
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


@dataclass(frozen=True)
class Discovery:
    root: Path
    files: tuple[TestFile, ...]
    problems: tuple[Problem, ...]
    _by_path: dict[str, TestFile] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._by_path.update({f.path: f for f in self.files})

    @property
    def registrations(self) -> tuple[Registration, ...]:
        return tuple(r for f in self.files for r in f.registrations)

    @property
    def gates(self) -> tuple[GateDeclaration, ...]:
        return tuple(g for f in self.files for g in f.gates)

    def file(self, path: str) -> TestFile | None:
        return self._by_path.get(path)

    def raise_for_problems(self) -> Discovery:
        if self.problems:
            raise DiscoveryError(self.problems)
        return self


def discover(
    root: Path | str = ".",
    *,
    tests_dir: str = "tests",
    catalog: Catalog | None = None,
    cache: bool = True,
) -> Discovery:
    """Read every `test_*.py` under `root/tests_dir`; paths in records are relative to `root`.

    With `cache` (the default), results of unchanged files come from the signed JSON cache
    `root/.miles/cache/discover.json` (miles.ci.registry.discover_cache) instead of being parsed again.
    """
    root = Path(root)
    catalog = catalog if catalog is not None else load_catalog()
    memo = DiscoveryCache(root, catalog.path) if cache else None
    files, problems, seen = [], [], set()
    base = str(root)
    for rel in iter_test_files(root, tests_dir, problems):
        path = os.path.join(base, rel)
        seen.add(rel)
        try:
            stat = os.stat(path)
        except OSError:
            stat = None
        hit = memo.get(rel, stat) if memo is not None and stat is not None else None
        if hit is None:
            hit = parse_test_file(Path(path), rel, catalog)
            if memo is not None and stat is not None:
                memo.put(rel, stat, *hit)
        files.append(hit[0])
        problems.extend(hit[1])
    if memo is not None:
        memo.prune(seen)
        memo.save()
    return Discovery(root=root, files=tuple(files), problems=tuple(problems))


def iter_test_files(
    root: Path, tests_dir: str = "tests", problems: list[Problem] | None = None
) -> Iterator[str]:
    """Posix paths (relative to root) of test_*.py files, sorted, skipping hidden dirs.

    A folder that cannot be listed is skipped; with `problems` it becomes one Problem
    that blocks no lane (its tests' backends are unknown), shown as a warning by every plan
    and failing `audit --strict`."""
    base = root / tests_dir
    if not base.is_dir():
        return
    found = []
    stack = [(str(base), tests_dir)]
    while stack:
        real, rel = stack.pop()
        try:
            with os.scandir(real) as entries:
                for entry in entries:
                    name = entry.name
                    try:
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if not name.startswith(".") and name != "__pycache__":
                            stack.append((entry.path, f"{rel}/{name}"))
                    elif name.startswith("test_") and name.endswith(".py"):
                        found.append(f"{rel}/{name}")  # not-regular files are reported when read
        except OSError as exc:
            if problems is not None:
                problems.append(
                    Problem(
                        rel,
                        1,
                        f"cannot list this folder ({exc.strerror or exc}): the test files in it are not "
                        "discovered and do not run; make it readable or remove it",
                    )
                )
    yield from sorted(found)


def parse_test_file(path: Path, rel: str, catalog: Catalog) -> tuple[TestFile, list[Problem]]:
    """Registrations, gate declarations and problems of one file (see rules.read_test_file)."""
    try:
        source = read_source(path)
    except (OSError, UnicodeDecodeError, SyntaxError, LookupError) as exc:
        return TestFile(rel, ()), [Problem(rel, 1, f"cannot read the file: {exc}")]
    try:
        tree, mentions = _parse_marker_region(source, rel)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        # MemoryError and RecursionError are the parser's own nesting limits here (a deeply
        # nested expression), not the machine running out: the file alone is unreadable
        if isinstance(exc, SyntaxError):
            line, message = exc.lineno or 1, f"syntax error, registrations cannot be read: {exc.msg}"
        else:
            why = (
                "it holds a NUL byte; remove it"
                if isinstance(exc, ValueError)
                else "an expression is nested too deeply; build it in steps or in a function"
            )
            line, message = 1, f"the Python parser gives up on this file, registrations cannot be read: {why}"
        return TestFile(rel, ()), [Problem(rel, line, message, _named_backends(source, rel, catalog))]
    try:
        return read_test_file(tree, mentions, rel, catalog)
    except (RecursionError, MemoryError):
        message = "a marker call's arguments are nested too deeply to read; write them as plain literals"
        line = next(
            (s.lineno for s in tree.body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)), 1
        )
        return TestFile(rel, ()), [Problem(rel, line, message, _named_backends(source, rel, catalog))]


def _named_backends(source: str, rel: str, catalog: Catalog) -> tuple[str, ...]:
    """The backends a file's marker names mention (and its implicit directory's backend): who
    a file that cannot be read concerns."""
    named = {BACKEND_OF_MARKER[m] for m in _MARKER_RE.findall(source) if m in BACKEND_OF_MARKER}
    implicit = catalog.implicit_for(rel)
    if implicit is not None:
        named.add(catalog.suites[implicit.suite].backend)
    return tuple(sorted(named))


def read_source(path: Path) -> str:
    """The text of a Python file as Python reads it: a UTF-8 BOM or a PEP 263 coding cookie
    is honoured. Anything but a regular file (a FIFO would block the read forever) is an
    OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path.name} is not a regular file; a test file must be one")
        if info.st_size > MAX_SOURCE_BYTES:
            raise OSError(
                f"{path.name} is {info.st_size} bytes, over the {MAX_SOURCE_BYTES}-byte limit for a test file"
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read()
    finally:
        os.close(fd)
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    return raw.decode(encoding)


def _parse_marker_region(source: str, filename: str) -> tuple[ast.Module | None, int]:
    """Parse only as much of the file as holds its markers (test bodies dominate parse time).

    Returns the tree and how many times marker names appear in the text. The cut falls on
    the first line after the last mention that could start a top-level statement. If the
    cut lands inside a string or bracket the prefix does not parse, and the whole file is
    parsed instead, so the result never depends on the shortcut.
    """
    mentions = 0
    last_end = -1
    for match in _MARKER_RE.finditer(source):
        mentions += 1
        last_end = match.end()
    if last_end < 0:
        return None, 0
    cut = _TOP_LEVEL_LINE.search(source, last_end)
    if cut is not None:
        try:
            return ast.parse(source[: cut.start() + 1], filename), mentions
        except SyntaxError:
            pass
    return ast.parse(source, filename), mentions
