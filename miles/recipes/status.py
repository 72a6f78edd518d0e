"""What is known about a profile: verified by a run, trained on the CPU lane, cannot be built, or untested.

- **verified**: a run record in miles/recipes/runs/, written by `python -m miles.recipes record`
  from the CI runner's run.json, names the recipe form, the profile, the suite and the test file
  that passed, the commit, and a fingerprint of the command and environment the profile
  generates. A record whose fingerprint no longer matches (the recipe changed since) does not
  count.
- **trained on the CPU lane**: a test file registered on a suite of the cpu lane (and not
  disabled) builds this recipe's CPU plan (`tiny_plan("<recipe>", ...)`) and trains it; read
  from the test files' syntax trees (`cpu_lane_trainings`), never from a list kept here.
- **cannot build**: a GPU profile whose train backend is Megatron and whose model's config
  types that backend's own mapping does not build (`megatron_model_types`).
- **FSDP fallback, untested on GPU**: a GPU profile of a recipe that declares a `Fallback`
  (its family is not built by the Megatron backend yet) and no run record verifies.
- **untested on GPU**: any other GPU profile (no GPU lane run of it has been recorded).
- **untested**: a CPU profile no CPU-lane test trains.
"""

from __future__ import annotations

import ast
import hashlib
import json
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from miles.recipes.recipe import ParallelProfile, Recipe, RecipeError

ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = Path(__file__).with_name("runs")
SCHEMA = 1
VERIFIED, CPU_LANE, CANNOT_BUILD = "verified", "trained on the CPU lane", "cannot build"
FALLBACK = "FSDP fallback, untested on GPU"
UNTESTED_GPU, UNTESTED = "untested on GPU", "untested"
CPU_LANE_NAME = "cpu"
CPU_PLAN_FUNCTION = "tiny_plan"  # tests/e2e/recipe_runs.py: builds and prepares a recipe's CPU plan


@dataclass(frozen=True)
class Status:
    kind: str  # verified | trained on the CPU lane | cannot build | FSDP fallback... | untested on GPU | untested
    detail: str

    def text(self) -> str:
        return f"{self.kind}: {self.detail}"


def megatron_model_types() -> tuple[str, ...]:
    """The config.json model types miles' Megatron backend builds, from the families."""
    from miles.families import families

    return tuple(sorted(t for f in families().values() if f.megatron for t in f.model_types))


# --- the CPU lane -------------------------------------------------------------------------


@cache
def cpu_lane_trainings(root: Path = ROOT) -> dict[str, tuple[tuple[str, str], ...]]:
    """recipe -> ((test file, suite), ...) for the enabled cpu-backend registrations on suites
    of the cpu lane whose file builds the recipe's CPU plan; empty without a tests/ tree."""
    if not (root / "tests").is_dir():
        return {}
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover

    lane_suites = {s.name for s in load_catalog().suites_of_lane(CPU_LANE_NAME)}
    found: dict[str, list[tuple[str, str]]] = {}
    for reg in discover(root, cache=False).registrations:
        if reg.backend != "cpu" or reg.suite not in lane_suites or reg.disabled is not None:
            continue
        for recipe in sorted(_recipes_trained(root / reg.file)):
            found.setdefault(recipe, []).append((reg.file, reg.suite))
    return {k: tuple(v) for k, v in found.items()}


