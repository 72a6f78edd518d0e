"""No test under tests/ can go hollow: every test function asserts something, and checks what it computes.

A test function (a `test_*` function of a `test_*.py` file, or a method of a `Test*` class there)
must contain an `assert` whose condition is not a constant, a `pytest.raises`/`pytest.warns`/
`pytest.fail`, a call whose name starts with `assert` (`torch.testing.assert_close`, pytester's
`assert_outcomes`), or a call of a helper that does one of these: a function of the same file, of
tests.support or of a helper module beside the test (resolved through the file's imports,
transitively), or a fixture of a conftest.py above it that the test calls. And a result a test
computes (a name bound to a call's value) must not end only in print(): that is how an assertion
turned into a report without anyone noticing. Read from the syntax trees; nothing is imported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
PYTEST_ASSERTING = {"raises", "warns", "fail", "deprecated_call"}
Call = tuple[str | None, str]  # (receiver name or None, called name)


@dataclass
class Function:
    name: str
    line: int
    params: tuple[str, ...] = ()
    asserts: bool = False
    calls: set[Call] = field(default_factory=set)
    only_printed: tuple[str, ...] = ()  # names bound to a call's value that nothing but print() reads


def _nodes(node: ast.AST, deep: bool):
    """A function's nodes; without `deep`, not those of functions or classes nested in it."""
    for child in ast.iter_child_nodes(node):
        if not deep and isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            continue
        yield child
        yield from _nodes(child, deep)


def _asserting_call(func: ast.expr) -> bool:
    if isinstance(func, ast.Attribute):
        pytest_call = (
            isinstance(func.value, ast.Name) and func.value.id == "pytest" and func.attr in PYTEST_ASSERTING
        )
        return pytest_call or func.attr.startswith("assert")
    return isinstance(func, ast.Name) and func.id.startswith("assert")


def _scan_function(node: ast.FunctionDef | ast.AsyncFunctionDef, deep: bool = False) -> Function:
    params = tuple(a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs))
    fn = Function(node.name, node.lineno, params)
    for sub in _nodes(node, deep):
        if isinstance(sub, ast.Assert) and not isinstance(sub.test, ast.Constant):
            fn.asserts = True
        elif isinstance(sub, ast.Call):
            fn.asserts = fn.asserts or _asserting_call(sub.func)
            if isinstance(sub.func, ast.Attribute):
                receiver = sub.func.value.id if isinstance(sub.func.value, ast.Name) else None
                fn.calls.add((receiver, sub.func.attr))
            elif isinstance(sub.func, ast.Name):
                fn.calls.add((None, sub.func.id))
    fn.only_printed = _only_printed(node)
    return fn


def _only_printed(node: ast.AST) -> tuple[str, ...]:
    """Names bound to a call's value whose every read is inside a print(...) call."""
    computed = set()
    for sub in _nodes(node, deep=False):
        if isinstance(sub, ast.Assign) and isinstance(sub.value, ast.Call):
            for target in sub.targets:
                computed |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    printed_reads: set[int] = set()
    for sub in _nodes(node, deep=False):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id == "print":
            printed_reads |= {id(n) for n in ast.walk(sub) if isinstance(n, ast.Name)}
    reads: dict[str, list[int]] = {}
    for sub in _nodes(node, deep=True):
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load) and sub.id in computed:
            reads.setdefault(sub.id, []).append(id(sub))
    return tuple(sorted(n for n, ids in reads.items() if all(i in printed_reads for i in ids)))


@dataclass
class Module:
    name: str
    path: Path
    functions: dict[str, Function]
    tests: list[Function]
    aliases: dict[str, str]  # local name -> the tests module it names ("runs" -> "tests.support.recipes")
    imported: dict[str, tuple[str, str]]  # local name -> (module, function)


def _module_name(path: Path, root: Path) -> str:
    return path.relative_to(root).with_suffix("").as_posix().replace("/", ".")


def _local_module(dotted: str, package: str, known: set[str]) -> str | None:
    """The module under tests/ an import names: `tests.support.x`, or a helper beside the file
    imported by its bare name (its directory put on sys.path)."""
    if dotted in known:
        return dotted
    beside = f"{package}.{dotted}"
    return beside if beside in known else None


