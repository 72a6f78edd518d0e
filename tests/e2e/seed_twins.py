"""The seed framework's GPU tests as miles runs them: its models, datasets and trainer flags.

Not a test module: the GPU twins of radixark/miles 31f1ca961's tests import it. A twin runs the
command a user runs, `torchrun --nproc-per-node <GPUs> -m miles.train <the seed's flags>`, on
the seed's checkpoint and dataset:

- a model is `<model dir>/<name>` when prepared there (`python scripts/run_<recipe>.py prepare`
  writes it, and `<name>_torch_dist` beside it), else the Hugging Face hub's snapshot
  (miles.ckpt.hub; HF_HUB_OFFLINE=1 makes a missing one an error); its torch_dist form, for the
  Megatron backend, is converted into the model dir once (miles.ckpt.torch_dist);
- a dataset is fetched into the data dir by miles.ckpt.datasets, checksummed;
- the model dir is MILES_MODEL_DIR (or MILES_SCRIPT_MODEL_DIR), else .miles/models, the data
  dir MILES_SCRIPT_DATA_DIR, else .miles/data, as the recipe scripts read them.

A run's metric record goes where the CI runner asks (MILES_CI_GATE_RECORD_DIR), so the twins'
metric gates read it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def model_dir() -> Path:
    return Path(
        os.environ.get("MILES_SCRIPT_MODEL_DIR") or os.environ.get("MILES_MODEL_DIR") or ".miles/models"
    )


def data_dir() -> Path:
    return Path(os.environ.get("MILES_SCRIPT_DATA_DIR") or ".miles/data")


def model(repo: str, *, torch_dist: bool = False) -> tuple[Path, Path | None]:
    """(HF checkpoint, its torch_dist or None) of Hugging Face repo `repo` ("Qwen/Qwen3-4B")."""
    from miles.ckpt.hub import parse_source, resolve_hub
    from miles.ckpt.torch_dist import convert_to_torch_dist

    name = repo.split("/")[-1]
    hf = model_dir() / name
    if not (hf / "config.json").is_file():
        hf, _ = resolve_hub(parse_source(repo))
    if not torch_dist:
        return hf, None
    dist = model_dir() / f"{name}_torch_dist"
    if not (dist / "latest_checkpointed_iteration.txt").is_file():
        dist.mkdir(parents=True, exist_ok=True)
        convert_to_torch_dist(hf, dist, family_of_checkpoint(hf))
    return hf, dist


def family_of_checkpoint(hf: Path) -> str:
    """The miles family whose model types include the checkpoint's config.json model_type
    (MiMo-7B-RL's mimo, Qwen3-4B's qwen3, ...)."""
    import json

    from miles.families import family_of

    config = json.loads((hf / "config.json").read_text())
    found = family_of(config)
    if found is None:
        raise SystemExit(f"{hf}/config.json: model_type {config.get('model_type')!r} is no miles family")
    return found.name


def dataset(name: str) -> Path:
    """The directory of seed dataset `name` (miles.ckpt.datasets.DATASETS), fetched when missing."""
    from miles.ckpt.datasets import DATASETS, fetch_dataset

    return fetch_dataset(DATASETS[name], data_dir()).path


def train(
    args: Sequence[str], gpus: int, *, env: dict | None = None, timeout: int = 7200
) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node gpus -m miles.train args` (output kept)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus),
        "-m", "miles.train", *args, "--actor-num-nodes", "1", "--actor-num-gpus-per-node", str(gpus),
    ]  # fmt: skip
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    sys.stdout.write(proc.stdout[-20000:])
    sys.stderr.write(proc.stderr[-20000:])
    return proc


def tail(proc: subprocess.CompletedProcess, lines: int = 60) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-lines:])
