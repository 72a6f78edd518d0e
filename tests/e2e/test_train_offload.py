"""--offload-train: the trainer's state off the device between phases, and back, changing nothing.

The CPU twin of radixark/miles 31f1ca961 tests/e2e/megatron/test_qwen3_4B_offload_disk.py and
test_qwen3_4B_offload_disk_stream.py (their GPU twins are tests/e2e/megatron/ here): on a tiny
Qwen3 over two gloo ranks, a run whose parameters, gradients and optimizer state leave between
training phases, to host memory or to disk (on the CPU, disk is what "off the device" means),
and whose optimizer state is also streamed through disk during each step, trains bit for bit
as the run without it, on FSDP and on Megatron (TP2). As the seed's tests do, each run's log
must show every rank's offload (and every rank's streamed steps), and the disk folder must be
empty once the run ends. A run killed while its state is on disk leaves its files behind; the
rerun (the same command: --load is its --save) wipes them, resumes from the last checkpoint and
continues bit for bit.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support.ranks import torchrun

register_cpu_ci(est_time=15, suite="stage-b-cpu")

_spec = importlib.util.spec_from_file_location("trainer_runs", Path(__file__).with_name("trainer_runs.py"))
runs = sys.modules.setdefault("trainer_runs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(runs)

ROLLOUTS = 4
RANKS = (0, 1)
# answers long enough that the rollout phase (the state on disk) lasts to be killed in
LONGER = ("--rollout-max-response-len", "16")
SAVE = ("--save-interval", "2")


def disk(directory: Path, *, stream: bool = True) -> tuple[str, ...]:
    args = (
        "--offload-train", "--offload-train-target", "disk", "--offload-train-disk-dir", str(directory),
        "--offload-train-disk-chunk-mb", "1",
    )  # fmt: skip
    return (*args, "--stream-optimizer-state-to-disk") if stream else args


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("offload")
    hf, dist = runs.tiny_qwen3(root)

    def train(*args: str, name: str, rollouts: int = ROLLOUTS) -> runs.Run:
        run = runs.train(root, hf, "--num-rollout", str(rollouts), *LONGER, *args, name=name)
        assert run.returncode == 0, run.tail()
        return run

    return root, hf, dist, train


@pytest.fixture(scope="module")
def fsdp_baseline(setup):
    return setup[3]("--train-backend", "fsdp", name="fsdp")


@pytest.fixture(scope="module")
def disk_run(setup):
    """FSDP with disk offload and streamed optimizer state, saving at rollout 2: also the kill
    test's uninterrupted run."""
    root, *_, train = setup
    folder = root / "disk-fsdp"
    run = train("--train-backend", "fsdp", *disk(folder), *SAVE, "--save", str(root / "whole"), name="disk")
    return run, folder


def offload_lines(run: runs.Run, where: str) -> dict[int, int]:
    """How many times each rank logged an offload of its state to `where`."""
    return {
        rank: run.output.count(f"miles.train: rank {rank} offloaded the trainer state to {where}")
        for rank in RANKS
    }


def streamed_steps(run: runs.Run) -> dict[int, int]:
    """How many optimizer steps each rank logged as streamed through disk."""
    return {
        rank: run.output.count(f"miles.train: rank {rank} streamed the optimizer state through disk")
        for rank in RANKS
    }


def test_host_offload_trains_bit_for_bit_as_without(setup, fsdp_baseline):
    run = setup[3]("--train-backend", "fsdp", "--offload-train", name="host")
    runs.assert_same_metrics(fsdp_baseline, run, range(ROLLOUTS))
    assert offload_lines(run, "host memory") == {r: ROLLOUTS for r in RANKS}, run.tail()


def test_disk_offload_with_streamed_optimizer_state_trains_bit_for_bit_and_cleans_up(fsdp_baseline, disk_run):
    run, folder = disk_run
    runs.assert_same_metrics(fsdp_baseline, run, range(ROLLOUTS))
    for rank in RANKS:
        assert f"rank {rank}: train offload to disk armed for {folder / f'rank{rank}'}" in run.output
    assert offload_lines(run, f"disk {folder}") == {r: ROLLOUTS for r in RANKS}
    assert streamed_steps(run) == {r: 2 * ROLLOUTS for r in RANKS}  # two optimizer steps a rollout
    assert list(folder.iterdir()) == []
    # the rollout phase's peak resident memory is recorded (benchmarks/bench_offload.py measures the drop)
    assert sorted(run.series("perf/rollout_peak_rss_mb")) == list(range(ROLLOUTS))


def test_megatron_disk_offload_with_streamed_optimizer_state_trains_bit_for_bit(setup):
    root, _, dist, train = setup
    megatron = ("--train-backend", "megatron", "--ref-load", str(dist), "--tensor-model-parallel-size", "2")
    baseline = train(*megatron, name="megatron", rollouts=2)
    folder = root / "disk-megatron"
    run = train(*megatron, *disk(folder), name="megatron-disk", rollouts=2)
    runs.assert_same_metrics(baseline, run, range(2))
    assert offload_lines(run, f"disk {folder}") == {r: 2 for r in RANKS}, run.tail()
    assert streamed_steps(run) == {r: 4 for r in RANKS}
    assert list(folder.iterdir()) == []


def _launch(root: Path, hf: Path, *args: str, record: Path) -> subprocess.Popen:
    cmd = [
        *torchrun(2), "-m", "miles.train",
        "--hf-checkpoint", str(hf), *runs.BASE_ARGS, "--actor-num-gpus-per-node", "2", *args,
    ]  # fmt: skip
    env = {**os.environ, runs.RECORD_DIR_ENV: str(record), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid`'s process group and every descendant, wherever its group: the launcher's
    workers need not share its process group, and one left running would finish the run."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in tree and child not in tree:
                tree.add(child)
                grew = True
    os.killpg(pid, signal.SIGKILL)
    for member in tree - {pid}:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_run_killed_while_its_state_is_on_disk_resumes_and_cleans_up(setup, disk_run, tmp_path):
    root, hf, _, _ = setup
    whole, _ = disk_run
    folder, ckpt = tmp_path / "offload", tmp_path / "ckpt"
    args = (
        "--num-rollout", str(ROLLOUTS), *LONGER, "--train-backend", "fsdp", *disk(folder), *SAVE,
        "--save", str(ckpt), "--load", str(ckpt),
    )  # fmt: skip
    proc = _launch(root, hf, *args, record=tmp_path / "killed")
    try:
        deadline = time.monotonic() + 600
        saved = False
        for line in proc.stdout:
            saved = saved or ("saved" in line and "iter_0000002" in line)
            if saved and "rank 0 offloaded the trainer state to disk" in line:
                _kill_tree(proc.pid)  # the whole job, as a scheduler's kill does
                break
            assert time.monotonic() < deadline, "the run never reached its third rollout"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    stale = sorted(p.name for p in (folder / "rank0" / "offload").glob("chunk_*.bin"))
    assert stale, "killed after the state came back; nothing was on disk to clean up"
    resumed = runs.train(root, hf, *args, name="resumed")
    assert resumed.returncode == 0, resumed.tail()
    assert f"resumed from {ckpt / 'iter_0000002'}" in resumed.output
    runs.assert_same_metrics(whole, resumed, range(2, ROLLOUTS))
    assert list(folder.iterdir()) == []
