"""The device check's own rules that hold on any machine: its weight pushes take the engine's
dtype, as the trainer's do, and a training step whose checkpoint plan converts to torch_dist
says it needs megatron-core before it starts converting.

The SGLang engine cannot start here; the built-in engine, in bf16 beside an FSDP backend that
keeps fp32 weights, is a real engine with the same interface, so what the check hands it is
what it would hand SGLang.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_checks_weight_pushes_are_cast_to_the_engines_dtype(tmp_path):
    import torch

    from miles.ci.machine import device_check_sglang
    from miles.ci.machine.device_check import CheckFailed
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.train.args import parse_config
    from miles.train.consumption import build
    from miles.train.distributed import DistInfo

    path = make_tiny_checkpoint("qwen3", 2, tmp_path / "qwen3", dtype="bfloat16")
    config = parse_config(["--hf-checkpoint", str(path), "--rollout-engine", "torch", "--bf16"])
    info = DistInfo(rank=0, world_size=1, local_rank=0, device="cpu", backend="gloo")
    engine, backend = build("engine", "torch", config, info), build("backend", "fsdp", config, info)
    assert (engine.weight_dtype, next(backend.model.parameters()).dtype) == (torch.bfloat16, torch.float32)
    pushed = []
    take = engine.update_weights

    def observed(named):  # the engine's own update_weights, seeing what it is handed
        named = list(named)
        pushed.extend(t.dtype for _, t in named)
        return take(named)

    engine.update_weights = observed
    # the probe-gap bound of the step is SGLang's; the built-in engine's bf16 kernels on CPU
    # may miss it, and that verdict is not what this test reads
    with contextlib.suppress(CheckFailed):
        device_check_sglang.check_weights(engine, backend)
    assert pushed and set(pushed) == {torch.bfloat16}


def test_a_step_whose_plan_converts_to_torch_dist_needs_megatron_core_first(tmp_path):
    # megatron-core is blocked in this process only (sys.modules[...] = None: import and
    # find_spec both fail), standing in for a machine that lacks it
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "from pathlib import Path\n"
        "from miles.ci.machine.device_check import Skipped\n"
        "from miles.ci.machine.device_check_train import train_tiny_recipe\n"
        "try:\n"
        f"    train_tiny_recipe(Path({str(tmp_path)!r}), 'x', ('--num-rollout', '1'))\n"
        "except Skipped as exc:\n"
        "    print('SKIPPED', exc)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1].startswith("SKIPPED needs megatron.core, not installed")
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").rglob("*torch_dist*"))
