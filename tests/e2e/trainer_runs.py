"""Running `python -m miles.train` on a tiny model, for the training e2e tests.

Not a test module: the test files import it. A run is the command a user types (the recipes' CPU
launcher, miles.train.forked_ranks: gloo ranks on the CPU), with the metric record written where the test reads it.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from miles.metrics.capture import RECORD_DIR_ENV, decode_value
from tests.support.ranks import torchrun

# A tiny GRPO run: 4 prompts x 4 samples per rollout, two optimizer steps of 8 samples each (so
# the second step's ratio is not 1), an entropy bonus (so the loss is not zero at ratio 1).
BASE_ARGS = (
    "--prompt-data", "synthetic:fixed", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
    "--global-batch-size", "8", "--micro-batch-size", "4", "--rollout-max-response-len", "8", "--lr", "1e-3",
    "--entropy-coef", "0.01", "--ci-test", "--num-threads", "1",
)  # fmt: skip
COMPARED = ("train/loss", "train/grad_norm", "train/entropy", "train/ppo_kl", "rollout/raw_reward")
# ppo_kl is a mean of differences of logprobs of order 1 to 10, so a float32 sum in another order
# moves it by about 1e-7 whatever its size (measured: 3e-8 on a value of 5e-4 between HSDP and FSDP).
ABS_NOISE = {"train/ppo_kl": 1e-7}


def tiny_qwen3(root: Path, layers: int = 2) -> tuple[Path, Path]:
    """A tiny random Qwen3 checkpoint and its torch_dist conversion (the Megatron backend's --ref-load)."""
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    hf = make_tiny_checkpoint("qwen3", layers, root / "hf")
    dist = root / "torch_dist"
    dist.mkdir()
    convert_to_torch_dist(hf, dist, "qwen3")
    return hf, dist


@dataclass(frozen=True)
class Run:
    returncode: int
    output: str  # stdout and stderr, every rank
    record: Path  # the metric record directory

    def series(self, key: str) -> dict[int, float]:
        """One metric's {rollout: value}."""
        points: dict[int, float] = {}
        for path in self.record.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                row = json.loads(line)
                if row["metric"] == key:
                    points.update({int(s): decode_value(v) for s, v in row["series"]})
        return points

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])


def train(
    workdir: Path, hf: Path, *args: str, nproc: int = 2, name: str = "run", env: dict | None = None,
    timeout: int = 900,
) -> Run:  # fmt: skip
    """`python -m miles.train.forked_ranks --nproc-per-node nproc -m miles.train --hf-checkpoint hf
    BASE_ARGS args` (the CPU launcher a recipe renders); its metric record goes to workdir/name."""
    record = workdir / name
    cmd = [
        *torchrun(nproc), "-m", "miles.train", "--hf-checkpoint", str(hf), *BASE_ARGS, "--actor-num-gpus-per-node", str(nproc), *args,
    ]  # fmt: skip
    full_env = {**os.environ, RECORD_DIR_ENV: str(record), "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False)
    return Run(proc.returncode, proc.stdout + proc.stderr, record)


def assert_same_metrics(a: Run, b: Run, steps, rel: float = 0.0, keys=COMPARED) -> None:
    """Every metric of `keys` equal (within `rel`) at each of `steps` in both runs."""
    import pytest

    for key in keys:
        first, second = a.series(key), b.series(key)
        for step in steps:
            assert step in first and step in second, f"{key} at rollout {step}: {first} vs {second}"
            where = f"{key} at rollout {step}: {first[step]!r} vs {second[step]!r}"
            if rel:
                assert second[step] == pytest.approx(first[step], rel=rel, abs=ABS_NOISE.get(key, 1e-9)), (
                    where
                )
            else:
                assert second[step] == first[step], where
