"""FSDP hybrid sharding (HSDP): 2 replicas x 2 shards over 4 gloo ranks train as FSDP and DDP do.

The CPU twin of radixark/miles 31f1ca961 tests/e2e/fsdp/test_qwen3_4B_fsdp_hybrid_shard_r2s2.py
(`--train-backend fsdp --dp-replicate-size 2` on 4 GPUs; its GPU twin is
tests/e2e/fsdp/test_qwen3_4B_fsdp_hybrid_shard_r2s2.py here) and of the full-params mode of
tests/e2e/short/test_qwen3_0.6B_fsdp_colocated_2xGPU.py, on a tiny Qwen3 in float32: the same
command as FSDP over all 4 ranks, as DDP, and as HSDP 2x2 gives the same rollouts, losses and
gradient norms within rel 1e-5 (the gradients are reduced in another order). The HSDP run hands
the rollout engine its weights gathered at once (--fsdp-full-params), and its --ci-test checks
them against the trainer's bit for bit after every sync.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=15, suite="stage-b-cpu")

_spec = importlib.util.spec_from_file_location("trainer_runs", Path(__file__).with_name("trainer_runs.py"))
runs = sys.modules.setdefault("trainer_runs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(runs)

ROLLOUTS = 2
# --fsdp-full-params: the engine's weights gathered at once; --ci-test checks them bit for bit
HSDP = ("--train-backend", "fsdp", "--dp-replicate-size", "2", "--fsdp-full-params")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    hf, _ = runs.tiny_qwen3(root)

    def train(*args: str, name: str) -> runs.Run:
        run = runs.train(root, hf, "--num-rollout", str(ROLLOUTS), *args, nproc=4, name=name)
        assert run.returncode == 0, run.tail()
        return run

    return train


@pytest.fixture(scope="module")
def hsdp_run(four_ranks):
    return four_ranks(*HSDP, name="hsdp")


def test_hsdp_builds_a_two_by_two_mesh(hsdp_run):
    assert "fsdp hybrid sharding: 2 replicas x 2 shards" in hsdp_run.output
    assert "fsdp x 4 (gloo, cpu)" in hsdp_run.output


@pytest.mark.parametrize("backend", ["fsdp", "ddp"])
def test_hsdp_trains_as_fsdp_and_ddp_do(four_ranks, hsdp_run, backend):
    other = four_ranks("--train-backend", backend, name=backend)
    runs.assert_same_metrics(other, hsdp_run, range(ROLLOUTS), rel=1e-5)
