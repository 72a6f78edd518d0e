"""Find test files and read their registrations from the syntax tree, never importing them.

`discover()` walks `tests/` for `test_*.py`, reads the top-level `register_*_ci(...)` and
`register_ci_gate(...)` calls, checks every rule the catalog implies, and returns frozen
records plus the problems it found. Each problem names file:line, the value, the rule and
the fix.
"""

from __future__ import annotations

import ast
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from miles.ci.catalog import Catalog, UnknownName, load_catalog
from miles.ci.register import BACKEND_OF_MARKER, GATE_MARKER, MARKERS

UNIT_DIR = "unit"
IMPLICIT_SUITE = "stage-a-cpu"
IMPLICIT_EST_TIME = 15.0  # seconds; unit files are fast and rarely need their own number

_REG_PARAMS = ("est_time", "suite", "labels", "nightly", "disabled")
_REG_POSITIONAL = ("est_time", "suite")
_GATE_PARAMS = ("metric_key", "steps", "constraint", "enforce")
GATE_CONSTRAINT_KEYS = ("rel_up", "abs_floor_up", "rel_down", "abs_floor_down")

_MARKER_RE = re.compile(r"\b(?:" + "|".join(MARKERS) + r")\b")
# A line that can start a new top-level statement: column 0, not blank, not a comment,
# not a closing bracket of the statement before it.
_TOP_LEVEL_LINE = re.compile(r"\n(?=[^\s#)\]}])")
_TRACKING_REF = re.compile(r"(?:\b[\w.-]+/[\w.-]+)?#\d+\b|https?://\S+")
_WORD = re.compile(r"[a-z0-9][a-z0-9_.+/-]*")
# Words that say a test is off without saying why. A reason made only of these (plus up to
# two other words) carries no diagnosis.
_FILLER_WORDS = frozenset(
    """a an the this that it its is are be been was for to of in on at by as with when once
    until after before now still yet some sometimes randomly please see later soon again
    disable disabled disabling enable enabled re-enable reenable skip skipped skipping
    due failure failures fail fails failed failing fixme todo xxx hack tbd wip n/a na
    flaky flakey flake flakes broken breaks break unstable temporarily temporary temp
    test tests case cases passes pass passing works work working fixed fix not known
    unknown investigate investigating issue issues error errors problem problems ci
    runner runners job jobs machine machines""".split()
)


@dataclass(frozen=True)
class Registration:
    """One `register_<backend>_ci(...)` call (or the implicit one of a tests/unit/ file)."""

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

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.message}"


@dataclass(frozen=True)
class TestFile:
    path: str
    registrations: tuple[Registration, ...]
    gates: tuple[GateDeclaration, ...] = ()

    __test__ = False  # not a pytest class

    def for_backend(self, backend: str) -> tuple[Registration, ...]:
        return tuple(r for r in self.registrations if r.backend == backend)


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
) -> Discovery:
    """Read every `test_*.py` under `root/tests_dir`; paths in records are relative to `root`."""
    root = Path(root)
    catalog = catalog if catalog is not None else load_catalog()
    files, problems = [], []
    for rel in iter_test_files(root, tests_dir):
        test_file, file_problems = parse_test_file(root / rel, rel, catalog, tests_dir=tests_dir)
        files.append(test_file)
        problems.extend(file_problems)
    return Discovery(root=root, files=tuple(files), problems=tuple(problems))


def iter_test_files(root: Path, tests_dir: str = "tests") -> Iterator[str]:
    """Posix paths (relative to root) of test_*.py files, sorted, skipping hidden dirs."""
    base = root / tests_dir
    if not base.is_dir():
        return
    found = []
    stack = [(str(base), tests_dir)]
    while stack:
        real, rel = stack.pop()
        with os.scandir(real) as entries:
            for entry in entries:
                name = entry.name
                if entry.is_dir(follow_symlinks=False):
                    if not name.startswith(".") and name != "__pycache__":
                        stack.append((entry.path, f"{rel}/{name}"))
                elif name.startswith("test_") and name.endswith(".py"):
                    found.append(f"{rel}/{name}")
    yield from sorted(found)


