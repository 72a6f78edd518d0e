"""Which package of miles may import which, read from the import statements themselves.

Dependencies point one way: the CI drives the metrics (miles.ci -> miles.metrics, never
back), the recipes build on the layout, checkpoints and models, the trainer records through
miles.metrics.capture. The tables below are every edge the code has today; an import that
adds an edge fails here, and so does an entry that no import uses any more, so the tables
stay the true map. Imports inside functions count: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=4, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]

# Modules every package may use; they import nothing of miles themselves.
SHARED = {
    "miles.exits",
    "miles.files",
    "miles.text",
    "miles.platform",
    "miles.children",
    "miles.cgroups",
    "miles.phases",
    "miles.load",
}

# Between the packages of miles (the parts of miles.ci count as miles.ci). A target is a
# package, or one module of it where a package reaches in for that module only.
PACKAGE_EDGES: dict[str, set[str]] = {
    # the package's own __init__, imported by every process before anything else of miles: it
    # decides how megatron-core's fusions are built before megatron-core can be imported
    "miles": {"miles.megatron.compat"},
    # the CI drives the rest: its device check (miles.ci.machine) trains the recipes' tiny
    # profiles with the trainer, and it reads which of its tests train each recipe
    "miles.ci": {
        "miles.ckpt",
        "miles.image",
        "miles.megatron",
        "miles.metrics",
        "miles.families",
        "miles.recipes",
        "miles.train",
    },
    "miles.metrics": set(),
    # images.toml names its stacks after the CI's lanes, which the CI passes in
    "miles.image": set(),
    "miles.parallel": set(),
    # the adapter to megatron-core: what every family builds with (layer specs, CPU compatibility,
    # shared blocks), knowing no family
    "miles.megatron": {"miles.parallel"},
    # a family's own megatron-core modules are built from the adapter's blocks; its facts state
    # the layout limits miles.parallel checks
    "miles.families": {"miles.megatron", "miles.parallel"},
    # a recipe's model is prepared by miles.recipes' own command, which runs ckpt's plan runner
    "miles.ckpt": {"miles.megatron", "miles.families"},
    # recipes read the trainer's flag definitions (the trainer never reads a recipe); the CI's
    # evidence about the recipes (which cpu-lane tests train them) reaches them as data
    "miles.recipes": {
        "miles.ckpt",
        "miles.image",
        "miles.megatron",
        "miles.families",
        "miles.parallel",
        "miles.train",
    },
    # functions the seed's commands name by module path (on-policy distillation's reward)
    "miles.rollout": {"miles.train"},
    "miles.train": {
        "miles.ckpt",
        "miles.megatron",
        "miles.metrics.capture",
        "miles.families",
        "miles.parallel",
    },
}

# Between the parts of miles.ci: registry <- reports <- selection <- running; machine beside
# them; the commands on top, and the command line, the pytest plugin and the markers as entry
# points (register.py imports nothing, so a test file's marker import stays free).
CI_EDGES: dict[str, set[str]] = {
    "miles.ci.register": set(),
    "miles.ci.registry": {"miles.ci.register"},
    "miles.ci.reports": {"miles.ci.register", "miles.ci.registry"},
    "miles.ci.selection": {"miles.ci.registry", "miles.ci.reports"},
    "miles.ci.running": {"miles.ci.registry", "miles.ci.reports", "miles.ci.selection"},
    "miles.ci.machine": {"miles.ci.registry"},
    "miles.ci.commands": {
        "miles.ci.machine",
        "miles.ci.registry",
        "miles.ci.reports",
        "miles.ci.running",
        "miles.ci.selection",
    },
    "miles.ci.cli": {"miles.ci.commands", "miles.ci.registry"},
    "miles.ci.__main__": {"miles.ci.cli"},
    "miles.ci.pytest_plugin": {"miles.ci.registry"},
}

# Outside the package: the lanes, the tasks, the recipes' scripts and the tests call miles.
NEVER_IMPORTED_BY_MILES = ("noxfile", "tasks", "scripts", "tests", "benchmarks")


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "miles").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(module: str, path: Path) -> list[tuple[int, str]]:
    return _read_imports(module, path.read_text(), is_package=path.name == "__init__.py")


def _read_imports(module: str, source: str, *, is_package: bool) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `source`, at any depth; `from a import b`
    is a.b when a.b is a module of miles, else a."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upward
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
            found += [(node.lineno, target) for target in sorted(targets)]
    return found


def _part(module: str, *, inside_ci: bool) -> str:
    """The package a module belongs to (miles.x), or inside miles.ci its part (miles.ci.x)."""
    depth = 3 if inside_ci and module.startswith("miles.ci.") else 2
    return ".".join(module.split(".")[:depth])


def _is_entry_point(module: str) -> bool:
    """`python -m miles.<package>`: a package's command line, which may join it with the packages
    above it (`miles.parallel check --megatron` runs megatron-core's proof); nothing imports it."""
    return module.endswith(".__main__")


def _within(target: str, spec: str) -> bool:
    return target == spec or target.startswith(spec + ".")


def _check(edges: dict[str, set[str]], *, inside_ci: bool) -> tuple[list[str], set[tuple[str, str]]]:
    """(imports that no entry allows, the (part, spec) entries some import uses)."""
    refused, used = [], set()
    for module, path in MODULES.items():
        if inside_ci and not module.startswith("miles.ci."):
            continue
        if not inside_ci and _is_entry_point(module):
            continue  # a command line sits on top of the packages it joins
        source = _part(module, inside_ci=inside_ci)
        for line, target in _imports(module, path):
            if not target.startswith("miles.") or target in SHARED:
                continue
            if inside_ci and not target.startswith("miles.ci."):
                continue  # the CI's imports of other packages are PACKAGE_EDGES' business
            if _part(target, inside_ci=inside_ci) == source:
                continue
            specs = edges.get(source)
            where = f"{path.relative_to(ROOT)}:{line} imports {target}"
            if specs is None:
                refused.append(f"{where}: {source} is in no table; add it with the edges it needs")
                continue
            matched = {spec for spec in specs if _within(target, spec)}
            used |= {(source, spec) for spec in matched}
            if not matched:
                refused.append(
                    f"{where}: {source} -> {_part(target, inside_ci=inside_ci)} is not an allowed edge; "
                    "move the code so the dependency points the documented way, or, if this direction "
                    "is the design, add the edge to the table in tests/unit/test_package_dependencies.py"
                )
    return refused, used


def test_no_package_imports_against_the_documented_direction():
    refused, _ = _check(PACKAGE_EDGES, inside_ci=False)
    assert not refused, "\n".join(refused)


def test_the_parts_of_miles_ci_import_one_way():
    refused, _ = _check(CI_EDGES, inside_ci=True)
    assert not refused, "\n".join(refused)


def _package_graph() -> dict[str, set[str]]:
    """PACKAGE_EDGES as package -> packages (an entry naming one module counts as its package)."""
    return {src: {_part(spec, inside_ci=False) for spec in specs} for src, specs in PACKAGE_EDGES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle of a directed graph, each once, as [a, b, ..., a] from its smallest node."""
    found = set()
    for start in graph:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph.get(node, ()):
                if nxt == start:
                    cycle = path + [start]
                    i = cycle.index(min(cycle[:-1]))
                    found.add(tuple(cycle[i:-1] + cycle[:i] + [cycle[i]]))
                elif nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return sorted(list(c) for c in found)


def test_the_packages_of_miles_form_no_cycle():
    assert _cycles(_package_graph()) == []


def test_a_cycle_between_packages_would_be_found():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_no_module_imports_a_command_line():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for module, path in MODULES.items()
        for line, target in _imports(module, path)
        if _is_entry_point(target)
    ]
    assert not found, found


def test_every_allowed_edge_is_one_the_code_has():
    stale = []
    for edges, inside_ci in ((PACKAGE_EDGES, False), (CI_EDGES, True)):
        _, used = _check(edges, inside_ci=inside_ci)
        stale += [
            f"{src} -> {spec}" for src, specs in edges.items() for spec in specs if (src, spec) not in used
        ]
    assert not stale, "no import uses these entries any more; remove them from the table: " + ", ".join(stale)


def test_miles_metrics_imports_nothing_of_miles_ci():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for module, path in MODULES.items()
        if module.startswith("miles.metrics")
        for line, target in _imports(module, path)
        if target == "miles.ci" or target.startswith("miles.ci.")
    ]
    assert not found, found


def test_the_shared_modules_import_nothing_of_miles():
    found = [
        f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}"
        for module in sorted(SHARED)
        for line, target in _imports(module, MODULES[module])
        if target.startswith("miles.")
    ]
    assert not found, found


def test_nothing_in_miles_imports_the_lanes_tasks_scripts_or_tests():
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for module, path in MODULES.items()
        for line, target in _imports(module, path)
        if target.split(".")[0] in NEVER_IMPORTED_BY_MILES
    ]
    assert not found, found


def test_the_reader_sees_lazy_relative_and_from_imports():
    """The checks above are only as good as the reading of import statements."""
    source = (
        "import miles.text\n"
        "from miles.ci import cli\n"
        "from miles.ci.registry.catalog import load_catalog\n"
        "def f():\n"
        "    from miles.metrics import capture\n"
        "    from . import summary\n"
        "    from ..registry import discover\n"
    )
    imports = defaultdict(list)
    for line, target in _read_imports("miles.ci.reports.example", source, is_package=False):
        imports[line].append(target)
    assert dict(imports) == {
        1: ["miles.text"],
        2: ["miles.ci.cli"],
        3: ["miles.ci.registry.catalog"],
        5: ["miles.metrics.capture"],
        6: ["miles.ci.reports.summary"],
        7: ["miles.ci.registry.discover"],
    }
