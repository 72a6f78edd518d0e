"""scripts/gpu_check.sh passes: on CPU at CI size every PR, on one GPU in the CUDA lane.

The script is what a person runs on a single GPU to see the training path work there
(platform, engine-vs-forward parity for every family, the engine against generate(), the
tiny GRPO recipe over NCCL on FSDP, HF-vs-Megatron logits, the tiny recipe on the Megatron
backend, the SGLang engine's formats, weight-update session, memory cycles and logprob gap,
a bf16 Megatron run with SGLang rollouts, a MoE run, two GPUs). Its --cpu form runs the same
steps, skipping by name those that need a GPU, so a change that breaks the script fails
here, not on the next GPU machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci, register_cuda_ci, register_rocm_ci
from miles.load import run_counted

register_cpu_ci(est_time=60, suite="stage-b-cpu")
register_cuda_ci(est_time=540, suite="stage-b-2-gpu-h200", labels=["fsdp", "short"])
register_rocm_ci(est_time=650, suite="stage-c-4-gpu-mi350", labels=["fsdp", "short", "amd"])

ROOT = Path(__file__).resolve().parents[2]
ON_GPU = os.environ.get("MILES_CI_BACKEND", "cpu") != "cpu"


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """The script's run, on this machine's form (its verdict lines are read by the tests below)."""
    workdir = tmp_path_factory.mktemp("device-check")
    env = {**os.environ, "PYTHON": sys.executable, "MILES_DEVICE_CHECK_DIR": str(workdir)}
    env.pop("MILES_CI_GATE_RECORD_DIR", None)
    # 900 s: above the check's own 600 s limit per training run, so a hung run shows as its FAIL line;
    # both counted at the machine's load (a shared 2-core machine makes the check slow, not hung)
    return run_counted(
        ["bash", str(ROOT / "scripts/gpu_check.sh"), *([] if ON_GPU else ["--cpu"])],
        900,
        env=env,
        cwd=str(workdir),
    )


def test_every_step_of_the_device_check_passes(check):
    done = check
    verdicts = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert done.returncode == 0, "\n".join(verdicts) + done.stderr[-2000:]
    sglang = (
        ["sglang-formats", "sglang-weights", "sglang-memory", "sglang-logprob-gap"] if ON_GPU else ["sglang"]
    )
    assert [v.split()[1].rstrip(":") for v in verdicts] == [
        "platform", "parity", "generate", "grpo", "megatron-parity", "megatron-grpo", *sglang, "sglang-grpo",
        "megatron-moe", "multi-gpu",
    ]  # fmt: skip
    assert not any(v.startswith("FAIL") for v in verdicts)
    if not ON_GPU:  # what needs a GPU says so, by name; the rest runs
        assert [v.split()[1].rstrip(":") for v in verdicts if v.startswith("SKIP")] == [
            "sglang",
            "sglang-grpo",
            "multi-gpu",
        ]
    assert done.stdout.splitlines()[-1].startswith("device check: passed")


def test_the_platform_line_says_sglang_only_where_it_imports(check):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    imports = (
        subprocess.run([sys.executable, "-c", "import sglang"], capture_output=True, env=env).returncode == 0
    )
    (line,) = [line for line in check.stdout.splitlines() if line.startswith("PASS platform")]
    assert ("sglang yes" in line) == imports and ("sglang no (" in line) == (not imports)


@pytest.mark.skipif(ON_GPU, reason="a GPU machine has the device")
def test_without_the_device_the_check_stops_at_the_platform_line(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "MILES_DEVICE_CHECK_DIR": str(tmp_path)}
    done = subprocess.run(
        ["bash", str(ROOT / "scripts/gpu_check.sh")], capture_output=True, text=True, timeout=300, env=env
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stdout
    assert lines[0].startswith("FAIL platform") and "expected a GPU, found cpu" in lines[0]
