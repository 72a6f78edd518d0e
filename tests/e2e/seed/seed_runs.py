"""The seed lane's GPU twins: a seed test's training command, run the way a user runs a recipe.

Not a test module: the twins run through conftest.py's `seed_train`. Each twin names a recipe, a model and the seed test's
flags (radixark/miles 31f1ca961, tests/...), and `full_train` runs
`scripts/run_<recipe>.py full-train` with those flags as its --extra-args: prepare-ckpt
fetches the model, converts it to torch_dist and fetches every dataset the flags read from
the data dir (miles.ckpt.datasets), then the recipe's command trains with the seed's flags
last, so they win. `{data}` in a flag stands for the data dir. A seed flag miles has no
counterpart for is left out by the twin, which says why beside it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from miles.metrics.capture import RECORD_DIR_ENV

ROOT = Path(__file__).resolve().parents[3]
DATA_DIR_ENV = "MILES_SCRIPT_DATA_DIR"
DEFAULT_DATA_DIR = ".miles/data"


def data_dir() -> str:
    """Where prepare-ckpt puts the datasets (the recipe scripts' --data-dir)."""
    return os.environ.get(DATA_DIR_ENV, DEFAULT_DATA_DIR)


def extra_args(flags: Sequence[str]) -> list[str]:
    """The seed's flags with `{data}` replaced by the data dir."""
    return [flag.replace("{data}", data_dir()) for flag in flags]


def command(
    recipe: str,
    flags: Sequence[str],
    *,
    output_dir: Path,
    model: str | None = None,
    gpus: int | None = None,
    verb: str = "full-train",
    run_id: str = "seed",
) -> list[str]:
    """`scripts/run_<recipe>.py <verb>` with the seed's flags as --extra-args."""
    argv = [
        sys.executable,
        f"scripts/run_{recipe}.py",
        verb,
        "--run-id",
        run_id,
        "--output-dir",
        str(output_dir),
    ]
    argv += ["--data-dir", data_dir()]
    if model:
        argv += ["--model", model]
    if gpus:
        argv += ["--num-gpus-per-node", str(gpus)]
    return [*argv, "--extra-args", " ".join(extra_args(flags))]


def full_train(
    recipe: str,
    flags: Sequence[str],
    workdir: Path,
    *,
    model: str | None = None,
    gpus: int | None = None,
    expect_exit: int = 0,
    env: dict[str, str] | None = None,
) -> tuple[Path, str]:
    """Prepare and train; returns the metric record directory (the runner's, when it sets one)
    and the run's output. The run must exit with `expect_exit`."""
    record = Path(os.environ.get(RECORD_DIR_ENV) or workdir / "record")
    argv = command(recipe, flags, output_dir=workdir / "runs", model=model, gpus=gpus)
    full_env = {**os.environ, RECORD_DIR_ENV: str(record), **(env or {})}
    proc = subprocess.run(argv, cwd=ROOT, env=full_env, capture_output=True, text=True, check=False)
    output = proc.stdout + proc.stderr
    tail = "\n".join(output.splitlines()[-60:])
    assert proc.returncode == expect_exit, f"{' '.join(argv)} exited {proc.returncode}:\n{tail}"
    return record, output
