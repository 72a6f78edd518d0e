"""A run of several nodes is a Ray job: a real local Ray cluster (a head and a second node on
127.0.0.1, CPU only, each with one CPU and a resource of its own: two Ray nodes on one host)
gets the qwen3_4b recipe's tiny run on two nodes, one rank each (Megatron TP=2 across them),
submitted by the recipe launcher (miles.recipes.launch.run -> miles.recipes.ray_submit ->
miles.recipes.ray_job), its log streamed and its exit code returned.

Asserted: the job placed one rank on each Ray node, exited 0, and wrote the same metrics, value
for value (timings aside), as the same recipe run on one node under torchrun.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.remote.group import free_port
from tests.support import recipes as runs

register_cpu_ci(est_time=40, suite="stage-b-cpu")


RAY = str(Path(sys.executable).with_name("ray"))
ARGS = ("--num-rollout", "3", "--rollout-max-response-len", "6", "--lr", "1e-2", "--save-interval", "100")
STARTS = 3  # the Ray agent must start within 15 s (a fixed limit of the raylet): retried on a loaded host


def _ray_processes(temp_dir: str) -> list[int]:
    """The processes of this cluster: their command lines name its temporary directory."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if temp_dir in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _stop(temp_dir: str) -> None:
    for pid in _ray_processes(temp_dir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(temp_dir: str) -> tuple[str, str]:
    """Start the head and a second node; their GCS and dashboard addresses."""
    gcs, dashboard = free_port(), free_port()
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "1", "--num-gpus", "0", "--temp-dir", temp_dir,
              "--disable-usage-stats"]  # fmt: skip
    head = [RAY, "start", "--head", "--port", str(gcs), "--dashboard-port", str(dashboard), "--dashboard-host",
            "127.0.0.1", "--resources", '{"node_a": 1}', *common]  # fmt: skip
    second = [RAY, "start", "--address", f"127.0.0.1:{gcs}", "--resources", '{"node_b": 1}', *common]
    for command in (head, second):
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command[:3])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return f"127.0.0.1:{gcs}", f"http://127.0.0.1:{dashboard}"


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    failures = []
    try:
        for _ in range(STARTS):
            try:
                _, dashboard = _start(temp_dir)
                break
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                failures.append(str(exc))
                _stop(temp_dir)
        else:
            pytest.fail(f"the local Ray cluster did not start in {STARTS} tries: {failures}")
        yield dashboard
    finally:
        _stop(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _metrics(record: Path) -> dict[str, dict[int, float]]:
    keys = {
        row.split('"metric": "')[1].split('"')[0]
        for p in record.glob("*.jsonl")
        for row in p.read_text().splitlines()
    }
    return {k: runs.series(record, k) for k in sorted(keys) if not k.startswith("perf/")}


def test_the_tiny_recipe_on_two_ray_nodes_writes_what_one_node_writes(cluster, tmp_path, capfd):
    single = runs.tiny_plan("qwen3_4b", tmp_path / "single", *ARGS)
    assert single.mode == "torchrun"
    assert runs.launch(single, tmp_path / "single-record") == 0
    capfd.readouterr()

    plan = runs.tiny_plan("qwen3_4b", tmp_path / "ray", *ARGS, nodes=2, ray_address=cluster)
    assert plan.mode == "ray" and plan.command[:3] == ("ray", "job", "submit")
    assert runs.launch(plan, tmp_path / "ray-record") == 0
    log = capfd.readouterr().out
    nodes = set(re.findall(r"node rank (\d) on Ray node (\w+)", log))
    assert {rank for rank, _ in nodes} == {"0", "1"} and len({node for _, node in nodes}) == 2, log[-3000:]

    one, two = _metrics(tmp_path / "single-record"), _metrics(tmp_path / "ray-record")
    assert one.keys() == two.keys() and "rollout/raw_reward" in one and "train/grad_norm" in one
    for key, series in one.items():
        assert sorted(two[key]) == sorted(series) == [0, 1, 2], key
        for step, value in series.items():
            assert two[key][step] == pytest.approx(value, rel=1e-6, abs=1e-9), f"{key} at rollout {step}"