def _loaded_from_files(tree: ast.Module, path: Path, root: Path, known: set[str]) -> dict[str, str]:
    """{name: module} of helpers a file loads by path (`spec = importlib.util.spec_from_file_location(
    "x", Path(__file__).with_name("x.py"))`, then `name = ...module_from_spec(spec)`), as the GPU
    twins load the helper beside them."""
    files: dict[str, str] = {}
    for node in (n for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)):
        if _called_name(node.value.func) != "spec_from_file_location" or len(node.value.args) < 2:
            continue
        where = node.value.args[1]
        if isinstance(where, ast.Name):  # `_path = Path(__file__)...; spec_from_file_location("x", _path)`
            where = next((a.value for a in tree.body if isinstance(a, ast.Assign)
                          and any(isinstance(t, ast.Name) and t.id == where.id for t in a.targets)), where)  # fmt: skip
        strings = [c for c in ast.walk(where) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
        parts = [c.value for c in sorted(strings, key=lambda c: (c.lineno, c.col_offset))]  # as written
        if not parts or not parts[-1].endswith(".py"):
            continue
        up = next((c.slice.value for c in ast.walk(where) if isinstance(c, ast.Subscript)
                   and isinstance(c.slice, ast.Constant) and "parents" in ast.unparse(c.value)), 0)  # fmt: skip
        target = path.parents[up].joinpath(*parts)
        module = _module_name(target, root) if target.is_relative_to(root) else ""
        if module in known:
            files |= {t.id: module for t in node.targets if isinstance(t, ast.Name)}
    aliases = {}
    for node in (n for n in tree.body if isinstance(n, ast.Assign)):
        for call in (c for c in ast.walk(node.value) if isinstance(c, ast.Call)):
            if (
                _called_name(call.func) == "module_from_spec"
                and call.args
                and isinstance(call.args[0], ast.Name)
            ):
                if call.args[0].id in files:
                    aliases |= {t.id: files[call.args[0].id] for t in node.targets if isinstance(t, ast.Name)}
    return aliases


def _called_name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _scan_module(path: Path, root: Path, known: set[str]) -> Module:
    name = _module_name(path, root)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name.rpartition(".")[0]
    aliases, imported = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if target := _local_module(alias.name, package, known):
                    aliases[alias.asname or alias.name] = target
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = _local_module(node.module, package, known)
            for alias in node.names:
                local = alias.asname or alias.name
                if as_module := _local_module(f"{node.module}.{alias.name}", package, known):
                    aliases[local] = as_module
                elif base:
                    imported[local] = (base, alias.name)
    aliases |= _loaded_from_files(tree, path, root, known)
    functions: dict[str, Function] = {}
    tests: list[Function] = []
    for node in tree.body:
        in_class = isinstance(node, ast.ClassDef)
        defs = node.body if in_class else [node]
        for d in (d for d in defs if isinstance(d, ast.FunctionDef | ast.AsyncFunctionDef)):
            fixture = any("fixture" in ast.unparse(dec) for dec in d.decorator_list)
            fn = _scan_function(d, deep=fixture)  # a fixture may hand out a closure that asserts
            functions.setdefault(d.name, fn)
            is_test_class = in_class and node.name.startswith("Test")
            if (
                d.name.startswith("test_")
                and path.name.startswith("test_")
                and (is_test_class or not in_class)
            ):
                tests.append(fn)
    return Module(name, path, functions, tests, aliases, imported)


def scan(folder: Path = TESTS, root: Path = ROOT) -> list[str]:
    """One line per hollow test under `folder`: file (relative to `root`), line, name, why."""
    paths = sorted(p for p in folder.rglob("*.py") if "__pycache__" not in p.parts)
    known = {_module_name(p, root) for p in paths}
    modules = {m.name: m for m in (_scan_module(p, root, known) for p in paths)}

    def conftests(module: Module) -> list[Module]:
        parts = module.name.split(".")[:-1]
        names = [".".join([*parts[:i], "conftest"]) for i in range(len(parts), 0, -1)]
        return [modules[n] for n in names if n in modules]

    def target(module: Module, caller: Function, call: Call) -> Function | None:
        receiver, called = call
        if receiver is not None:
            owner = module.aliases.get(receiver)
            return modules[owner].functions.get(called) if owner in modules else None
        if called in module.functions:
            return module.functions[called]
        if called in module.imported:
            owner, name = module.imported[called]
            return modules[owner].functions.get(name) if owner in modules else None
        if called in caller.params:  # a fixture the test calls
            return next((c.functions[called] for c in conftests(module) if called in c.functions), None)
        return None

    changed = True
    while changed:  # a helper that calls an asserting helper asserts
        changed = False
        for module in modules.values():
            for fn in [*module.functions.values(), *module.tests]:
                if not fn.asserts and any((t := target(module, fn, c)) and t.asserts for c in fn.calls):
                    fn.asserts = changed = True
    hollow = []
    for m in modules.values():
        for t in m.tests:
            where = f"{m.path.relative_to(root)}:{t.line}: {t.name}"
            if not t.asserts:
                hollow.append(f"{where} asserts nothing (add an assert on what its name claims)")
            if t.only_printed:
                hollow.append(
                    f"{where} computes {', '.join(t.only_printed)} and only prints it (assert on it)"
                )
    return hollow


def test_every_test_under_tests_asserts_what_it_claims():
    hollow = scan()
    assert not hollow, "\n".join(hollow)


def test_the_scanner_finds_a_test_that_only_prints(tmp_path):
    (tmp_path / "helpers.py").write_text("def check(x):\n    assert x\n\ndef show(x):\n    print(x)\n")
    (tmp_path / "conftest.py").write_text(
        "import pytest\nimport helpers\n\n@pytest.fixture\ndef checked():\n    return lambda x: helpers.check(x)\n"
    )
    (tmp_path / "test_sample.py").write_text(
        "import pytest\nimport helpers\n\n"
        "def test_prints():\n    print(1)\n\n"
        "def test_constant():\n    assert True\n\n"
        "def test_checks():\n    helpers.check(1)\n\n"
        "def test_via_local():\n    _local()\n\n"
        "def _local():\n    helpers.check(2)\n\n"
        "def test_raises():\n    with pytest.raises(ValueError):\n        int('x')\n\n"
        "def test_only_shows():\n    helpers.show(1)\n\n"
        "def test_fixture(checked):\n    checked(1)\n\n"
        "def test_result_printed():\n    helpers.check(1)\n    norms = sorted([2, 1])\n    print(f'norms {norms}')\n\n"
        "class TestGroup:\n    def test_method(self):\n        assert 1 + 1 == 2\n"
    )
    found = {line.split(": ")[1].split(" ")[0] for line in scan(tmp_path, tmp_path.parent)}
    assert found == {"test_prints", "test_constant", "test_only_shows", "test_result_printed"}, found
