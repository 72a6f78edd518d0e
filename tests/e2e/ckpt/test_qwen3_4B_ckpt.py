"""GPU twin of radixark/miles 31f1ca961 tests/e2e/ckpt/test_qwen3_4B_ckpt.py.

Qwen3-4B on 8 GPUs, Megatron TP2+SP, PP2, CP2, colocated with SGLang: a run saves every 2
rollouts with a hash of every weight beside each checkpoint (`--ci-save-model-hash`), then a run
loads the latest checkpoint (`--load --ckpt-step`) and checks the loaded weights against the
hashes (`--ci-check-model-hash`) before it continues. The seed repeats the pair with
`--async-save --use-persistent-ckpt-worker` and loads with `--low-memory-resume`; miles saves
synchronously and has neither, so the pair runs once. The CPU twin
(tests/e2e/test_train_ckpt_roundtrip.py) holds the continued run to the uninterrupted one, on
both backends and across a layout change. Untested on GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=1400, suite="stage-c-8-gpu-h100", labels=["ckpt"])
register_rocm_ci(est_time=1200, suite="nightly-stage-c-8-gpu-mi350", labels=["ckpt"])

_spec = importlib.util.spec_from_file_location("seed_twins", Path(__file__).parents[1] / "seed_twins.py")
twins = sys.modules.setdefault("seed_twins", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(twins)

NUM_GPUS = 8


def _args(hf, dist, data) -> list[str]:
    return [
        "--hf-checkpoint", str(hf), "--ref-load", str(dist), "--train-backend", "megatron",
        "--prompt-data", str(data / "dapo-math-17k.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "3",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "1024",
        "--rollout-temperature", "0.8", "--global-batch-size", "8", "--balance-data",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
        "--context-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "16384",
        "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "k1", "--kl-coef", "0.00",
        "--entropy-coef", "0.00", "--eps-clip", "0.2",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.7", "--sglang-cuda-graph-bs",
        "1", "2", "4", "8", "16", "--ci-test", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash",
        "--colocate",
    ]  # fmt: skip


def test_qwen3_4b_saves_loads_and_the_loaded_weights_hash_as_saved(tmp_path):
    hf, dist = twins.model("Qwen/Qwen3-4B", torch_dist=True)
    data = twins.dataset("dapo-math-17k")
    ckpt = tmp_path / "Qwen3-4B_miles"
    saved = twins.train(
        [*_args(hf, dist, data), "--save", str(ckpt), "--save-interval", "2", "--ci-save-model-hash"],
        NUM_GPUS,
    )
    assert saved.returncode == 0, twins.tail(saved)
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text().strip())
    loaded = twins.train(
        [*_args(hf, dist, data), "--load", str(ckpt), "--ckpt-step", str(latest), "--ci-check-model-hash"],
        NUM_GPUS,
    )
    assert loaded.returncode == 0, twins.tail(loaded)
    assert "the loaded weights hash as" in loaded.stdout + loaded.stderr
