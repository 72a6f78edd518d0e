"""The seed's --sglang-config cases (radixark/miles 31f1ca961, tests/e2e/sglang_config/) for their
GPU twins here. Not a test module.

The seed colocates (--colocate, all 8 GPUs train and serve). miles starts the engines of a config
in processes of their own, so each twin splits the host: 4 GPUs train and the config's groups
are scaled to the other 4 (each group of 4 becomes a group of 2); everything else is the seed's
command (tests/e2e/qwen25_case.py).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("qwen25_case", Path(__file__).parents[1] / "qwen25_case.py")
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)

TRAIN_GPUS = ROLLOUT_GPUS = 4


def run(workdir: Path, config: str, flags: str) -> Path:
    path = workdir / "sglang_config.yaml"
    path.write_text(config.replace("num_gpus: 4", "num_gpus: 2"))
    placement = (
        f" --sglang-config {path} --actor-num-nodes 1 --actor-num-gpus-per-node {TRAIN_GPUS}"
        f" --rollout-num-gpus {ROLLOUT_GPUS}"
    )
    return case.run(workdir, flags + placement, actor_gpus=TRAIN_GPUS)
