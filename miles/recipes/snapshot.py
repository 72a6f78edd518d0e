"""Golden snapshots: the command, environment and status of every recipe x platform x profile.

Each recipe has one JSON file (`tests/snapshots/recipes/<recipe>.json`) keyed by
`<platform> <nodes>x<gpus> <model>`. A change to a recipe, an overlay, a model spec or the
launcher shows up as a diff of these files; refresh them with

    python -m miles.recipes snapshot --update

and review the diff like any other change.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import replace
from pathlib import Path

from miles.recipes import names, variants
from miles.recipes.launch import RunOptions, build_plan

DEFAULT_DIR = Path("tests/snapshots/recipes")
# Fixed paths and an empty caller environment, so snapshots do not depend on the machine.
FIXED = RunOptions(
    model_dir="/models", data_dir="/data", output_dir="/runs", run_id="snapshot", python="python"
)


def render(name: str) -> str:
    """The snapshot file's text for one recipe."""
    out = {}
    for recipe in variants(name):
        for p in recipe.profiles:
            options = replace(FIXED, model=p.model, nodes=p.nodes, gpus_per_node=p.gpus_per_node)
            plan = build_plan(recipe, options, p.platform, base_env={})
            key = f"{p.platform} {p.nodes}x{p.gpus_per_node} {p.model}"
            out[key] = {
                "variant": recipe.variant,
                "mode": plan.mode,
                "command": list(plan.command),
                "env": dict(plan.env),
                "workdirs": dict(plan.workdirs),
                "checkpoint": {
                    "source": plan.checkpoint.source,
                    "steps": list(plan.checkpoint.steps),
                    "datasets": list(plan.checkpoint.datasets),
                },
                "pins": dict(plan.pins),
                "status": plan.status.split(":", 1)[0],
            }
    return json.dumps(out, indent=1) + "\n"


def update(directory: Path = DEFAULT_DIR) -> list[Path]:
    """Rewrite the snapshots that differ or are missing; returns the files written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names():
        path = directory / f"{name}.json"
        text = render(name)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            written.append(path)
    return written


def compare(directory: Path = DEFAULT_DIR) -> list[str]:
    """Unified diffs (committed -> generated) for every snapshot that differs or is missing."""
    problems = []
    for name in names():
        path = directory / f"{name}.json"
        text = render(name)
        if not path.exists():
            problems.append(f"{path}: missing")
            continue
        old = path.read_text()
        if old != text:
            diff = difflib.unified_diff(
                old.splitlines(), text.splitlines(), f"{path} (committed)", f"{path} (generated)", lineterm=""
            )
            problems.append("\n".join(diff))
    return problems
