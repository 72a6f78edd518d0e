"""What is known about a profile: verified by a run, trained on the CPU lane, cannot be built, or untested.

- **verified**: a run record in miles/recipes/runs/, written by `python -m miles.recipes record`
  from the CI runner's run.json, names the recipe form, the profile, the suite and the test file
  that passed, the commit, and a fingerprint of the command and environment the profile
  generates. A record whose fingerprint no longer matches (the recipe changed since) does not
  count.
- **trained on the CPU lane**: a test file registered on a suite of the cpu lane (and not
  disabled) builds this recipe's CPU plan and trains it; read from the tests by the CI
  (`python -m miles.ci recipes --write`) into `miles/recipes/runs/cpu-lane.json`, the evidence
  read here, which a test holds to what the tests say.
- **cannot build**: a GPU profile whose train backend is Megatron and whose model's config
  types that backend's own mapping does not build (`megatron_model_types`).
- **FSDP fallback, untested on GPU**: a GPU profile of a recipe that declares a `Fallback`
  (its family is not built by the Megatron backend yet) and no run record verifies.
- **untested on GPU**: any other GPU profile (no GPU lane run of it has been recorded).
- **untested**: a CPU profile no CPU-lane test trains.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from miles.recipes.recipe import ParallelProfile, Recipe, RecipeError

ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = Path(__file__).with_name("runs")
CPU_LANE_EVIDENCE = RUNS_DIR / "cpu-lane.json"  # written by `python -m miles.ci recipes --write`
SCHEMA = 1
VERIFIED, CPU_LANE, CANNOT_BUILD = "verified", "trained on the CPU lane", "cannot build"
FALLBACK = "FSDP fallback, untested on GPU"
UNTESTED_GPU, UNTESTED = "untested on GPU", "untested"
CPU_LANE_NAME = "cpu"


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
def cpu_lane_trainings(evidence: Path = CPU_LANE_EVIDENCE) -> dict[str, tuple[tuple[str, str], ...]]:
    """recipe -> ((test file, suite), ...) of the cpu-lane tests that train its CPU plan, as the
    evidence file says; empty without one."""
    try:
        data = json.loads(Path(evidence).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise RecipeError(
            f"{evidence}: unreadable ({exc}); rewrite it with `python -m miles.ci recipes --write`"
        ) from None
    return {recipe: tuple((f, s) for f, s in pairs) for recipe, pairs in data.get("trainings", {}).items()}


# --- status -------------------------------------------------------------------------------


def test_files(
    recipe: Recipe, profile: ParallelProfile, evidence: Path = CPU_LANE_EVIDENCE
) -> tuple[str, ...]:
    """The tests that train this profile: on GPUs the recipe's e2e test; on CPU the cpu-lane
    tests that build its CPU plan."""
    if profile.platform == "cpu":
        return tuple(dict.fromkeys(f for f, _ in cpu_lane_trainings(evidence).get(recipe.name, ())))
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
    recipe: Recipe, profile: ParallelProfile, directory: Path = RUNS_DIR, evidence: Path = CPU_LANE_EVIDENCE
) -> Status:
    """The profile's status, from the run records in `directory` and the CPU lane's `evidence`."""
    path = record_path(recipe, profile, directory)
    stale = ""
    if path.is_file():
        record = json.loads(path.read_text())
        problem = _mismatch(record, recipe, profile, evidence)
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
        trained = cpu_lane_trainings(evidence).get(recipe.name, ())
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


def _mismatch(record: dict, recipe: Recipe, profile: ParallelProfile, evidence: Path) -> str | None:
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
    if record.get("test") not in test_files(recipe, profile, evidence):
        return f"its test {record.get('test')!r} does not train this profile"
    if record.get("fingerprint") != fingerprint(recipe, profile):
        return "it was recorded for another command or environment (the recipe changed since)"
    return None


MAX_RUN_JSON_BYTES = 256 << 20  # one row per attempt; a nightly run's is a few MB


def read_run_json(path: Path) -> dict:
    """The CI runner's run record at `path` (its run.json, read as data: the runner's documented
    report is the contract, not its classes); a RecipeError naming the file and what is wrong
    when it is missing, not a regular file, too large, not JSON or not a run record."""
    from miles.files import FileRefused, read_regular

    where = f"--run-json {path}"
    try:
        data = json.loads(read_regular(path, MAX_RUN_JSON_BYTES, what="run record"))
    except FileNotFoundError:
        raise RecipeError(
            f"{where}: no such file; give the run.json in the CI runner's report folder"
        ) from None
    except FileRefused as exc:
        raise RecipeError(f"{where}: {exc}") from None
    except OSError as exc:
        raise RecipeError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    except RecursionError:
        raise RecipeError(f"{where}: nested too deeply to be a run record") from None
    except ValueError as exc:  # bad JSON, bad UTF-8
        raise RecipeError(f"{where}: not JSON ({str(exc)[:120]}); give the runner's run.json") from None
    rows = data.get("attempts") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise RecipeError(
            f"{where}: not a run record of the CI runner (no list of attempts); give the runner's run.json"
        )
    return data


def record_run(recipe: Recipe, profile: ParallelProfile, run_json: Path, directory: Path = RUNS_DIR) -> Path:
    """Write the run record of `profile` from a runner run.json in which its test passed."""
    run = read_run_json(run_json)
    attempts = _final_attempts(run)
    wanted = test_files(recipe, profile)
    if not wanted:
        raise RecipeError(f"no test trains {recipe.name} {profile.describe()}, so no run can verify it")
    attempts = [a for a in attempts if a.get("file") in wanted and a.get("suite") == profile.suite]
    if not attempts:
        raise RecipeError(
            f"{run_json}: no attempt of {' or '.join(wanted)} in suite {profile.suite}; a record needs the run "
            f"that trained {recipe.name} {profile.describe()}"
        )
    attempt = attempts[-1]
    if attempt.get("status") != "passed":
        raise RecipeError(
            f"{run_json}: {attempt.get('file')} {attempt.get('status')} in {profile.suite}; only a passed run verifies"
        )
    record = {
        "schema": SCHEMA,
        "recipe": recipe.name,
        "variant": recipe.variant,
        "platform": profile.platform,
        "profile": f"{profile.nodes}x{profile.gpus_per_node}",
        "model": profile.model,
        "suite": profile.suite,
        "test": attempt["file"],
        "status": attempt["status"],
        "commit": attempt.get("commit") or run.get("commit", ""),
        "started_at": attempt.get("started_at", 0.0),
        "elapsed_s": round(float(attempt.get("elapsed", 0.0)), 1),
        "fingerprint": fingerprint(recipe, profile),
    }
    directory.mkdir(parents=True, exist_ok=True)
    path = record_path(recipe, profile, directory)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def _final_attempts(run: dict) -> list[dict]:
    """The last attempt of every (suite, file) of a runner's run record."""
    last: dict[tuple, dict] = {}
    for row in run["attempts"]:
        last[(row.get("suite"), row.get("file"))] = row
    return list(last.values())


def _shown(path: Path) -> str:
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)
