"""What the CI knows about the recipes: which cpu-lane tests train each recipe, and whether
every profile names a suite its runners can run.

`python -m miles.ci recipes [--write]` prints both. The first is handed to the recipes as data,
`miles/recipes/runs/cpu-lane.json` (read by miles.recipes.status, which never imports miles.ci):
`--write` rewrites it, and the command (and tests/unit/test_recipe_status.py) fails while the
committed file says otherwise than the tests do. Read from the test files' syntax trees and
their registrations, never from a list kept by hand.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable, Mapping
from pathlib import Path

from miles.ci.registry.catalog import Catalog, UnknownName, load_catalog
from miles.ci.registry.discover import Discovery, discover

CPU_LANE_NAME = "cpu"
CPU_PLAN_FUNCTION = "tiny_plan"  # tests/support/recipes.py: builds and prepares a recipe's CPU plan
SCHEMA = 1
WRITE_COMMAND = "python -m miles.ci recipes --write"

Trainings = Mapping[str, tuple[tuple[str, str], ...]]


def cpu_lane_trainings(
    root: Path, catalog: Catalog | None = None, discovery: Discovery | None = None
) -> Trainings:
    """recipe -> ((test file, suite), ...) for the enabled cpu-backend registrations on suites
    of the cpu lane whose file builds the recipe's CPU plan."""
    catalog = catalog or load_catalog()
    discovery = discovery or discover(root, catalog=catalog, cache=False)
    lane_suites = {s.name for s in catalog.suites_of_lane(CPU_LANE_NAME)}
    found: dict[str, list[tuple[str, str]]] = {}
    for reg in discovery.registrations:
        if reg.backend != "cpu" or reg.suite not in lane_suites or reg.disabled is not None:
            continue
        for recipe in sorted(recipes_trained(root / reg.file)):
            found.setdefault(recipe, []).append((reg.file, reg.suite))
    return {k: tuple(v) for k, v in sorted(found.items())}


def evidence_json(trainings: Trainings) -> dict:
    """The committed evidence file's content."""
    return {
        "schema": SCHEMA,
        "lane": CPU_LANE_NAME,
        "written_by": WRITE_COMMAND,
        "trainings": {recipe: [list(pair) for pair in pairs] for recipe, pairs in sorted(trainings.items())},
    }


def evidence_text(trainings: Trainings) -> str:
    return json.dumps(evidence_json(trainings), indent=1) + "\n"


def evidence_drift(path: Path, trainings: Trainings) -> str | None:
    """Why the committed evidence at `path` is not what the tests say, or None."""
    try:
        committed = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path}: cannot be read ({exc}); run `{WRITE_COMMAND}`"
    if committed != evidence_json(trainings):
        return (
            f"{path} says otherwise than the cpu-lane tests do about which recipes they train; "
            f"run `{WRITE_COMMAND}` and review the diff"
        )
    return None


def recipes_trained(path: Path) -> set[str]:
    """Recipe names reaching the first argument of a `tiny_plan(...)` call in the file: a string
    literal, a module constant, a parameter of the test's `pytest.mark.parametrize`, or
    `x["recipe"]` of the file's dict literals with a "recipe" key."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return set()
    constants = {
        t.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for t in node.targets
        if isinstance(t, ast.Name) and isinstance(node.value.value, str)
    }
    recipe_values = {
        v.value
        for d in ast.walk(tree)
        if isinstance(d, ast.Dict)
        for k, v in zip(d.keys, d.values, strict=True)
        if isinstance(k, ast.Constant) and k.value == "recipe" and isinstance(v, ast.Constant)
    }
    out: set[str] = set()
    settings, forwards = _support_helpers(tree, path)
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and _called(n) in forwards):
        at = forwards[_called(call)]
        if at < len(call.args) and isinstance(call.args[at], ast.Name) and call.args[at].id in settings:
            out.add(settings[call.args[at].id])
    for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
        params = _parametrized(fn)
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and _called(n) == CPU_PLAN_FUNCTION):
            if not call.args:
                continue
            first = call.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                out.add(first.value)
            elif isinstance(first, ast.Name) and first.id in params:
                out |= params[first.id]
            elif isinstance(first, ast.Name) and first.id in constants:
                out.add(constants[first.id])
            elif isinstance(first, ast.Subscript) and isinstance(first.slice, ast.Constant):
                if first.slice.value == "recipe":
                    out |= recipe_values
    return out


def _support_helpers(tree: ast.Module, path: Path) -> tuple[dict[str, str], dict[str, int]]:
    """What the file imports from tests/support modules: ({name: recipe} of their settings dicts
    (a dict literal with a "recipe" key, `{**OTHER, ...}` inheriting OTHER's), {function: the
    index of its argument whose ["recipe"] reaches a `tiny_plan(...)` call}), read from the
    support modules' own syntax trees."""
    settings: dict[str, str] = {}
    forwards: dict[str, int] = {}
    for node in tree.body:
        if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.support")):
            continue
        relative = Path(*node.module.split(".")).with_suffix(".py")
        source = next((p / relative for p in path.parents if (p / relative).is_file()), None)
        try:
            module = ast.parse(source.read_text(), filename=str(source)) if source else None
        except (OSError, SyntaxError, ValueError):
            module = None
        if module is None:
            continue
        theirs, their_forwards = _settings_of(module), _forwards_of(module)
        for alias in node.names:
            local = alias.asname or alias.name
            if alias.name in theirs:
                settings[local] = theirs[alias.name]
            if alias.name in their_forwards:
                forwards[local] = their_forwards[alias.name]
    return settings, forwards


