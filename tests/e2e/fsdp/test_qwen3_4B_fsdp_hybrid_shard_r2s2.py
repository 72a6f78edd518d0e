"""GPU twin of radixark/miles 31f1ca961 tests/e2e/fsdp/test_qwen3_4B_fsdp_hybrid_shard_r2s2.py.

Qwen3-4B on 4 GPUs with FSDP hybrid sharding, 2 replicas x 2 shards (`--train-backend fsdp
--dp-replicate-size 2`), colocated with SGLang, 3 rollouts of dapo-math-17k with --ci-test: the
seed's flags as they are. The CPU twin (tests/e2e/test_train_fsdp_hybrid.py) holds HSDP 2x2 to
FSDP and DDP within rel 1e-5. Untested on GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=600, suite="stage-c-4-gpu-h200", labels=["fsdp"])
register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["fsdp", "amd"])

_spec = importlib.util.spec_from_file_location("seed_twins", Path(__file__).parents[1] / "seed_twins.py")
twins = sys.modules.setdefault("seed_twins", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(twins)

NUM_GPUS = 4
DP_REPLICATE_SIZE = 2


def test_qwen3_4b_trains_with_fsdp_hybrid_sharding():
    hf, _ = twins.model("Qwen/Qwen3-4B")
    data = twins.dataset("dapo-math-17k")
    args = [
        "--hf-checkpoint", str(hf), "--prompt-data", str(data / "dapo-math-17k.jsonl"), "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
        "--num-rollout", "3", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "4096", "--rollout-temperature", "1", "--global-batch-size", "32",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00",
        "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--train-backend", "fsdp", "--dp-replicate-size", str(DP_REPLICATE_SIZE), "--update-weight-buffer-size",
        "536870912", "--rollout-num-gpus-per-engine", "1", "--sglang-decode-log-interval", "1000",
        "--sglang-enable-metrics", "--ci-test", "--colocate",
    ]  # fmt: skip
    proc = twins.train(args, NUM_GPUS)
    assert proc.returncode == 0, twins.tail(proc)
    assert "fsdp hybrid sharding: 2 replicas x 2 shards" in proc.stdout + proc.stderr
