"""Records that discovery produces: registrations, gate declarations, problems, test files."""

from __future__ import annotations

from dataclasses import dataclass, replace

from miles.text import printable


@dataclass(frozen=True)
class Registration:
    """One `register_<backend>_ci(...)` call (or the implicit one of a file in a directory the
    catalog's [implicit] table names)."""

    backend: str
    file: str  # posix path relative to the project root
    line: int
    est_time: float
    suite: str
    labels: tuple[str, ...] = ()
    nightly: bool = False
    disabled: str | None = None
    implicit: bool = False

    @property
    def enabled(self) -> bool:
        return self.disabled is None

    def to_json(self) -> dict:
        return {
            "backend": self.backend,
            "file": self.file,
            "line": self.line,
            "est_time": self.est_time,
            "suite": self.suite,
            "labels": list(self.labels),
            "nightly": self.nightly,
            "disabled": self.disabled,
            "implicit": self.implicit,
        }


@dataclass(frozen=True)
class GateDeclaration:
    """One `register_ci_gate(...)` call; it applies to every registration of its file."""

    file: str
    line: int
    metric_key: str
    steps: str | tuple[int, ...] = "last"
    constraint: tuple[tuple[str, float], ...] = ()
    enforce: bool = False

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "line": self.line,
            "metric_key": self.metric_key,
            "steps": self.steps if isinstance(self.steps, str) else list(self.steps),
            "constraint": dict(self.constraint),
            "enforce": self.enforce,
        }


@dataclass(frozen=True)
class Problem:
    file: str
    line: int
    message: str
    # Which runs the problem concerns: the backends it touches (the refused call's, or every
    # backend the file registers for) and, for a refused registration, the suite it named;
    # for a problem of the whole file, the suites the file registers for.
    backends: tuple[str, ...] = ()
    suite: str | None = None
    refused: bool = False  # a register_*_ci(...) call refused by a rule
    suites: tuple[str, ...] = ()

    def __str__(self) -> str:
        # one visible line whatever the file is called or its literals hold
        return printable(f"{self.file}:{self.line}: {self.message}")

    def with_scope(self, backends: tuple[str, ...], suites: tuple[str, ...]) -> Problem:
        """A problem of the whole file, charged to the backends and suites the file names."""
        return self if self.backends else replace(self, backends=backends, suites=suites)

    def refusal_json(self) -> dict:
        """A refused registration as `list --json` and `manifest --json` show it."""
        return {
            "backend": self.backends[0] if self.backends else None,
            "file": self.file,
            "line": self.line,
            "suite": self.suite,
            "status": "refused",
            "rule": self.message,
        }


@dataclass(frozen=True)
class TestFile:
    path: str
    registrations: tuple[Registration, ...]
    gates: tuple[GateDeclaration, ...] = ()

    __test__ = False  # not a pytest class

    def for_backend(self, backend: str) -> tuple[Registration, ...]:
        return tuple(r for r in self.registrations if r.backend == backend)
