"""GPU twin of radixark/miles 31f1ca961 tests/e2e/fsdp/test_qwen3_0.6B_megatron_fsdp_align.py.

Qwen3-0.6B on 2 GPUs, the seed's three runs: FSDP rolls out one rollout of dapo-math-17k and
saves it (`--save-debug-rollout-data`); FSDP replays it with no rollout engine
(`--load-debug-rollout-data`, `--debug-train-only`) and saves each step's gradient norm
(`--ci-save-grad-norm`); Megatron (TP1, SP, PP1, CP1) replays it and checks every step against
FSDP's (`--ci-load-grad-norm`, the seed's bound: 3%). Left out of the seed's flags:
`--attn-implementation flash_attention_2` (the FSDP backend runs transformers' SDPA attention),
`--train-env-vars` (its one variable, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, is the
runs' environment here) and `--train-memory-margin-bytes` (a torch_memory_saver margin; miles
does not use it). The CPU twin (tests/e2e/test_train_replay_alignment.py) holds Megatron to
FSDP step by step within rel 1e-4. Untested on GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=900, suite="stage-c-2-gpu-h200", labels=["fsdp"])
register_rocm_ci(est_time=800, suite="nightly-stage-c-2-gpu-mi350", labels=["fsdp"])

_spec = importlib.util.spec_from_file_location("seed_twins", Path(__file__).parents[1] / "seed_twins.py")
twins = sys.modules.setdefault("seed_twins", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(twins)

NUM_GPUS = 2
ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_megatron_replaying_fsdp_rollouts_matches_fsdp(tmp_path):
    hf, dist = twins.model("Qwen/Qwen3-0.6B", torch_dist=True)
    data = twins.dataset("dapo-math-17k")
    rollouts, grad_norm = tmp_path / "rollout_data.json", tmp_path / "grad_norm_fsdp.json"
    common = [
        "--hf-checkpoint", str(hf), "--prompt-data", str(data / "dapo-math-17k.jsonl"), "--input-key", "prompt",
        "--label-key", "label", "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler",
        "--num-rollout", "1", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "8192", "--rollout-temperature", "1", "--global-batch-size", "64",
        "--use-dynamic-batch-size", "--max-tokens-per-gpu", "8192",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "k1", "--kl-coef", "0.00",
        "--entropy-coef", "0.00", "--eps-clip", "4e-4", "--rollout-num-gpus-per-engine", "1",
        "--sglang-chunked-prefill-size", "4096", "--sglang-mem-fraction-static", "0.75", "--ci-test", "--colocate",
    ]  # fmt: skip
    fsdp = [
        "--train-backend", "fsdp", "--gradient-checkpointing", "--context-parallel-size", "1",
        "--update-weight-buffer-size", str(512 * 1024 * 1024),
    ]  # fmt: skip
    replay = ["--load-debug-rollout-data", str(rollouts), "--debug-train-only"]
    saved = twins.train([*common, *fsdp, "--save-debug-rollout-data", str(rollouts)], NUM_GPUS, env=ENV)
    assert saved.returncode == 0, twins.tail(saved)
    fsdp_replay = twins.train(
        [*common, *fsdp, *replay, "--ci-save-grad-norm", str(grad_norm)], NUM_GPUS, env=ENV
    )
    assert fsdp_replay.returncode == 0, twins.tail(fsdp_replay)
    megatron = [
        "--train-backend", "megatron", "--ref-load", str(dist), "--tensor-model-parallel-size", "1",
        "--sequence-parallel", "--pipeline-model-parallel-size", "1", "--context-parallel-size", "1",
        "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size", "1", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32",
        "--attention-backend", "flash",
    ]  # fmt: skip
    checked = twins.train(
        [*common, *megatron, *replay, "--ci-load-grad-norm", str(grad_norm)], NUM_GPUS, env=ENV
    )
    assert checked.returncode == 0, twins.tail(checked)
