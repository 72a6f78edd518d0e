"""A recipe's GPU form dry-started on two CPU ranks: the command the recipe renders for 4 GPUs,
its layout and model flags scaled to 2 ranks and a tiny checkpoint's sizes, the flags that act
only on a GPU (which the CPU start refuses, miles.megatron.options) left out, then
`python -m miles.train ... --dry-start` under torch.distributed.run. Not a test module: each
family's test builds its tiny checkpoint and calls these."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# the recipes' 4-GPU layouts (TP 4 with sequence parallelism, EP 4) scaled to the 2 ranks here
TWO_RANKS = {
    "--tensor-model-parallel-size": 2,
    "--expert-model-parallel-size": 2,
    "--actor-num-gpus-per-node": 2,
}


def gpu_command(recipe_name: str, tmp_path: Path) -> tuple[list[str], Path, Path]:
    """The train command the recipe renders for 1 node of 4 CUDA GPUs, and its --hf-checkpoint and
    --ref-load (the tiny checkpoint goes under the names the plan gives the prepared ones)."""
    from miles.recipes import shared
    from miles.recipes.launch import RunOptions, build_plan

    recipe = shared(recipe_name)
    profile = recipe.profile(None, "cuda", 1, 4)
    options = RunOptions(
        model=profile.model, model_dir=str(tmp_path / "models"), output_dir=str(tmp_path / "runs")
    )
    argv = list(build_plan(recipe, options, "cuda", base_env={}).train_args)
    assert argv[argv.index("--train-backend") + 1] == "megatron"
    hf, ref = (Path(argv[argv.index(flag) + 1]) for flag in ("--hf-checkpoint", "--ref-load"))
    return argv, hf, ref


def scale(argv: list[str], family_name: str, config: Mapping[str, Any], **extra: Any) -> None:
    """The model flags at the tiny config's sizes and the layout at two ranks, in place."""
    from miles.families import family
    from miles.families.facts import flag_values

    values = {**flag_values(family(family_name).keys, config), **TWO_RANKS, **extra}
    for flag, value in values.items():
        if flag in argv and not isinstance(value, bool):
            argv[argv.index(flag) + 1] = str(value)


def without_gpu_only(argv: list[str]) -> dict[str, str]:
    """Leave out, in place, the flags a CPU start refuses; returns them with the reasons."""
    from miles.megatron import options

    gpu_only = dict(options.render_problems(argv, "cpu", stack_has_te=False))
    for flag in gpu_only:
        at = argv.index(flag)
        del argv[at : at + (2 if at + 1 < len(argv) and not argv[at + 1].startswith("--") else 1)]
    return gpu_only


def dry_start(argv: list[str]) -> str:
    """Run the command with --dry-start on two gloo ranks; its output, after asserting it exited 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "miles.train", *argv, "--dry-start"]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "Error" in line and "Warning" not in line]
    assert proc.returncode == 0, "\n".join(errors[-5:]) or out[-3000:]
    return out
