"""Fetch through the Hugging Face cache without network, and the command lines operators type."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.errors import CheckpointError
from miles.ckpt.hub import Source, resolve_hub
from miles.ckpt.shards import read_weight_map
from miles.ckpt.tiny import make_tiny_checkpoint

register_cpu_ci(est_time=6, suite="stage-b-cpu")

ROOT = Path(__file__).resolve().parents[2]
REPO = "acme/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(hf_home: Path, checkpoint: Path, skip=()) -> Path:
    """Lay `checkpoint` out as huggingface_hub's cache does: blobs by sha256, snapshot links, refs."""
    repo = hf_home / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for path in sorted(checkpoint.iterdir()):
        if path.name.startswith(".") or path.name in skip:
            continue
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def _deep_shards(checkpoint: Path, keep: int) -> set[str]:
    """Shards that hold only layers >= keep (a sliced fetch never needs them)."""
    weight_map = read_weight_map(checkpoint).weight_map
    needed = {s for n, s in weight_map.items() if not any(f".layers.{i}." in n for i in range(keep, 99))}
    return set(weight_map.values()) - needed


@pytest.fixture(scope="module")
def deep_checkpoint(tmp_path_factory) -> Path:
    # small shards so that the deep layers sit in shards of their own
    return make_tiny_checkpoint("qwen3", 6, tmp_path_factory.mktemp("deep") / "qwen3-6", shard_bytes=200_000)


def test_sliced_fetch_from_an_offline_cache_needs_only_the_kept_layers_shards(tmp_path, deep_checkpoint):
    deep = _deep_shards(deep_checkpoint, 4)
    assert deep, "the fixture must have shards holding only deep layers"
    snapshot = _hub_cache(tmp_path / "hf", deep_checkpoint, skip=deep)
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_CACHE", None)
    argv = [
        sys.executable, "-m", "miles.ckpt", "prepare", "--family", "qwen3", "--source", REPO,
        "--model", "Qwen3-tiny-4layer", "--model-dir", str(tmp_path / "models"),
        "--plan-steps", "fetch,validate,trim", "--quiet",
    ]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "trim        ran" in done.stdout and str(snapshot) in done.stdout
    hf = tmp_path / "models" / "Qwen3-tiny-4layer"
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] == 4
    assert not any(".layers.4." in n or ".layers.5." in n for n in read_weight_map(hf).weight_map)


def test_offline_fetch_of_a_missing_shard_says_what_to_do(tmp_path, deep_checkpoint, monkeypatch):
    from huggingface_hub import constants

    needed = sorted(
        set(read_weight_map(deep_checkpoint).weight_map.values()) - _deep_shards(deep_checkpoint, 4)
    )
    _hub_cache(tmp_path / "hf", deep_checkpoint, skip={needed[0]})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # where HF_HOME points
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="HF_HUB_OFFLINE is set and the Hugging Face cache .* lacks"):
        resolve_hub(Source("hub", REPO), keep_layers=4)
    assert resolve_hub(Source("hub", REPO), keep_layers=4, download=False) == (None, False)


def test_invoke_prepare_ckpt_takes_the_plan_from_the_recipe(tmp_path):
    argv = [
        sys.executable, "-m", "invoke", "-r", str(ROOT), "prepare-ckpt", "--recipe", "qwen3_30b_a3b",
        "--model", "Qwen3-30B-A3B-4layer", "--platform", "cuda", "--model-dir", str(tmp_path), "--dry",
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "Qwen3-30B-A3B-4layer (qwen3_moe, source Qwen/Qwen3-30B-A3B)"
    assert [line.split()[0] for line in lines[1:]] == ["fetch", "validate", "trim", "fp8", "torch_dist"]
    assert not any(tmp_path.iterdir())


def test_cli_usage_errors_exit_2_with_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "miles.ckpt", "prepare", "--model", "X", "--family", "qwen3", "--source", "tiny:qwen3"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "MILES_MODEL_DIR": ""}, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: prepare needs --model-dir (or $MILES_MODEL_DIR) (a recipe's model: python -m miles.recipes prepare)"
    )
