"""Which suites a change may skip, from `git diff --name-status -z <base>...HEAD`.

Rules, in order; any doubt runs everything:
1. a path that is neither documentation nor a registered test file (code, configuration,
   conftest, a deleted test, an unreadable diff, an empty diff) runs every suite;
2. documentation only (`*.md`, `*.rst`, anything under `docs/`) skips the GPU suites and
   runs the CPU ones;
3. registered test files (plus documentation) run only the suites those files are
   registered on (enabled registrations), and skip the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from miles.ci.registry.catalog import Catalog
from miles.ci.registry.discover import Discovery

DOC_SUFFIXES = (".md", ".rst")
DOC_DIRS = ("docs/",)
# git status letters that carry one path; R and C carry two (old, new).
_ONE_PATH = frozenset("AMDTU")
_TWO_PATHS = frozenset("RC")


@dataclass(frozen=True)
class Change:
    status: str  # git's letter: A, M, D, T, U, R, C
    path: str
    old_path: str | None = None


@dataclass(frozen=True)
class Affected:
    run: list[str]  # suites to run, catalog order
    skip: dict[str, str] = field(default_factory=dict)  # suite -> why it may be skipped
    reason: str = ""

    def to_json(self) -> dict:
        return {"run": self.run, "skip": self.skip, "reason": self.reason}

    def to_text(self) -> str:
        lines = [self.reason]
        lines += [f"run   {name}" for name in self.run]
        lines += [f"skip  {name}: {why}" for name, why in self.skip.items()]
        return "\n".join(lines) + "\n"


def parse_name_status(raw: bytes) -> list[Change]:
    """Changes from `git diff --name-status -z` output; raises ValueError when it is not that."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"the diff is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    tokens = text.split("\0")
    if tokens and tokens[-1] == "":
        tokens.pop()
    changes, i = [], 0
    while i < len(tokens):
        status = tokens[i]
        letter = status[:1]
        if letter in _ONE_PATH and (len(status) == 1 or status[1:].isdigit()) and i + 1 < len(tokens):
            changes.append(Change(letter, tokens[i + 1]))
            i += 2
        elif letter in _TWO_PATHS and status[1:].isdigit() and i + 2 < len(tokens):
            changes.append(Change(letter, tokens[i + 2], tokens[i + 1]))
            i += 3
        else:
            raise ValueError(
                f"token {i + 1} ({status[:40]!r}) is not a git status letter followed by its path(s); "
                "produce the file with `git diff --name-status -z`"
            )
    return changes


def is_doc(path: str) -> bool:
    return path.endswith(DOC_SUFFIXES) or path.startswith(DOC_DIRS)


def _everything(catalog: Catalog, reason: str) -> Affected:
    return Affected(run=list(catalog.suites), skip={}, reason=f"run everything: {reason}")


def affected_suites(raw: bytes, catalog: Catalog, discovery: Discovery) -> Affected:
    """The suites to run and to skip for the diff in `raw`."""
    try:
        changes = parse_name_status(raw)
    except ValueError as exc:
        return _everything(catalog, f"the diff cannot be read ({exc})")
    if not changes:
        return _everything(catalog, "the diff is empty")
    broken = {p.file for p in discovery.problems}
    test_suites: set[str] = set()
    tests = 0
    for change in changes:
        paths = [change.path] + ([change.old_path] if change.old_path else [])
        if all(is_doc(p) for p in paths):
            continue
        test_file = discovery.file(change.path)
        if change.status == "D" or test_file is None or change.path in broken:
            return _everything(
                catalog, f"{change.path} ({change.status}) is not documentation or a registered test"
            )
        if change.old_path and not change.old_path.startswith("tests/"):
            return _everything(catalog, f"{change.path} was moved from {change.old_path}")
        tests += 1
        test_suites.update(r.suite for r in test_file.registrations if r.enabled)
    if tests == 0:
        gpu = [s.name for s in catalog.suites.values() if s.is_gpu]
        return Affected(
            run=[s.name for s in catalog.suites.values() if not s.is_gpu],
            skip=dict.fromkeys(gpu, "documentation-only change"),
            reason=f"documentation only ({len(changes)} file(s)): GPU suites may be skipped",
        )
    return Affected(
        run=[name for name in catalog.suites if name in test_suites],
        skip={
            name: "no changed test is registered on it" for name in catalog.suites if name not in test_suites
        },
        reason=f"{tests} registered test file(s) changed (and documentation): only their suites run",
    )
