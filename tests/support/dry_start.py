"""A recipe's GPU form dry-started on two CPU ranks: the command the recipe renders for 4 GPUs,
its layout and model flags scaled to 2 ranks and a tiny checkpoint's sizes, the flags that act
only on a GPU (which the CPU start refuses, miles.megatron.options) left out, then
`python -m miles.train ... --dry-start` under torch.distributed.run. Each family's test builds
its tiny checkpoint and calls these."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.support import ranks

# the recipes' 4-GPU layouts (TP 4 with sequence parallelism, EP 4) scaled to the 2 ranks here
TWO_RANKS = {
    "--tensor-model-parallel-size": 2,
    "--expert-model-parallel-size": 2,
    "--actor-num-gpus-per-node": 2,
}


def gpu_command(recipe_name: str, tmp_path: Path, platform: str = "cuda") -> tuple[list[str], Path, Path]:
    """The train command the recipe renders for 1 node of 4 GPUs of `platform` (its ROCm form
    on rocm), and its --hf-checkpoint and --ref-load (the tiny checkpoint goes under the names
    the plan gives the prepared ones)."""
    from miles.recipes import load, shared
    from miles.recipes.launch import RunOptions, build_plan

    recipe = shared(recipe_name) if platform == "cuda" else load(recipe_name, platform=platform)
    profile = recipe.profile(None, platform, 1, 4)
    options = RunOptions(
        model=profile.model, model_dir=str(tmp_path / "models"), output_dir=str(tmp_path / "runs")
    )
    argv = list(build_plan(recipe, options, platform, base_env={}).train_args)
    assert argv[argv.index("--train-backend") + 1] == "megatron"
    hf, ref = (Path(argv[argv.index(flag) + 1]) for flag in ("--hf-checkpoint", "--ref-load"))
    return argv, hf, ref


LAYOUT = {
    "tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size", "cp": "--context-parallel-size",
    "ep": "--expert-model-parallel-size", "etp": "--expert-tensor-parallel-size",
}  # fmt: skip


def scaled_to_two(argv: list[str]) -> dict[str, int]:
    """The command's layout scaled to 2 ranks: context, then pipeline, then tensor parallelism
    halved until the dense grid fits, then expert parallelism until the expert grid does; each
    flag the command gives, at its scaled value (and two GPUs per node)."""
    given = {k: int(argv[argv.index(f) + 1]) for k, f in LAYOUT.items() if f in argv}
    d = {k: given.get(k, 1) for k in LAYOUT} | {"etp": given.get("etp", given.get("tp", 1))}
    for degree in ("cp", "pp", "tp"):
        while d["tp"] * d["pp"] * d["cp"] > 2 and d[degree] > 1:
            d[degree] //= 2
    d["etp"] = min(d["etp"], d["tp"])
    while d["etp"] * d["ep"] * d["pp"] > 2 and d["ep"] > 1:
        d["ep"] //= 2
    return {LAYOUT[k]: d[k] for k in given} | {"--actor-num-gpus-per-node": 2}


def scale(
    argv: list[str],
    family_name: str,
    config: Mapping[str, Any],
    layout: Mapping[str, int] | None = None,
    **extra: Any,
) -> None:
    """The model flags at the tiny config's sizes and the layout at two ranks (`layout`, default
    TP 2 and EP 2), in place."""
    from miles.families import family
    from miles.families.facts import flag_values

    values = {**flag_values(family(family_name).keys, config), **(layout or TWO_RANKS), **extra}
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
    proc = ranks.trainer([*argv, "--dry-start"], timeout=300)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if "Error" in line and "Warning" not in line]
    assert proc.returncode == 0, "\n".join(errors[-5:]) or out[-3000:]
    return out
