"""The rules a registration must follow, applied to the syntax tree of one test file.

Each broken rule becomes a Problem naming file:line, the offending value, the rule and the
fix. Discovery (miles.ci.registry.discover) decides which part of a file to parse; this module reads it.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterator

from miles.ci.register import BACKEND_OF_MARKER, GATE_MARKER, MARKERS
from miles.ci.registry.catalog import MAX_EST_TIME, Catalog, UnknownName
from miles.ci.registry.reasons import disabled_reason_problem
from miles.ci.registry.registration import GateDeclaration, Problem, Registration, TestFile
from miles.metrics.spec import CONSTRAINT_KEYS as GATE_CONSTRAINT_KEYS
from miles.metrics.spec import metric_key_problem

__all__ = ["FileReader", "disabled_reason_problem", "read_test_file"]

_REG_PARAMS = ("est_time", "suite", "labels", "nightly", "disabled")
_REG_POSITIONAL = ("est_time", "suite")
_GATE_PARAMS = ("metric_key", "steps", "constraint", "enforce")


class FileReader:
    """Reads the marker calls of one parsed file and collects the problems it finds.

    Only what runs when the module is imported can register: top-level statements, and (as
    mistakes to report) module-level blocks and class bodies. A marker named inside a function
    or lambda body is a test of the markers themselves, not a registration, and a marker named
    in a string is text; neither is read, reported or charged to any lane.
    """

    def __init__(self, rel: str, catalog: Catalog, problems: list[Problem]):
        self.rel = rel
        self.catalog = catalog
        self.problems = problems
        self.registrations: list[Registration] = []
        self.gates: list[GateDeclaration] = []
        self.backends: set[str] = set()  # backends of the register_*_ci markers the module names
        self.suites: set[str] = set()  # literal suites of the registration calls there
        self.in_functions: list[tuple[int, str]] = []  # (line, marker) inside function bodies
        self._call: tuple[str, str | None] | None = None  # (backend, suite) of the call being read

    def problem(self, line: int, message: str) -> None:
        if self._call is not None:  # a refused registration: it concerns its backend and suite
            backend, suite = self._call
            self.problems.append(Problem(self.rel, line, message, (backend,), suite, refused=True))
        else:
            self.problems.append(Problem(self.rel, line, message))

    def read(self, tree: ast.Module, mentions: int) -> None:
        """Read top-level marker calls; flag every other place the module names a marker.

        `mentions` counts marker names in the text. When every mention is an accepted
        import or top-level call, no other node can name a marker and the full tree walk
        (the costliest part of reading a file) is skipped.
        """
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
                self._named(stmt.value.func.id)
                self._read_call(stmt.value)
        if accepted and len(accepted) == mentions:
            return
        for node, in_function in _walk_module(tree):
            if in_function:
                name = _marker_named(node)
                if name is not None:
                    self.in_functions.append((getattr(node, "lineno", 1), name))
            else:
                self._check_placement(node, accepted)

    def _named(self, marker: str) -> None:
        if marker in BACKEND_OF_MARKER:
            self.backends.add(BACKEND_OF_MARKER[marker])

    def _check_placement(self, node: ast.AST, accepted: set[int]) -> None:
        line = getattr(node, "lineno", 1)
        if isinstance(node, ast.alias):
            if (node.name in MARKERS or node.asname in MARKERS) and id(node) not in accepted:
                self._named(node.name if node.name in MARKERS else node.asname)
                if node.asname not in (None, node.name):
                    self.problem(
                        line,
                        f"'{node.name}' is imported as '{node.asname}': discovery reads calls by "
                        f"the marker's own name; write 'from miles.ci.register import {node.name}'",
                    )
                else:
                    self.problem(
                        line,
                        f"'{node.name}' is imported inside a block: registrations are read from "
                        "top-level statements only; import it at the top of the module "
                        f"and call {node.name}(...) there",
                    )
        elif isinstance(node, ast.Name) and node.id in MARKERS:
            if id(node) not in accepted:
                self._named(node.id)
                self.problem(
                    line,
                    f"{node.id} is used inside a block or an expression: a registration must be "
                    f"its own top-level statement, {node.id}(...), with literal arguments",
                )
        elif isinstance(node, ast.Attribute) and node.attr in MARKERS:
            self._named(node.attr)
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
            suite = next((k.value for k in call.keywords if k.arg == "suite"), None)
            if suite is None and len(call.args) > 1:
                suite = call.args[1]
            literal = (
                suite.value if isinstance(suite, ast.Constant) and isinstance(suite.value, str) else None
            )
            self._call = (BACKEND_OF_MARKER[name], literal)
            if literal is not None:
                self.suites.add(literal)
            try:
                args = self._arguments(call, name, _REG_PARAMS, positional=_REG_POSITIONAL)
                if args is not None:
                    self._read_registration(call.lineno, BACKEND_OF_MARKER[name], name, args)
            finally:
                self._call = None

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
            fail(f"est_time={_short(est_time)} must be a positive number of seconds")
        elif "est_time" in args and est_time > MAX_EST_TIME:
            fail(
                f"est_time={_short(est_time)} must be at most {MAX_EST_TIME:g} s (a day): it sets the "
                "file's timeout and the shard budget; measure it with `python -m miles.ci calibrate`"
            )
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
        if labels is None:  # the seed framework's markers document labels=None as "no labels"
            labels = ()
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
        complaint = metric_key_problem(metric)
        if complaint:
            fail(complaint)
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


def read_test_file(
    tree: ast.Module | None, mentions: int, rel: str, catalog: Catalog
) -> tuple[TestFile, list[Problem]]:
    """Registrations, gate declarations and problems of one parsed file (`tree` is None when
    the text never names a marker).

    A file that registers nothing runs in the suite of the catalog's implicit directory that
    holds it, or is a problem. Each problem is charged to the backends and suites the file
    registers for (a refused call: its own backend and suite), so it stops only those lanes.
    """
    problems: list[Problem] = []
    reader = FileReader(rel, catalog, problems)
    if tree is not None:
        reader.read(tree, mentions)
    registrations = list(reader.registrations)
    if not registrations and not reader.backends:
        implicit = catalog.implicit_for(rel)
        if implicit is not None:
            backend = catalog.suites[implicit.suite].backend
            registrations = [Registration(backend, rel, 0, implicit.est_time, implicit.suite, implicit=True)]
        else:
            problems.append(Problem(rel, 1, _no_registration_message(catalog, reader.in_functions)))
    backends = tuple(sorted(reader.backends | {r.backend for r in registrations}))
    suites = tuple(sorted(reader.suites | {r.suite for r in registrations}))
    problems = [p.with_scope(backends, suites) for p in problems]
    return TestFile(rel, tuple(registrations), tuple(reader.gates)), problems


def _no_registration_message(catalog: Catalog, in_functions: list[tuple[int, str]]) -> str:
    where = ", ".join(f"{d}/" for d in sorted(catalog.implicit)) or "(none declared)"
    message = (
        "no register_*_ci(...) call: every test file outside the catalog's implicit directories "
        f"({where}) must say where it runs, e.g. "
        'register_cpu_ci(est_time=60, suite="stage-b-cpu")'
    )
    calls = [(line, name) for line, name in in_functions if name in BACKEND_OF_MARKER]
    if calls:
        line, name = calls[0]
        message += (
            f"; note: {name} at line {line} is inside a function body, which is not a "
            "registration: call it at the top level of the module"
        )
    return message


def _walk_module(tree: ast.Module) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it sits in a function or lambda body (code that runs only when
    called). Decorators, default values and annotations run at definition, so they count as
    the module's own."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, in_function = stack.pop()
        yield node, in_function
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) and not in_function:
            body = node.body if isinstance(node.body, list) else [node.body]
            outer = [child for child in ast.iter_child_nodes(node) if child not in body]
            stack.extend((child, True) for child in reversed(body))
            stack.extend((child, False) for child in reversed(outer))
        else:
            stack.extend((child, in_function) for child in reversed(list(ast.iter_child_nodes(node))))


def _marker_named(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name) and node.id in MARKERS:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in MARKERS:
        return node.attr
    return None


def _positive_number(value: object) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an integer literal too long for a float: positive or not, it is finite
        return value > 0


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"