def parse_test_file(
    path: Path, rel: str, catalog: Catalog, *, tests_dir: str = "tests"
) -> tuple[TestFile, list[Problem]]:
    """Registrations, gate declarations and problems of one file."""
    problems: list[Problem] = []
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return TestFile(rel, ()), [Problem(rel, 1, f"cannot read the file: {exc}")]
    try:
        tree = _parse_marker_region(source, rel)
    except SyntaxError as exc:
        return TestFile(rel, ()), [
            Problem(rel, exc.lineno or 1, f"syntax error, registrations cannot be read: {exc.msg}")
        ]
    reader = _FileReader(rel, catalog, problems)
    if tree is not None:
        reader.read(tree)
    registrations = reader.registrations
    in_unit = rel.startswith(f"{tests_dir}/{UNIT_DIR}/")
    if not registrations and not reader.named_a_marker:
        if in_unit:
            registrations = [Registration("cpu", rel, 0, IMPLICIT_EST_TIME, IMPLICIT_SUITE, implicit=True)]
        else:
            problems.append(
                Problem(
                    rel,
                    1,
                    "no register_*_ci(...) call: every test file outside "
                    f"{tests_dir}/{UNIT_DIR}/ must say where it runs, e.g. "
                    'register_cpu_ci(est_time=60, suite="stage-b-cpu")',
                )
            )
    return TestFile(rel, tuple(registrations), tuple(reader.gates)), problems


def _parse_marker_region(source: str, filename: str) -> ast.Module | None:
    """Parse only as much of the file as holds its markers (test bodies dominate parse time).

    The cut falls on the first line after the last marker mention that could start a
    top-level statement. If the cut lands inside a string or bracket the prefix does not
    parse, and the whole file is parsed instead, so the result never depends on the shortcut.
    """
    last_end = -1
    for match in _MARKER_RE.finditer(source):
        last_end = match.end()
    if last_end < 0:
        return None
    cut = _TOP_LEVEL_LINE.search(source, last_end)
    if cut is not None:
        try:
            return ast.parse(source[: cut.start() + 1], filename)
        except SyntaxError:
            pass
    return ast.parse(source, filename)


