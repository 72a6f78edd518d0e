"""Megatron's overlap and recomputation flags act, and change nothing but how the step runs.

Two gloo ranks (data parallel) build the Megatron backend from trainer commands that differ
only in `--overlap-grad-reduce --overlap-param-gather`, full recomputation, or selective
recomputation, and take three steps on one batch. megatron-core must have the settings
(DDP's overlap, the TransformerConfig's recompute fields), the work must show it (a full
recompute reruns each layer's forward in the backward, a selective one the core attention's),
and every run must export the same weights as the plain one: with overlapped parameter
gathering the model's parameters are one step old right after a step, and the backend gathers
them before the export.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import tiny

register_cpu_ci(est_time=9, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("flags_worker.py")
CASES = {
    "plain": [],
    "overlap": ["--overlap-grad-reduce", "--overlap-param-gather"],
    "full recompute": [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ],
    "selective recompute": ["--recompute-granularity", "selective"],
}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    qwen3 = tiny("qwen3", 2, torch_dist=True)
    return ranks.case_results(WORKER, CASES, str(qwen3.hf), str(qwen3.torch_dist), preload=ranks.MEGATRON_PRELOAD)


def test_overlapped_reduce_and_gather_are_megatrons_and_export_the_plain_runs_weights(runs):
    plain, overlap = runs["plain"], runs["overlap"]
    assert overlap["overlap_grad_reduce"] and overlap["overlap_param_gather"]
    assert not plain["overlap_grad_reduce"]
    assert overlap["grad_norm"] == pytest.approx(plain["grad_norm"], abs=1e-6)
    assert overlap["exported"] == pytest.approx(plain["exported"], abs=1e-6)
    # right after a step the overlapped run's parameters are stale; the export gathered them
    assert abs(overlap["params_after_step"] - plain["params_after_step"]) > 1e-3
    assert overlap["params_after_export"] == pytest.approx(plain["params_after_export"], abs=1e-6)


def test_full_recompute_reruns_each_layer_in_the_backward_and_changes_nothing_else(runs):
    plain, full = runs["plain"], runs["full recompute"]
    assert full["recompute"] == ["full", "uniform", 1] and plain["recompute"] == [None, None, None]
    assert plain["layer_forwards_per_step"] == plain["micro_batches"]
    assert full["layer_forwards_per_step"] == 2 * full["micro_batches"]
    assert full["grad_norm"] == pytest.approx(plain["grad_norm"], abs=1e-6)
    assert full["exported"] == pytest.approx(plain["exported"], abs=1e-6)


def test_selective_recompute_reruns_the_core_attention_and_changes_nothing_else(runs):
    plain, selective = runs["plain"], runs["selective recompute"]
    assert selective["recompute"] == ["selective", None, None]
    assert plain["attention_forwards_per_step"] == plain["micro_batches"]
    assert selective["attention_forwards_per_step"] == 2 * selective["micro_batches"]
    assert selective["exported"] == pytest.approx(plain["exported"], abs=1e-6)
