"""Launching a recipe's trainer command the way the lanes do, and reading its metric records.

The plan comes from the recipe (miles.recipes), the tiny checkpoint from the checkpoint pipeline
(miles.ckpt.pipeline, source tiny:<family>, its tiny checkpoint and torch_dist form copied from
the shared cache instead of built again), and the run from the recipe launcher, so these tests
exercise what a user's `python scripts/run_<model>.py full-train` does.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from miles.metrics.capture import RECORD_DIR_ENV
from miles.metrics.records import MAX_RECORD_FILES, read_record
from tests.support.ckpt import cache_folder


def tiny_plan(
    recipe_name: str,
    workdir: Path,
    *extra_args: str,
    run_id: str = "run",
    train_backend: str | None = None,
    nodes: int | None = None,
    ray_address: str | None = None,
):
    """The recipe's CPU `tiny` launch plan (rendered for `train_backend` when given; on `nodes`
    Ray nodes when given), its tiny checkpoint prepared under workdir/models."""
    from miles.ckpt.pipeline import prepare
    from miles.recipes import load
    from miles.recipes.launch import RunOptions, build_plan

    options = RunOptions(
        model="tiny",
        model_dir=str(workdir / "models"),
        output_dir=str(workdir / "runs"),
        run_id=run_id,
        python=sys.executable,
        extra_args=tuple(extra_args),
        nodes=nodes,
        gpus_per_node=2 // nodes if nodes else None,
        ray_address=ray_address,
        workdir=os.getcwd(),
    )
    form = load(recipe_name, platform="cpu")
    plan = build_plan(form.on_backend(train_backend) if train_backend else form, options, "cpu", base_env={})
    prepare(plan.checkpoint, progress=False, tiny_cache=cache_folder())
    return plan


def launch(plan, record_dir: Path) -> int:
    """Run a one-node plan with the recipe launcher; its metric record lands in record_dir."""
    from miles.recipes.launch import run

    return run(plan, env={**os.environ, RECORD_DIR_ENV: str(record_dir)})


def series(record_dir: Path, key: str) -> dict[int, float]:
    """One metric's {step: value} from the capture records in record_dir, read as the gate reads
    them (miles.metrics.records: regular files only, each at most MAX_RECORD_BYTES, at most
    MAX_RECORD_FILES of them; a RecordError names anything else)."""
    points: dict[int, float] = {}
    for record in sorted(record_dir.glob("*.jsonl"))[:MAX_RECORD_FILES]:
        points.update(read_record(record).get(key, {}))
    return points


def checkpoint_dir(plan) -> Path:
    return Path(dict(plan.workdirs)["checkpoints"])
