"""Run a recipe end to end the way CI does: `scripts/run_<name>.py full-train`.

The recipe comes from `miles.recipes.load()`, which dispatches on the platform (and refuses a
MILES_HARDWARE_PLATFORM that disagrees with torch); the shared script dispatches the same way,
so a ROCm runner trains the ROCm form without any import switch. The prepared checkpoints
come from MILES_MODEL_DIR (or MILES_SCRIPT_MODEL_DIR) and the run uses the trainer's
synthetic task; the prepare step still fetches the recipe's prompt dataset (from the Hugging
Face cache, or the hub when HF_HUB_OFFLINE is unset), as a user's full-train does.

The run keeps the --ci-test checks on. Its logprob tolerance is the bf16 one: the trainer
and SGLang compute the same weights with different kernels (fp32 runs agree to ~1e-6, bf16
ones to ~1e-2), while a missed weight sync moves logprobs by far more.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.platform import resolve
from miles.recipes import load

ROOT = Path(__file__).resolve().parents[3]
ROLLOUTS = 3


BF16_LOGPROB_TOL = "0.05"


def run_recipe(name: str, workdir: Path) -> Path:
    """Prepare and train `name` on this machine's GPUs, by the command the recipe renders (its
    backend and layout, or its declared fallback); returns the run's checkpoint directory."""
    platform = str(resolve().platform)
    recipe = load(name)
    assert recipe.variant == ("rocm" if platform == "rocm" else "shared"), (platform, recipe.variant)
    runs = workdir / "runs"
    argv = [
        sys.executable,
        f"scripts/run_{name}.py",
        "full-train",
        "--run-id",
        "e2e",
        "--output-dir",
        str(runs),
    ]
    argv += [
        "--num-rollout",
        str(ROLLOUTS),
        "--extra-args",
        f"--prompt-data synthetic:fixed --rm-type synthetic --ci-test --ci-logprob-abs-diff-tol {BF16_LOGPROB_TOL}",
    ]
    proc = subprocess.run(argv, cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, check=False)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{tail}"
    checkpoints = runs / "e2e" / "checkpoints"
    assert checkpoints.is_dir() and any(checkpoints.iterdir()), f"{name} saved no checkpoint:\n{tail}"
    return checkpoints


@pytest.fixture
def train_recipe(tmp_path: Path):
    """`train_recipe(name)` runs the recipe's full-train in a fresh working directory."""
    return lambda name: run_recipe(name, tmp_path)
