"""The seed's Qwen3-4B disk-offload run (radixark/miles 31f1ca961 tests/e2e/megatron/
test_qwen3_4B_offload_disk.py and test_qwen3_4B_offload_disk_stream.py): its flags, as miles runs
them. Not a test module: the two GPU twins beside it call `run`.

Left out of the seed's command: `--skip-actor-forward-only` (miles skips the separate
old-logprob forward of a rollout's first minibatch whenever the training forward is
deterministic; the two runs set no dropout, but --ci-test asks for that forward to check against)
and the Megatron model flags the seed's launcher adds for qwen3-4B (miles builds the model from
config.json and checks any given flag against it).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("seed_twins", Path(__file__).parents[1] / "seed_twins.py")
twins = sys.modules.setdefault("seed_twins", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(twins)

NUM_GPUS = 4


def run(offload_dir: Path, *, stream: bool) -> str:
    """Train as the seed's test does; asserts what its execute() asserts; returns the output."""
    hf, dist = twins.model("Qwen/Qwen3-4B", torch_dist=True)
    data = twins.dataset("dapo-math-17k")
    shutil.rmtree(offload_dir, ignore_errors=True)
    args = [
        "--hf-checkpoint", str(hf), "--ref-load", str(dist), "--train-backend", "megatron",
        "--prompt-data", str(data / "dapo-math-17k.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "256",
        "--rollout-temperature", "0.8", "--global-batch-size", "8", "--balance-data",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "2048",
        "--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--offload-train", "--offload-train-target", "disk", "--offload-train-disk-dir", str(offload_dir),
        "--offload-train-disk-chunk-mb", "64", *(["--stream-optimizer-state-to-disk"] if stream else []),
        "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.6", "--ci-test",
        "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
        "--attention-softmax-in-fp32", "--attention-backend", "flash", "--colocate",
    ]  # fmt: skip
    proc = twins.train(args, NUM_GPUS)
    assert proc.returncode == 0, twins.tail(proc)
    out = proc.stdout + proc.stderr
    # the seed's _assert_offloaded_to_disk: every rank armed disk offload under its own directory
    for rank in range(NUM_GPUS):
        assert f"rank {rank}: train offload to disk armed for {offload_dir / f'rank{rank}'}" in out
        assert f"miles.train: rank {rank} offloaded the trainer state to disk" in out
        if stream:  # the seed's _assert_streamed: every rank logged streaming steps
            assert f"miles.train: rank {rank} streamed the optimizer state through disk" in out
    assert list(offload_dir.iterdir()) == []  # each rank's directory is removed when the run ends
    return out
