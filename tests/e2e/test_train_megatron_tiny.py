"""The Megatron backend trains Qwen3's tiny profiles on CPU and learns a task that needs the prompt.

Qwen3-4B's tiny profile trains with megatron-core at TP=2 with sequence parallelism and
Qwen3-30B-A3B's at EP=2 (ETP=1), each on two gloo ranks, by the recipe's own command (its
--ci-test checks on: first-step KL, trainer/rollout logprob agreement within 1e-3, weights after
every sync), and each learns `synthetic:echo` (tests/support/learning.py): exact match near zero
at first, well above the quarter a policy that ignores the prompt gets at the end. The FSDP
backend learns the same task from the same command. A run resumed from its mid-run checkpoint
reproduces the original's metrics to 1e-5, and a run that saves ends with every helper process
(megatron's checkpoint writer) gone. The other families learn in test_train_megatron_families.py;
the layouts' gradients are held to data parallel's in test_train_megatron_layouts.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs
from tests.support.learning import DENSE, ECHO, MOE, assert_learns_the_prompt, train
from tests.support.ranks import torchrun

register_cpu_ci(est_time=50, suite="stage-b-cpu")

# The resumed run starts from the checkpoint the dense run saves here and trains to its end: the
# last 8 rollouts are as good a proof of an exact resume as the last 20, at 12 rollouts less.
RESUME_AT = 32


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("megatron-dense")
    plan, record = train(workdir, DENSE, "--save-interval", str(RESUME_AT))
    assert "--tensor-model-parallel-size 2" in " ".join(plan.train_args)
    assert "--train-backend megatron" in " ".join(plan.train_args)
    return workdir, plan, record


def test_megatron_tp2_learns_a_task_that_needs_the_prompt(dense_run):
    _, _, record = dense_run
    assert_learns_the_prompt(record, DENSE["rollouts"])


def test_megatron_trainer_and_rollout_agree_on_every_token(dense_run):
    _, _, record = dense_run
    diffs = runs.series(record, "train/train_rollout_logprob_abs_diff")
    assert max(diffs.values()) <= 1e-5, diffs  # fp32: megatron's and HF's forwards of the same weights


def test_megatron_run_resumed_midway_reproduces_the_original(dense_run):
    workdir, _, record = dense_run
    half = RESUME_AT
    # the same run id: the same --save dir, read by --load from rollout `half` on
    _, resumed = train(
        workdir, DENSE, "--save-interval", str(half), "--ckpt-step", str(half), record_name="resumed"
    )
    for key in ("rollout/raw_reward", "rollout/exact_match", "train/grad_norm", "train/ppo_kl", "train/loss"):
        original = runs.series(record, key)
        again = runs.series(resumed, key)
        assert sorted(again) == list(range(half, DENSE["rollouts"])), key
        for step, value in again.items():
            assert value == pytest.approx(original[step], rel=1e-5, abs=1e-7), f"{key} at rollout {step}"


def test_megatron_ep2_moe_learns_a_task_that_needs_the_prompt(tmp_path):
    plan, record = train(tmp_path, MOE)
    assert "--expert-model-parallel-size 2" in " ".join(plan.train_args)
    assert_learns_the_prompt(record, MOE["rollouts"])


def test_fsdp_learns_the_same_task_from_the_same_recipe(tmp_path):
    _, record = train(tmp_path, DENSE, train_backend="fsdp")
    assert_learns_the_prompt(record, DENSE["rollouts"])


def _holders_of(pipe) -> dict[int, str]:
    """{pid: command line} of the processes that hold the write end of `pipe` (Linux /proc)."""
    wanted = f"pipe:[{os.fstat(pipe.fileno()).st_ino}]"
    holders = {}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == wanted for fd in fd_dir.iterdir()):
                pid = int(fd_dir.parent.name)
                if pid != os.getpid():
                    holders[pid] = (fd_dir.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # the process ended while being read
    return holders


def test_a_megatron_run_that_saves_ends_with_every_helper_process(tmp_path):
    # megatron's checkpoint writer starts a multiprocessing Manager; a trainer that leaves it
    # running keeps the caller's stdout/stderr pipes open, and a caller reading them waits forever
    plan = runs.tiny_plan(DENSE["recipe"], tmp_path, *ECHO, "--num-rollout", "1", "--save-interval", "1")
    cmd = [*torchrun(1), "-m", "miles.train", *plan.train_args, "--tensor-model-parallel-size", "1",
           "--actor-num-gpus-per-node", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        left = _holders_of(proc.stderr)
        for pid in left:
            os.kill(pid, 9)
        proc.communicate()
        pytest.fail(f"the run's output pipes stayed open for 180s, held by {left}")
    assert proc.returncode == 0, (out + err)[-3000:]
    assert (runs.checkpoint_dir(plan) / "latest_checkpointed_iteration.txt").exists()
