"""The seed's Qwen3-0.6B GSM8K runs with FSDP (radixark/miles 31f1ca961
tests/e2e/fsdp/test_qwen3_0.6B_fsdp_distributed.py and tests/e2e/short/
test_qwen3_0.6B_fsdp_colocated_2xGPU.py): their flags, as miles runs them. Not a test module.

Both learn GSM8K for 60-odd rollouts and require eval/gsm8k >= 0.71 at the end. Left out of the
seed's commands, until miles has them: `--over-sampling-batch-size 64` with
`--dynamic-sampling-filter-path ...check_reward_nonzero_std` (dynamic sampling), the seed's
asynchronous trainer (train_async.py) and its separate rollout GPUs (`--rollout-num-gpus`): the
distributed run here trains and rolls out on all 4 GPUs, colocated; `--eval-top-k 1` is
`--eval-temperature 0` here (greedy).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("seed_twins", Path(__file__).parents[1] / "seed_twins.py")
twins = sys.modules.setdefault("seed_twins", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(twins)


def run(gpus: int, rollouts: int, *extra: str) -> subprocess.CompletedProcess:
    hf, _ = twins.model("Qwen/Qwen3-0.6B")
    data = twins.dataset("gsm8k")
    args = [
        "--hf-checkpoint", str(hf), "--prompt-data", str(data / "train.parquet"), "--input-key", "messages",
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "math",
        "--num-rollout", str(rollouts), "--rollout-batch-size", "32", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "1024", "--rollout-temperature", "1", "--global-batch-size", "256",
        "--eval-interval", "20", "--eval-prompt-data", "gsm8k", str(data / "test.parquet"),
        "--n-samples-per-eval-prompt", "1", "--eval-max-response-len", "1024", "--eval-temperature", "0",
        "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl", "--kl-coef", "0.00",
        "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98", "--sglang-enable-metrics",
        "--ci-test", "--ci-disable-kl-checker", "--ci-metric-checker-key", "eval/gsm8k",
        "--ci-metric-checker-threshold", "0.71", "--train-backend", "fsdp", "--colocate", *extra,
    ]  # fmt: skip
    proc = twins.train(args, gpus, timeout=4 * 3600)
    assert proc.returncode == 0, twins.tail(proc)
    return proc