class _FileReader:
    def __init__(self, rel: str, catalog: Catalog, problems: list[Problem]):
        self.rel = rel
        self.catalog = catalog
        self.problems = problems
        self.registrations: list[Registration] = []
        self.gates: list[GateDeclaration] = []
        self.named_a_marker = False

    def problem(self, line: int, message: str) -> None:
        self.problems.append(Problem(self.rel, line, message))

    def read(self, tree: ast.Module) -> None:
        accepted: set[int] = set()  # id() of marker-naming nodes that are in a readable place
        for stmt in tree.body:
            if isinstance(stmt, ast.ImportFrom):
                for alias in stmt.names:
                    if alias.name in MARKERS and alias.asname in (None, alias.name):
                        accepted.add(id(alias))
            elif (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id in MARKERS
            ):
                accepted.add(id(stmt.value.func))
                self._read_call(stmt.value)
        for node in ast.walk(tree):
            self._check_placement(node, accepted)

    def _check_placement(self, node: ast.AST, accepted: set[int]) -> None:
        line = getattr(node, "lineno", 1)
        if isinstance(node, ast.alias):
            if node.name in MARKERS or node.asname in MARKERS:
                self.named_a_marker = True
                if id(node) not in accepted:
                    self.problem(
                        line,
                        f"'{node.name}' is imported as '{node.asname}': discovery reads calls by "
                        f"the marker's own name; write 'from miles.ci.register import {node.name}'",
                    )
        elif isinstance(node, ast.Name) and node.id in MARKERS:
            self.named_a_marker = True
            if id(node) not in accepted:
                self.problem(
                    line,
                    f"{node.id} is used inside a block or an expression: a registration must be "
                    f"its own top-level statement, {node.id}(...), with literal arguments",
                )
        elif isinstance(node, ast.Attribute) and node.attr in MARKERS:
            self.named_a_marker = True
            self.problem(
                line,
                f"'{ast.unparse(node)}' is an attribute call, which discovery does not read; "
                f"import it with 'from miles.ci.register import {node.attr}' and call {node.attr}(...)",
            )

    def _read_call(self, call: ast.Call) -> None:
        name = call.func.id  # type: ignore[attr-defined]
        if name == GATE_MARKER:
            args = self._arguments(call, name, _GATE_PARAMS, positional=())
            if args is not None:
                self._read_gate(call.lineno, args)
        else:
            args = self._arguments(call, name, _REG_PARAMS, positional=_REG_POSITIONAL)
            if args is not None:
                self._read_registration(call.lineno, BACKEND_OF_MARKER[name], name, args)

    def _arguments(
        self, call: ast.Call, name: str, params: tuple[str, ...], positional: tuple[str, ...]
    ) -> dict[str, object] | None:
        line = call.lineno
        args: dict[str, object] = {}
        ok = True
        for index, node in enumerate(call.args):
            if isinstance(node, ast.Starred):
                self.problem(
                    line,
                    f"{name}(*{ast.unparse(node.value)}): starred arguments cannot be read; "
                    "write each argument as a literal keyword",
                )
                ok = False
            elif index >= len(positional):
                allowed = " and ".join(positional) if positional else "no argument"
                self.problem(
                    line,
                    f"{name}: positional argument {ast.unparse(node)} (#{index + 1}) is not allowed; "
                    f"only {allowed} may be positional, pass the rest by keyword",
                )
                ok = False
            else:
                ok &= self._literal(line, name, positional[index], node, args)
        for keyword in call.keywords:
            if keyword.arg is None:
                self.problem(
                    line,
                    f"{name}(**{ast.unparse(keyword.value)}): '**' arguments cannot be "
                    "read; write each argument as a literal keyword",
                )
                ok = False
            elif keyword.arg not in params:
                self.problem(line, f"{name}: unknown argument '{keyword.arg}'; accepted: {', '.join(params)}")
                ok = False
            elif keyword.arg in args:
                self.problem(line, f"{name}: '{keyword.arg}' is given twice (by position and by keyword)")
                ok = False
            else:
                ok &= self._literal(line, name, keyword.arg, keyword.value, args)
        return args if ok else None

    def _literal(self, line: int, name: str, param: str, node: ast.expr, out: dict) -> bool:
        try:
            out[param] = ast.literal_eval(node)
            return True
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            self.problem(
                line,
                f"{name}: {param}={ast.unparse(node)} is not a literal; discovery never runs the "
                "file, so write the value itself",
            )
            return False

    def _read_registration(self, line: int, backend: str, name: str, args: dict) -> None:
        bad = False

        def fail(message: str) -> None:
            nonlocal bad
            bad = True
            self.problem(line, f"{name}: {message}")

        for required in _REG_POSITIONAL:
            if required not in args:
                fail(f"missing '{required}'")
        est_time = args.get("est_time")
        if "est_time" in args and not _positive_number(est_time):
            fail(f"est_time={est_time!r} must be a positive number of seconds")
        suite = args.get("suite")
        if "suite" in args:
            if not isinstance(suite, str):
                fail(f"suite={suite!r} must be a string")
            else:
                try:
                    self.catalog.suite(suite, backend)
                except UnknownName as exc:
                    fail(f"{exc}; fix the name or add the suite to miles/ci/catalog.toml")
        labels = args.get("labels", ())
        if not isinstance(labels, list | tuple) or not all(isinstance(x, str) for x in labels):
            fail(f"labels={labels!r} must be a list of strings")
            labels = ()
        for label in labels:
            try:
                self.catalog.check_label(label)
            except UnknownName as exc:
                fail(f"{exc}; use a known label or add it to [labels] in miles/ci/catalog.toml")
        if backend != "cpu" and not labels:
            fail(
                f"a {backend} registration needs at least one label (run-ci-<label> selects it); "
                f"known: {', '.join(self.catalog.labels)}"
            )
        nightly = args.get("nightly", False)
        if not isinstance(nightly, bool):
            fail(f"nightly={nightly!r} must be True or False")
        disabled = args.get("disabled")
        if disabled is not None:
            if not isinstance(disabled, str):
                fail(f"disabled={disabled!r} must be a string that says why, or None")
            else:
                complaint = disabled_reason_problem(disabled)
                if complaint:
                    fail(complaint)
        if isinstance(suite, str) and any(
            r.backend == backend and r.suite == suite for r in self.registrations
        ):
            first = next(r for r in self.registrations if r.backend == backend and r.suite == suite)
            fail(f"({backend}, {suite}) is already registered at line {first.line}; keep one registration")
        if bad:
            return
        self.registrations.append(
            Registration(
                backend=backend,
                file=self.rel,
                line=line,
                est_time=float(est_time),
                suite=suite,
                labels=tuple(labels),
                nightly=nightly,
                disabled=disabled,
            )
        )

    def _read_gate(self, line: int, args: dict) -> None:
        bad = False

        def fail(message: str) -> None:
            nonlocal bad
            bad = True
            self.problem(line, f"{GATE_MARKER}: {message}")

        metric = args.get("metric_key")
        if not isinstance(metric, str) or not metric.strip():
            fail(f"metric_key={metric!r} must be a non-empty string such as 'train/grad_norm'")
        steps = args.get("steps", "last")
        if isinstance(steps, list | tuple):
            if not steps or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in steps):
                fail(f"steps={steps!r} must be 'last', 'all' or a non-empty list of step numbers >= 0")
            steps = tuple(steps)
        elif steps not in ("last", "all"):
            fail(f"steps={steps!r} must be 'last', 'all' or a list of step numbers")
        constraint = args.get("constraint") or {}
        if not isinstance(constraint, dict):
            fail(f"constraint={constraint!r} must be a dict with keys {', '.join(GATE_CONSTRAINT_KEYS)}")
            constraint = {}
        for key, value in constraint.items():
            if key not in GATE_CONSTRAINT_KEYS:
                fail(f"constraint key {key!r} is unknown; accepted: {', '.join(GATE_CONSTRAINT_KEYS)}")
            elif not (_positive_number(value) or value == 0):
                fail(f"constraint {key}={value!r} must be a number >= 0")
        enforce = args.get("enforce", False)
        if not isinstance(enforce, bool):
            fail(f"enforce={enforce!r} must be True or False")
        if isinstance(metric, str) and any(g.metric_key == metric for g in self.gates):
            fail(f"metric '{metric}' already has a gate in this file; merge the two declarations")
        if bad:
            return
        self.gates.append(
            GateDeclaration(
                file=self.rel,
                line=line,
                metric_key=metric,
                steps=steps,
                constraint=tuple(sorted((k, float(v)) for k, v in constraint.items())),
                enforce=enforce,
            )
        )


def _positive_number(value: object) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


def disabled_reason_problem(reason: str) -> str | None:
    """Why `reason` is not an acceptable `disabled=` value, or None when it is.

    A reason must carry a diagnosis (what fails and why) or cite a tracking reference
    (#123, owner/repo#123 or a URL). "Disable due to failure", "FIXME", "flaky" do neither.
    """
    if _TRACKING_REF.search(reason):
        return None
    words = _WORD.findall(reason.lower())
    informative = [w for w in words if w.strip(".-") not in _FILLER_WORDS]
    if len(informative) >= 3:
        return None
    shown = reason if reason.strip() else "(empty)"
    return (
        f"disabled={shown!r} gives no diagnosis; say what fails and why "
        "(e.g. 'aiter fused-MoE kernel aborts with HIP error 700 on gfx950') "
        "or cite a tracking reference (#123 or a URL)"
    )