def _settings_of(module: ast.Module) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in module.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)):
            continue
        recipe = None
        for key, value in zip(node.value.keys, node.value.values, strict=True):
            if key is None and isinstance(value, ast.Name):  # {**OTHER, ...}
                recipe = out.get(value.id, recipe)
            elif isinstance(key, ast.Constant) and key.value == "recipe" and isinstance(value, ast.Constant):
                recipe = value.value
        if isinstance(recipe, str):
            out |= {t.id: recipe for t in node.targets if isinstance(t, ast.Name)}
    return out


def _forwards_of(module: ast.Module) -> dict[str, int]:
    out: dict[str, int] = {}
    for fn in (n for n in module.body if isinstance(n, ast.FunctionDef)):
        names = [a.arg for a in fn.args.args]
        for call in (n for n in ast.walk(fn) if isinstance(n, ast.Call) and _called(n) == CPU_PLAN_FUNCTION):
            first = call.args[0] if call.args else None
            if (
                isinstance(first, ast.Subscript)
                and isinstance(first.value, ast.Name)
                and first.value.id in names
                and isinstance(first.slice, ast.Constant)
                and first.slice.value == "recipe"
            ):
                out[fn.name] = names.index(first.value.id)
    return out


def _called(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _parametrized(fn: ast.FunctionDef) -> dict[str, set[str]]:
    """{argument: its string values} of the function's `@pytest.mark.parametrize("arg", [...])`."""
    out: dict[str, set[str]] = {}
    for deco in fn.decorator_list:
        if not (isinstance(deco, ast.Call) and _called(deco) == "parametrize" and len(deco.args) >= 2):
            continue
        name, values = deco.args[0], deco.args[1]
        if isinstance(name, ast.Constant) and isinstance(values, ast.List | ast.Tuple):
            strings = {
                v.value for v in values.elts if isinstance(v, ast.Constant) and isinstance(v.value, str)
            }
            out[str(name.value)] = strings
    return out


def profile_suite_problems(forms: Iterable, catalog: Catalog | None = None) -> list[str]:
    """Every GPU profile of the recipe forms must name a catalog suite of its platform whose
    runners have its GPU count (a profile trained in no suite is trained nowhere)."""
    catalog = catalog or load_catalog()
    out = []
    for form in forms:
        for profile in form.profiles:
            if profile.platform == "cpu":
                continue
            where = f"{form.defined_in}: {form.name} ({form.variant}) {profile.describe()}"
            try:
                suite = catalog.suite(profile.suite, profile.platform)
            except UnknownName as exc:
                out.append(f"{where}: profile suite: {exc}")
                continue
            if suite.gpus != profile.world_size:
                out.append(
                    f"{where}: a profile of {profile.world_size} GPU(s) names suite {suite.name}, whose runners "
                    f"have {suite.gpus}"
                )
    return out


def every_form() -> list:
    """Every recipe in every form (shared and per-platform overlays)."""
    from miles.recipes import names, variants

    return [form for name in names() for form in variants(name)]
