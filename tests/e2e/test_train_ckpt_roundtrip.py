"""Save at rollout k, load, continue: the continued run's metrics equal the uninterrupted run's.

The CPU twin of radixark/miles 31f1ca961 tests/e2e/ckpt/test_qwen3_4B_ckpt.py (its GPU twin is
tests/e2e/ckpt/test_qwen3_4B_ckpt.py here), on a tiny Qwen3 over two gloo ranks. Each run saves
with --ci-save-model-hash (a SHA-256 of every weight beside the checkpoint, by Hugging Face name,
so the same at any layout and on either backend) and each resume checks the loaded weights
against it with --ci-check-model-hash, as the seed's save/load pair does.

- FSDP resumed at the same layout continues bit for bit, and weights that are not the saved ones
  fail the hash check.
- Megatron saved at TP2 with --dist-ckpt-optim-fully-reshardable (megatron-core's
  fully_reshardable optimizer format) resumes at TP1 x DP2 within rel 1e-4 (the gradient sums
  run in another order; measured 3e-6). A checkpoint in the default dp_reshardable format asked to
  resume at another layout is refused in one line (tests/unit/test_train_offload.py holds it).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=15, suite="stage-b-cpu")

_spec = importlib.util.spec_from_file_location("trainer_runs", Path(__file__).with_name("trainer_runs.py"))
runs = sys.modules.setdefault("trainer_runs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(runs)

ROLLOUTS, SAVED_AT = 4, 2
CONTINUED = range(SAVED_AT, ROLLOUTS)
SAVE = ("--num-rollout", str(ROLLOUTS), "--save-interval", str(SAVED_AT), "--ci-save-model-hash")
MEGATRON = ("--train-backend", "megatron")
TP2 = ("--tensor-model-parallel-size", "2", "--sequence-parallel")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return runs.tiny_qwen3(tmp_path_factory.mktemp("qwen3"))


def _resume(tmp_path: Path, hf: Path, ckpt: Path, *args: str, name: str = "resumed") -> runs.Run:
    return runs.train(
        tmp_path, hf, "--num-rollout", str(ROLLOUTS), "--load", str(ckpt), "--ckpt-step", str(SAVED_AT),
        "--ci-check-model-hash", *args, name=name,
    )  # fmt: skip


@pytest.fixture(scope="module")
def fsdp_run(qwen3, tmp_path_factory):
    hf, _ = qwen3
    workdir = tmp_path_factory.mktemp("fsdp")
    ckpt = workdir / "ckpt"
    run = runs.train(workdir, hf, *SAVE, "--save", str(ckpt), "--train-backend", "fsdp")
    assert run.returncode == 0, run.tail()
    return run, ckpt


def test_fsdp_save_load_continue_equals_the_uninterrupted_run(qwen3, fsdp_run, tmp_path):
    hf, _ = qwen3
    original, ckpt = fsdp_run
    hashes = json.loads((ckpt / f"iter_{SAVED_AT:07d}" / "model_hash.json").read_text())
    assert "model.embed_tokens.weight" in hashes and len(hashes) > 10
    resumed = _resume(tmp_path, hf, ckpt, "--train-backend", "fsdp")
    assert resumed.returncode == 0, resumed.tail()
    assert "the loaded weights hash as" in resumed.output
    assert sorted(resumed.series("train/grad_norm")) == list(CONTINUED)
    runs.assert_same_metrics(original, resumed, CONTINUED)


def test_weights_that_are_not_the_saved_ones_fail_the_hash_check(qwen3, fsdp_run, tmp_path):
    hf, _ = qwen3
    _, ckpt = fsdp_run
    copy = tmp_path / "ckpt"
    import shutil

    shutil.copytree(ckpt, copy)
    hashes_file = copy / f"iter_{SAVED_AT:07d}" / "model_hash.json"
    hashes = json.loads(hashes_file.read_text())
    hashes["model.norm.weight"] = "0" * 64
    hashes_file.write_text(json.dumps(hashes))
    resumed = _resume(tmp_path, hf, copy, "--train-backend", "fsdp", "--num-rollout", str(SAVED_AT + 1))
    assert resumed.returncode != 0
    assert "CheckFailed: --ci-check-model-hash: the weights loaded from" in resumed.output
    assert "1 changed: ['model.norm.weight']" in resumed.output


def test_megatron_resumes_at_another_tensor_parallel_size_from_a_fully_reshardable_checkpoint(
    qwen3, tmp_path
):
    hf, dist = qwen3
    ckpt = tmp_path / "ckpt"
    original = runs.train(
        tmp_path, hf, *SAVE, *MEGATRON, "--ref-load", str(dist), *TP2, "--save", str(ckpt),
        "--dist-ckpt-optim-fully-reshardable", name="tp2",
    )  # fmt: skip
    assert original.returncode == 0, original.tail()
    # the same two ranks as TP1 x DP2: every tensor-parallel shard of weights and optimizer state resharded
    resumed = _resume(tmp_path, hf, ckpt, *MEGATRON, "--ref-load", str(dist), name="tp1")
    assert resumed.returncode == 0, resumed.tail()
    assert "tp1·pp1·cp1·ep1·etp1" in resumed.output and "the loaded weights hash as" in resumed.output
    runs.assert_same_metrics(original, resumed, CONTINUED, rel=1e-4)
