"""Token-budget micro-batching trains on exactly the gradients of fixed-size micro-batching.

Two gloo ranks run `python -m miles.train` on the same samples (one rollout of prompts of
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
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.metrics.capture import RECORD_DIR_ENV, decode_value

register_cpu_ci(est_time=70, suite="stage-b-cpu")

STOP_TOKENS = [str(t) for t in range(100, 140)]  # ~8% of the tiny vocabulary: responses end anywhere


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    root = tmp_path_factory.mktemp("micro-batching")
    hf = make_tiny_checkpoint("qwen3", 2, root / "hf")
    dist = root / "torch_dist"
    dist.mkdir()
    convert_to_torch_dist(hf, dist, "qwen3")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(16):
            words = " ".join(f"code {rng.randint(0, 9999):04d}" for _ in range(rng.randint(1, 6)))
            f.write(json.dumps({"prompt": words + ":", "label": "42"}) + "\n")
    return hf, dist, prompts


def _train(tmp_path: Path, setup, *args: str) -> dict[str, list[float]]:
    hf, _, prompts = setup
    record = tmp_path / "record"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "miles.train",
        "--hf-checkpoint", str(hf), "--prompt-data", str(prompts), "--rm-type", "synthetic", "--num-rollout", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--rollout-max-response-len", "8", "--rollout-stop-token-ids", *STOP_TOKENS, "--lr", "1e-3",
        "--num-threads", "1", "--actor-num-gpus-per-node", "2", *args,
    ]  # fmt: skip
    env = {**os.environ, RECORD_DIR_ENV: str(record), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    out = {}
    for path in record.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            out[row["metric"]] = [decode_value(v) for _, v in row["series"]]
    return out


@pytest.mark.parametrize(
    ("backend", "fixed", "dynamic"),
    [
        (("--train-backend", "fsdp"), (), ("--balance-data",)),
        (("--train-backend", "megatron", "--pipeline-model-parallel-size", "2"), (), ()),
    ],
    ids=["fsdp-dp2", "megatron-pp2"],
)
def test_token_budget_micro_batches_give_the_fixed_size_gradients(tmp_path, setup, backend, fixed, dynamic):
    if "megatron" in backend:
        backend = (*backend, "--ref-load", str(setup[1]))
    budget = ("--use-dynamic-batch-size", "--max-tokens-per-gpu", "48")
    by_size = _train(tmp_path / "fixed", setup, *backend, "--micro-batch-size", "2", *fixed)
    by_tokens = _train(tmp_path / "tokens", setup, *backend, *budget, *dynamic)
    assert by_tokens["rollout/raw_reward"] == by_size["rollout/raw_reward"]  # the same samples
    assert by_tokens["perf/micro_batches_per_step"] != by_size["perf/micro_batches_per_step"]
    assert by_tokens["train/grad_norm"] == pytest.approx(by_size["train/grad_norm"], rel=1e-5)
    assert by_tokens["train/loss"] == pytest.approx(by_size["train/loss"], rel=1e-5, abs=1e-8)
