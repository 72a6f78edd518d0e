"""Whether a profile has been trained, only layout-checked, or neither, and the evidence.

A profile is "verified" only when a lane has trained it: a run record in miles/recipes/runs/,
written by `python -m miles.recipes record` from the CI runner's run.json, names the recipe
form, the profile, the suite and the test file that passed, the commit, and a fingerprint of
the command and environment the profile generates. A record whose fingerprint no longer
matches (the recipe changed since) does not count. Without a record a Megatron profile is
"layout checked" (the layout rules pass, and megatron-core itself accepts every recipe layout
in tests/parallel/test_megatron_agreement.py); anything else is "untested".
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

from miles.recipes.recipe import ParallelProfile, Recipe, RecipeError, lane_megatron_core

ROOT = Path(__file__).resolve().parents[2]
RUNS_DIR = Path(__file__).with_name("runs")
SCHEMA = 1
VERIFIED, LAYOUT_CHECKED, UNTESTED = "verified", "layout checked", "untested"
CPU_TEST = "tests/e2e/test_train_recipes_tiny.py"
CPU_MEGATRON_TEST = "tests/e2e/test_train_megatron_tiny.py"


@dataclass(frozen=True)
class Status:
    kind: str  # verified | layout checked | untested
    detail: str

    def text(self) -> str:
        return f"{self.kind}: {self.detail}"


def test_file(recipe: Recipe, profile: ParallelProfile) -> str:
    """The test that trains this profile: the recipe's e2e test on GPUs; on CPU the Megatron
    backend's tiny training test, or the tiny suite for the FSDP profiles."""
    if profile.platform == "cpu":
        return CPU_MEGATRON_TEST if recipe.backend_of(profile) == "megatron" else CPU_TEST
    return f"tests/e2e/recipes/test_{recipe.name}_recipe.py"


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


def profile_status(recipe: Recipe, profile: ParallelProfile, directory: Path = RUNS_DIR) -> Status:
    path = record_path(recipe, profile, directory)
    stale = ""
    if path.is_file():
        record = json.loads(path.read_text())
        problem = _mismatch(record, recipe, profile)
        if problem is None:
            when = time.strftime("%Y-%m-%d", time.gmtime(record.get("started_at", 0)))
            return Status(
                VERIFIED,
                f"{record['test']} passed in {record['suite']} at commit {record['commit'][:12]} on {when} "
                f"({_shown(path)})",
            )
        stale = f"; {_shown(path)} does not count: {problem}"
    if recipe.backend_of(profile) == "megatron" and profile.platform != "cpu":
        version = lane_megatron_core(profile.platform) or "installed"
        detail = (
            f"the rules of megatron-core {version} pass and megatron-core accepts it; no lane has trained it"
        )
        if recipe.model.gaps:
            detail += (
                f"; megatron-core lacks {len(recipe.model.gaps)} feature(s) of {recipe.model.name} (facts)"
            )
        return Status(LAYOUT_CHECKED, detail + stale)
    return Status(
        UNTESTED,
        f"{recipe.backend_of(profile)} on {profile.platform}: {test_file(recipe, profile)} trains it in "
        f"{profile.suite}, but no run record says so yet (python -m miles.recipes record){stale}",
    )


def _mismatch(record: dict, recipe: Recipe, profile: ParallelProfile) -> str | None:
    expected = {
        "recipe": recipe.name,
        "variant": recipe.variant,
        "platform": profile.platform,
        "profile": f"{profile.nodes}x{profile.gpus_per_node}",
        "model": profile.model,
        "suite": profile.suite,
        "test": test_file(recipe, profile),
        "status": "passed",
    }
    for key, value in expected.items():
        if record.get(key) != value:
            return f"its {key} is {record.get(key)!r}, not {value!r}"
    if record.get("fingerprint") != fingerprint(recipe, profile):
        return "it was recorded for another command or environment (the recipe changed since)"
    return None


def record_run(recipe: Recipe, profile: ParallelProfile, run_json: Path, directory: Path = RUNS_DIR) -> Path:
    """Write the run record of `profile` from a runner run.json in which its test passed."""
    from miles.ci.record import RunRecord

    run = RunRecord.from_json(json.loads(Path(run_json).read_text()))
    wanted = test_file(recipe, profile)
    attempts = [a for a in run.final_attempts if a.file == wanted and a.suite == profile.suite]
    if not attempts:
        raise RecipeError(
            f"{run_json}: no attempt of {wanted} in suite {profile.suite}; a record needs the run that "
            f"trained {recipe.name} {profile.describe()}"
        )
    attempt = attempts[-1]
    if attempt.status != "passed":
        raise RecipeError(
            f"{run_json}: {wanted} {attempt.status} in {profile.suite}; only a passed run verifies"
        )
    record = {
        "schema": SCHEMA,
        "recipe": recipe.name,
        "variant": recipe.variant,
        "platform": profile.platform,
        "profile": f"{profile.nodes}x{profile.gpus_per_node}",
        "model": profile.model,
        "suite": profile.suite,
        "test": wanted,
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
