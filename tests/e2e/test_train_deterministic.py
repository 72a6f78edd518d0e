"""Deterministic mode: a rerun with the same seed and layout gives bit-identical losses.

The tiny Qwen3 recipe trains three rollouts on two gloo ranks twice with --deterministic-mode
(deterministic kernels) and --debug-deterministic-collective (the training world's sums folded in a
fixed order: miles.train.deterministic), with each backend: FSDP (data parallel over both ranks)
and Megatron (TP=2 with SP). Sampling and data order are functions of the seed, so every training
and rollout metric of the rerun (loss, gradient norm, KL, entropy, rewards, logprob gaps) must
equal the first run's exactly, not approximately; only timings may differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=15, suite="stage-b-cpu")


NUM_ROLLOUT = 3
ARGS = (
    "--num-rollout", str(NUM_ROLLOUT), "--rollout-batch-size", "4", "--n-samples-per-prompt", "8",
    "--rollout-max-response-len", "6", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "1e-3",
    "--deterministic-mode", "--debug-deterministic-collective",
)  # fmt: skip


def _metrics(record: Path) -> dict[str, dict[int, float]]:
    import json

    out: dict[str, dict[int, float]] = {}
    for path in record.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if not row["metric"].startswith("perf/"):
                out[row["metric"]] = {int(s): v for s, v in row["series"]}
    return out


@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_a_rerun_is_bit_identical(tmp_path, backend):
    records = []
    for attempt in ("first", "rerun"):
        plan = runs.tiny_plan("qwen3_4b", tmp_path, *ARGS, run_id=attempt, train_backend=backend)
        record = tmp_path / f"record-{attempt}"
        assert runs.launch(plan, record) == 0
        records.append(_metrics(record))
    first, rerun = records
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "rollout/raw_reward"):
        assert sorted(first[key]) == list(range(NUM_ROLLOUT)), key
    assert first.keys() == rerun.keys()
    differing = {key: (first[key], rerun[key]) for key in first if first[key] != rerun[key]}
    print(
        f"{backend}: {len(first)} metrics over {NUM_ROLLOUT} rollouts, {len(differing)} differ; train/loss {first['train/loss']}"
    )
    assert not differing, differing