def _recipes_trained(path: Path) -> set[str]:
    """Recipe names reaching the first argument of a `tiny_plan(...)` call in the file: a string
    literal, a module constant, a parameter of the test's `pytest.mark.parametrize`, or
    `x["recipe"]` of the file's dict literals with a "recipe" key."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError):
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


# --- status -------------------------------------------------------------------------------


def test_files(recipe: Recipe, profile: ParallelProfile, root: Path = ROOT) -> tuple[str, ...]:
    """The tests that train this profile: on GPUs the recipe's e2e test; on CPU the cpu-lane
    tests that build its CPU plan."""
    if profile.platform == "cpu":
        return tuple(dict.fromkeys(f for f, _ in cpu_lane_trainings(root).get(recipe.name, ())))
    return (f"tests/e2e/recipes/test_{recipe.name}_recipe.py",)


def record_path(recipe: Recipe, profile: ParallelProfile, directory: Path = RUNS_DIR) -> Path:
    shape = f"{profile.nodes}x{profile.gpus_per_node}"
    return directory / f"{recipe.name}-{recipe.variant}-{profile.platform}-{shape}-{profile.model}.json"


def fingerprint(recipe: Recipe, profile: ParallelProfile) -> str:
    """sha256 of what the profile runs: its trainer flags (paths as {fields}) and environment."""
    fields = {name: f"{{{name}}}" for name in _FIELDS}
    fields |= {
        "nodes": profile.nodes,
        "gpus_per_node": profile.gpus_per_node,
        "world_size": profile.world_size,
    }
    fields["rollout_gpus_per_engine"] = profile.rollout_gpus_per_engine
    payload = {
        "argv": list(recipe.train_args(profile, fields, env={})),
        "env": sorted(recipe.environment().items()),
        "pins": sorted(recipe.pins),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


_FIELDS = ("hf_checkpoint", "hf_dir", "ref_load", "torch_dist_dir", "save_dir", "run_dir", "model_dir", "data_dir",
           "run_id", "model_name")  # fmt: skip


def profile_status(
    recipe: Recipe, profile: ParallelProfile, directory: Path = RUNS_DIR, root: Path = ROOT
) -> Status:
    """The profile's status; `root` is the project whose tests/ say what the CPU lane trains."""
    path = record_path(recipe, profile, directory)
    stale = ""
    if path.is_file():
        record = json.loads(path.read_text())
        problem = _mismatch(record, recipe, profile, root)
        if problem is None:
            when = time.strftime("%Y-%m-%d", time.gmtime(record.get("started_at", 0)))
            fallback = (
                f"; it trained with the recipe's fallback, --train-backend {recipe.backend_of(profile)}, not Megatron"
                if recipe.fallback is not None and profile.platform != "cpu" and not profile.train_backend
                else ""
            )
            return Status(
                VERIFIED,
                f"{record['test']} passed in {record['suite']} at commit {record['commit'][:12]} on {when} "
                f"({_shown(path)}){fallback}",
            )
        stale = f"; {_shown(path)} does not count: {problem}"
    backend = recipe.backend_of(profile)
    if profile.platform == "cpu":
        trained = cpu_lane_trainings(root).get(recipe.name, ())
        if trained:
            where = ", ".join(f"{file} in {suite}" for file, suite in trained)
            return Status(
                CPU_LANE, f"{backend} on {profile.world_size} gloo ranks, on every PR: {where}{stale}"
            )
        return Status(UNTESTED, f"no test of the {CPU_LANE_NAME} lane builds its CPU plan{stale}")
    if backend == "megatron":
        types = _model_types(recipe)
        buildable = megatron_model_types()
        if not set(types) & set(buildable):
            return Status(
                CANNOT_BUILD,
                f"{recipe.model.name} is model type {'/'.join(types)}; miles' Megatron backend builds "
                f"{', '.join(buildable)} (miles/families/){stale}",
            )
    untested = (
        f"{test_files(recipe, profile)[0]} trains it in {profile.suite}, but no run record says it passed "
        f"(python -m miles.recipes record){stale}"
    )
    if recipe.fallback is not None and not profile.train_backend:
        return Status(
            FALLBACK,
            f"{backend} over the HF checkpoint on {profile.world_size} {profile.platform} GPUs instead of Megatron at "
            f"{profile.parallel.describe()} (the recipe's fallback: {recipe.fallback.reason}); {untested}",
        )
    return Status(UNTESTED_GPU, f"{backend} on {profile.platform}: {untested}")


def _model_types(recipe: Recipe) -> tuple[str, ...]:
    from miles.ckpt.families import family

    return family(recipe.model.family).model_types


def _mismatch(record: dict, recipe: Recipe, profile: ParallelProfile, root: Path) -> str | None:
    expected = {
        "recipe": recipe.name,
        "variant": recipe.variant,
        "platform": profile.platform,
        "profile": f"{profile.nodes}x{profile.gpus_per_node}",
        "model": profile.model,
        "suite": profile.suite,
        "status": "passed",
    }
    for key, value in expected.items():
        if record.get(key) != value:
            return f"its {key} is {record.get(key)!r}, not {value!r}"
    if record.get("test") not in test_files(recipe, profile, root):
        return f"its test {record.get('test')!r} does not train this profile"
    if record.get("fingerprint") != fingerprint(recipe, profile):
        return "it was recorded for another command or environment (the recipe changed since)"
    return None


def record_run(recipe: Recipe, profile: ParallelProfile, run_json: Path, directory: Path = RUNS_DIR) -> Path:
    """Write the run record of `profile` from a runner run.json in which its test passed."""
    from miles.ci.reports.record import RunRecord

    run = RunRecord.from_json(json.loads(Path(run_json).read_text()))
    wanted = test_files(recipe, profile)
    if not wanted:
        raise RecipeError(f"no test trains {recipe.name} {profile.describe()}, so no run can verify it")
    attempts = [a for a in run.final_attempts if a.file in wanted and a.suite == profile.suite]
    if not attempts:
        raise RecipeError(
            f"{run_json}: no attempt of {' or '.join(wanted)} in suite {profile.suite}; a record needs the run "
            f"that trained {recipe.name} {profile.describe()}"
        )
    attempt = attempts[-1]
    if attempt.status != "passed":
        raise RecipeError(
            f"{run_json}: {attempt.file} {attempt.status} in {profile.suite}; only a passed run verifies"
        )
    record = {
        "schema": SCHEMA,
        "recipe": recipe.name,
        "variant": recipe.variant,
        "platform": profile.platform,
        "profile": f"{profile.nodes}x{profile.gpus_per_node}",
        "model": profile.model,
        "suite": profile.suite,
        "test": attempt.file,
        "status": attempt.status,
        "commit": attempt.commit or run.commit,
        "started_at": attempt.started_at,
        "elapsed_s": round(attempt.elapsed, 1),
        "fingerprint": fingerprint(recipe, profile),
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = record_path(recipe, profile, directory)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _shown(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)
