"""Token-budget micro-batching trains on exactly the gradients of fixed-size micro-batching.

Two gloo ranks run the trainer (its own loop, all four runs in one launch:
tests/support/trainer_cases.py) on the same samples (one rollout of prompts of
different lengths, responses cut short at random by stop tokens, two optimizer steps) with
fixed micro-batches of two samples, and with --use-dynamic-batch-size --max-tokens-per-gpu
(plus --balance-data on FSDP, which deals the samples to the ranks by token count). The
micro-batches differ (the runs record how many there were), the gradient norms must not: fp32,
relative 1e-5. FSDP runs data-parallel (the ranks agree on a micro-batch count); Megatron runs
a two-stage pipeline (its stages agree on every micro-batch's rows and shape, each padded to
its own widest row).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.metrics.records import MAX_RECORD_FILES, read_record
from tests.support.ckpt import tiny
from tests.support.trainer_cases import run_cases

register_cpu_ci(est_time=9, suite="stage-b-cpu")

STOP_TOKENS = [str(t) for t in range(100, 140)]  # ~8% of the tiny vocabulary: responses end anywhere


BACKENDS = {
    "fsdp-dp2": (("--train-backend", "fsdp"), (), ("--balance-data",)),
    "megatron-pp2": (("--train-backend", "megatron", "--pipeline-model-parallel-size", "2"), (), ()),
}
BUDGET = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "48")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, dict[str, list[float]]]:
    """The metrics of each backend's run by micro-batch size ("<backend>/fixed") and by token budget
    ("<backend>/tokens"): the same samples, all four runs in one launch of the two ranks."""
    root = tmp_path_factory.mktemp("micro-batching")
    qwen3 = tiny("qwen3", 2, torch_dist=True)
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(16):
            words = " ".join(f"code {rng.randint(0, 9999):04d}" for _ in range(rng.randint(1, 6)))
            f.write(json.dumps({"prompt": words + ":", "label": "42"}) + "\n")
    common = [
        "--hf-checkpoint", str(qwen3.hf), "--prompt-data", str(prompts), "--rm-type", "synthetic", "--num-rollout", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--rollout-max-response-len", "8", "--rollout-stop-token-ids", *STOP_TOKENS, "--lr", "1e-3",
        "--num-threads", "1", "--actor-num-gpus-per-node", "2",
    ]  # fmt: skip
    cases = {}
    for name, (backend, fixed, dynamic) in BACKENDS.items():
        if "megatron" in backend:
            backend = (*backend, "--ref-load", str(qwen3.torch_dist))
        cases[f"{name}/fixed"] = [*common, *backend, "--micro-batch-size", "2", *fixed]
        cases[f"{name}/tokens"] = [*common, *backend, *BUDGET, *dynamic]
    return {name: _metrics(folder) for name, folder in run_cases(cases, root / "records").items()}


def _metrics(record: Path) -> dict[str, list[float]]:
    out = {}
    for path in sorted(record.glob("*.jsonl"))[:MAX_RECORD_FILES]:  # read bounded, as the gate reads them
        out.update(
            {metric: [v for _, v in sorted(points.items())] for metric, points in read_record(path).items()}
        )
    return out


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_token_budget_micro_batches_give_the_fixed_size_gradients(trained, backend):
    by_size, by_tokens = trained[f"{backend}/fixed"], trained[f"{backend}/tokens"]
    assert by_tokens["rollout/raw_reward"] == by_size["rollout/raw_reward"]  # the same samples
    assert by_tokens["perf/micro_batches_per_step"] != by_size["perf/micro_batches_per_step"]
    assert by_tokens["train/grad_norm"] == pytest.approx(by_size["train/grad_norm"], rel=1e-5)
    assert by_tokens["train/loss"] == pytest.approx(by_size["train/loss"], rel=1e-5, abs=1e-8)
