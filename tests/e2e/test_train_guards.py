"""Runs that cannot go on end with one line naming the cause, exit 1 and no traceback:
a reward too large for float32, a learning rate that makes the weights diverge, NCCL on a
machine without a GPU, a mistyped --load. The diverging run saves no non-finite checkpoint.

Each is `python -m miles.train` as a user runs it (a world of one) on a tiny Qwen3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support.ckpt import tiny_hf

register_cpu_ci(est_time=15, suite="stage-b-cpu")

SMALL = (
    "--prompt-data synthetic:fixed --num-rollout 6 --rollout-batch-size 2 --n-samples-per-prompt 4 "
    "--global-batch-size 4 --rollout-max-response-len 4 --num-threads 1"
).split()


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_hf("qwen3", 2)


def train(model: Path, *flags: str, pythonpath: str = "") -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (pythonpath, os.environ.get("PYTHONPATH")) if p),
    }
    env.pop("MILES_CI_GATE_RECORD_DIR", None)  # these runs are not the gated ones
    return subprocess.run(
        [sys.executable, "-m", "miles.train", "--hf-checkpoint", str(model), *SMALL, *flags],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip


def the_one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("miles.train:")]
    assert len(lines) == 1, done.stderr[-3000:]
    return lines[0]


def test_a_reward_of_1e39_stops_the_run_naming_the_sample_and_the_function(model, tmp_path):
    (tmp_path / "huge_reward.py").write_text("def score(response, label, metadata):\n    return 1e39\n")
    done = train(model, "--custom-rm-path", "huge_reward.score", pythonpath=str(tmp_path))
    line = the_one_line(done)
    assert line.startswith(
        "miles.train: RewardError: reward function score returned 1e+39 for prompt 0 of --prompt-data, sample 0"
    )
    assert "finite in float32" in line


def test_a_diverging_learning_rate_stops_the_run_and_saves_only_finite_weights(model, tmp_path):
    ckpt = tmp_path / "ckpt"
    # The entropy bonus gives the first step a gradient whatever the samples' rewards (when a rollout's
    # rewards are all alike the policy loss has none, and a run that never steps cannot diverge), and
    # Adam's first step of about lr per weight then overflows the logits: at lr 1e4 the weights stayed
    # finite on one 2-core machine (the policy turned uniform, the gradient zero) and the run finished
    # cleanly
    done = train(
        model, "--rm-type", "synthetic", "--lr", "1e20", "--entropy-coef", "0.1", "--ci-test", "--save", str(ckpt),
        "--load", str(ckpt), "--save-interval", "1",
    )  # fmt: skip
    line = the_one_line(done)
    assert "optimizer steps in a row, each skipped" in line or "logits are not finite" in line, line
    assert "lower --lr" in line
    saved = sorted(ckpt.glob("iter_*"))
    assert saved, "the first rollout's checkpoint should exist"
    for directory in saved:
        assert_all_finite(directory)


def assert_all_finite(directory: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = directory.with_suffix(".pt")
    dcp_to_torch_save(directory, flat)
    state = torch.load(flat, weights_only=False)
    tensors = [t for t in _leaves(state["model"]) if torch.is_tensor(t) and t.is_floating_point()]
    assert tensors and all(torch.isfinite(t).all() for t in tensors), directory


def _leaves(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value


def test_nccl_without_a_gpu_is_one_line(model):
    line = the_one_line(train(model, "--rm-type", "synthetic", "--distributed-backend", "nccl"))
    assert line.startswith("miles.train: ArgsError: --distributed-backend nccl needs a CUDA or ROCm GPU")


def test_a_mistyped_load_path_is_one_line_not_a_fresh_run(model, tmp_path):
    (tmp_path / "run").mkdir()
    done = train(
        model, "--rm-type", "synthetic", "--load", str(tmp_path / "rnu"), "--save", str(tmp_path / "run")
    )
    assert the_one_line(done).startswith(
        f"miles.train: CheckpointError: --load {tmp_path / 'rnu'}: no such directory"
    )


def test_a_load_that_is_a_model_directory_names_the_right_flag(model, tmp_path):
    done = train(model, "--rm-type", "synthetic", "--load", str(model))
    assert "not a checkpoint directory (a Hugging Face model: pass it as --hf-checkpoint)" in the_one_line(
        done
    )
