"""The weight-update group opens from inside a torchrun world: trainer rank 0 of two meets an
engine process while rank 1 waits in the trainer's own collective, and the trainer's world keeps
working after (torch's tcp:// rendezvous under torchrun would send rank 0 to the launcher's store
and wait forever; miles.train.remote.group builds the store itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cpu_ci
from miles.train.remote.fleet import engine_env
from miles.train.remote.group import free_port
from tests.support.ranks import rank_env
from tests.support.results import results

register_cpu_ci(est_time=15, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("remote_group_worker.py")


def test_rank_zero_of_a_torchrun_world_opens_the_group_with_an_engine():
    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, str(WORKER), "engine", str(port)],
        stdout=subprocess.PIPE,
        text=True,
        env={**engine_env(), "PYTHONPATH": rank_env()["PYTHONPATH"]},  # the worker imports tests.support
    )
    trainer = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
         "trainer", str(port)],
        capture_output=True, text=True, timeout=300, check=False, env=rank_env(),
    )  # fmt: skip
    out, _ = engine.communicate(timeout=60)
    assert results(subprocess.CompletedProcess(engine.args, engine.returncode, out, "")) == [
        {"engine": [0.0, 1.0, 2.0]}
    ]
    ranks = results(trainer)
    assert sorted(r["rank"] for r in ranks) == [0, 1] and {r["sum"] for r in ranks} == {2.0}


def test_an_engine_gets_no_variable_of_the_trainers_world(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MILES_ENGINE_LOG_DIR", "/tmp/x")
    env = engine_env()
    assert "TORCHELASTIC_USE_AGENT_STORE" not in env and "RANK" not in env
    assert env["MILES_ENGINE_LOG_DIR"] == "/tmp/x"
