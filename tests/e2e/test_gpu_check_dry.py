"""scripts/gpu_check.sh passes in its dry form on a one-GPU and on a two-GPU node.

`--dry-gpus N` is the script's documented dry mode and the only place GPU visibility is faked:
nothing runs on a device, the package checks run for real, and every training step puts the
exact command of its GPU form (NCCL, bf16, its rank count) through the trainer's start checks
before it is skipped for want of a GPU. So a step whose GPU command the trainer would refuse
(the two-GPU step once rendered the Megatron profile and appended --train-backend fsdp, which
the flag check refuses) fails here, on every PR, instead of on the next GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=45, suite="stage-b-cpu")

ROOT = Path(__file__).resolve().parents[2]
STEPS = [
    "platform", "parity", "generate", "grpo", "megatron-parity", "megatron-grpo", "sglang", "sglang-grpo",
    "megatron-moe", "multi-gpu",
]  # fmt: skip
TRAINING = {
    "grpo": 1,
    "megatron-grpo": 1,
    "sglang-grpo": 1,
    "megatron-moe": 1,
}  # step -> ranks of its GPU form


def _dry(tmp_path: Path, gpus: int) -> tuple[int, list[str], str]:
    env = {**os.environ, "PYTHON": sys.executable, "MILES_DEVICE_CHECK_DIR": str(tmp_path)}
    env.pop("MILES_CI_GATE_RECORD_DIR", None)
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry-gpus", str(gpus)],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    return done.returncode, verdicts, done.stdout


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_dry_form_passes_with_every_gpu_step_skipped_and_why(tmp_path, gpus):
    code, verdicts, out = _dry(tmp_path, gpus)
    assert code == 0, "\n".join(verdicts)
    by_step = {v.split()[1].rstrip(":"): v for v in verdicts}
    assert list(by_step) == STEPS
    assert by_step["platform"].startswith("PASS platform")
    assert f"device none used (dry form, {gpus} GPU(s) faked by --dry-gpus)" in by_step["platform"]
    assert all(by_step[s].startswith("SKIP") for s in STEPS[1:]), "\n".join(verdicts)
    for step, ranks in TRAINING.items():
        assert f"needs {ranks} GPU(s) to run; its command" in by_step[step]
        assert "passes the trainer's start checks" in by_step[step]
    for step in ("parity", "generate", "megatron-parity"):
        assert by_step[step].endswith("needs a GPU to run")
    assert "the SGLang engine needs a GPU to start" in by_step["sglang"]
    if gpus == 1:
        assert by_step["multi-gpu"].endswith(
            "needs two GPUs, 1 visible (dry form, 1 GPU(s) faked by --dry-gpus)"
        )
    else:
        assert (
            "needs 2 GPU(s) to run; its command (--train-backend fsdp, --rollout-engine torch, 2 rank(s)) passes"
            in (by_step["multi-gpu"])
        )
    assert out.splitlines()[-1].startswith("device check: passed")


def test_a_dry_count_that_is_not_a_number_of_gpus_is_refused(tmp_path):
    for args in (["--dry-gpus", "0"], ["--dry-gpus"], ["--dry-gpus", "2", "--cpu"]):
        done = subprocess.run(
            ["bash", str(ROOT / "scripts/gpu_check.sh"), *args], capture_output=True, text=True
        )
        assert (
            done.returncode == 2
            and done.stderr.strip() == "usage: bash scripts/gpu_check.sh [--cpu | --dry-gpus N]"
        )
