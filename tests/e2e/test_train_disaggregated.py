"""Training and rollout on devices of their own, on the CPU: the recipes' tiny profiles with
`--rollout-num-gpus 2` (no --colocate), so two built-in engine processes sample while two
trainer ranks (torchrun, gloo) train, and every weight sync reaches the engines by the
transfer mode under test. The runs keep --ci-test on: after every sync each engine's checksum
of every tensor's bytes must equal the trainer's (miles.train.checks.check_weight_checksums), or
the run stops with exit 1; the rollout/trainer logprob check holds the engines to the same.

The CPU twins of the seed's tests/e2e/megatron/test_qwen3_30B_A3B/test_disagg_broadcast.py
(Qwen3-30B-A3B's tiny MoE, Megatron EP=2, `--update-weight-transfer-mode broadcast`) and
tests/e2e/megatron/test_qwen3_4B_disk_delta.py (Qwen3-4B's tiny, Megatron TP=2 with SP,
`disk-delta`); the full-version disk mode runs on the FSDP rendering of the same recipe.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=25, suite="stage-b-cpu")


ROLLOUTS = 3
SHORT = ("--num-rollout", str(ROLLOUTS), "--rollout-max-response-len", "6", "--lr", "1e-2")
PLACEMENT = ("--rollout-engine", "torch", "--rollout-num-gpus", "2")


def _train(workdir: Path, recipe: str, *extra: str, train_backend: str | None = None) -> Path:
    plan = runs.tiny_plan(recipe, workdir, *SHORT, *PLACEMENT, *extra, train_backend=train_backend)
    assert "--ci-test" in plan.train_args and "--colocate" not in plan.train_args
    record = workdir / "record"
    assert runs.launch(plan, record) == 0, f"{recipe} {' '.join(extra)} failed (its output is above)"
    return record


def _every_rollout_agrees(record: Path) -> None:
    diff = runs.series(record, "train/train_rollout_logprob_abs_diff")
    assert sorted(diff) == list(range(ROLLOUTS))
    assert max(diff.values()) < 1e-4, diff  # the engines sample with the trainer's weights
    assert sorted(runs.series(record, "perf/weight_sync_time")) == list(range(ROLLOUTS))


def test_broadcast_moe_megatron_ep2_engines_hold_the_trainers_weights(tmp_path):
    record = _train(tmp_path, "qwen3_30b_a3b", "--update-weight-transfer-mode", "broadcast")
    _every_rollout_agrees(record)


def test_disk_delta_megatron_tp2_engines_hold_the_trainers_weights(tmp_path):
    published, local = tmp_path / "delta-updates", tmp_path / "delta-local-ckpt"
    record = _train(
        tmp_path,
        "qwen3_4b",
        "--update-weight-transfer-mode", "disk-delta",
        "--update-weight-disk-dir", str(published),
        "--update-weight-local-checkpoint-dir", str(local),
    )  # fmt: skip
    _every_rollout_agrees(record)
    # the first sync seeded the host's copy (version 0, full); each later one was a delta on it
    newest = json.loads((published / f"v{ROLLOUTS:08d}" / "manifest.json").read_text())
    assert (newest["kind"], newest["base"], newest["encoding"]) == ("delta", ROLLOUTS - 1, "xor")
    held = json.loads((local / "manifest.json").read_text())
    assert (held["kind"], held["version"]) == ("full", ROLLOUTS)
    assert set(newest["tensors"]) <= set(held["tensors"])


def test_full_disk_versions_fsdp_engines_hold_the_trainers_weights(tmp_path):
    published = tmp_path / "updates"
    record = _train(
        tmp_path,
        "qwen3_4b",
        "--update-weight-transfer-mode", "disk", "--update-weight-disk-dir", str(published),
        train_backend="fsdp",
    )  # fmt: skip
    _every_rollout_agrees(record)
    newest = json.loads((published / f"v{ROLLOUTS:08d}" / "manifest.json").read_text())
    assert newest["kind"] == "full" and newest["version"] == ROLLOUTS
