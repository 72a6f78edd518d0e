"""Running a seed test's training command on a GPU lane from the seed's flags as text (the GPU twins that state them so; seed_twins.py builds a command from arguments instead).

Not a test module: the twin files import it. A twin states the seed's trainer flags as the
seed writes them (radixark/miles 31f1ca961, the file it cites), with `{model}`, `{ref}`,
`{data}` where the seed names /root/models/<model>, its torch_dist and /root/datasets; the
flags miles does not parse are listed beside them with the reason, and left out. The model
and datasets are prepared by the recipe's checkpoint plan (miles.ckpt.pipeline: fetch,
validate, torch_dist), under $MILES_MODEL_DIR and $MILES_DATA_DIR (default .miles/models,
.miles/data), as `invoke prepare-ckpt` does; the run is `python -m torch.distributed.run
--standalone --nproc-per-node N -m miles.train <flags>`, its metrics recorded where the CI
runner's record directory says, so the twin's gates see them.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from miles.metrics.capture import RECORD_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]


def prepared(
    recipe: str,
    model: str,
    *,
    train_backend: str = "megatron",
    datasets: tuple[str, ...] = (),
    steps: tuple[str, ...] = (),
):
    """The recipe's checkpoint plan for `model` (its datasets included), with the further `steps`
    (of miles.ckpt.plan.STEPS) the case needs beside the recipe's, prepared, and the further
    `datasets` (of miles.ckpt.datasets.DATASETS) fetched beside them."""
    import dataclasses

    from miles.ckpt.datasets import DATASETS, fetch_dataset
    from miles.ckpt.pipeline import prepare
    from miles.ckpt.plan import STEPS
    from miles.recipes import load

    plan = load(recipe).checkpoint_plan(
        model,
        model_dir=os.environ.get("MILES_MODEL_DIR", ".miles/models"),
        data_dir=os.environ.get("MILES_DATA_DIR", ".miles/data"),
        train_backend=train_backend,
    )
    if steps:
        plan = dataclasses.replace(plan, steps=tuple(s for s in STEPS if s in plan.steps or s in steps))
    prepare(plan, progress=False)
    for name in datasets:
        fetch_dataset(DATASETS[name], plan.data_dir)
    return plan


def command(flags: str, plan, left_out: Mapping[str, str] = (), **values: str) -> list[str]:
    """The seed's flags with the prepared paths filled in and `left_out`'s flags (each with the
    values that follow it) removed."""
    text = flags.format(
        model=plan.hf_dir, ref=plan.torch_dist_dir or plan.hf_dir, data=plan.data_dir or "", **values
    )
    tokens, out, skipping = shlex.split(text), [], False
    for token in tokens:
        if token.startswith("--"):
            skipping = token in left_out
        if not skipping:
            out.append(token)
    return out


def train(argv: list[str], nproc: int, workdir: Path, env: Mapping[str, str] | None = None) -> Path:
    """Run the trainer on `nproc` local GPUs; returns the record directory of its metrics."""
    record = Path(os.environ.get(RECORD_DIR_ENV) or workdir / "record")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    run_env = {
        **os.environ,
        RECORD_DIR_ENV: str(record),
        "MILES_ENGINE_LOG_DIR": str(workdir / "engines"),
        **(env or {}),
    }
    proc = subprocess.run([*launcher, "-m", "miles.train", *argv], cwd=ROOT, env=run_env, check=False)
    assert proc.returncode == 0, f"miles.train exited {proc.returncode} (its output is above)"
    return record


def series(record: Path, key: str) -> dict[int, float]:
    """One metric's {step: value} from the record directory."""
    import json

    from miles.metrics.capture import decode_value

    points: dict[int, float] = {}
    for path in record.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["metric"] == key:
                points.update({int(s): decode_value(v) for s, v in row["series"]})
    return points
