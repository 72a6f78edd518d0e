"""GPU twin of radixark/miles 31f1ca961 tests/e2e/megatron/test_mimo_7B_mtp_only_grad.py.

MiMo-7B-RL on 4 GPUs, Megatron TP2+SP, one MTP layer trained (--enable-mtp-training
--mtp-num-layers 1 --mtp-loss-scaling-factor 0.2) with EAGLE speculative rollouts in SGLang; the
seed checks that only MTP parameters receive gradient. miles trains MTP layers alone with
--mtp-only-training (every other weight frozen, so weight decay cannot move it either), which
this twin adds. miles.families.mimo builds it: MiMo-7B-RL's trunk is Qwen2's (loaded as
transformers' Qwen2ForCausalLM, its config.json's remote code never run), its model.mtp_layers.0.*
carried as megatron-core's MTP block (input_proj's halves swapped into eh_proj), converted by
seed_twins.model through the family its config.json names. The behaviour is held on CPU by
tests/e2e/test_train_mtp_speculative.py (MiMo's tiny: the trunk bit-identical after MTP-only
steps, the MTP layer moved, the built-in engine's drafts accepted) and the layer's math by
tests/megatron/test_megatron_mimo.py. Untested on GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(
    est_time=400,
    suite="stage-c-4-gpu-h200",
    labels=["megatron"],
)
register_rocm_ci(
    est_time=420,
    suite="nightly-stage-c-4-gpu-mi350",
    labels=["megatron"],
)

_spec = importlib.util.spec_from_file_location("seed_twins", Path(__file__).parents[1] / "seed_twins.py")
twins = sys.modules.setdefault("seed_twins", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(twins)

NUM_GPUS = 4


def _args(hf, dist, data) -> list[str]:
    return [
        "--hf-checkpoint", str(hf), "--ref-load", str(dist), "--train-backend", "megatron",
        "--prompt-data", str(data / "dapo-math-17k.jsonl"), "--input-key", "prompt", "--label-key", "label",
        "--apply-chat-template", "--rollout-shuffle", "--rm-type", "deepscaler", "--num-rollout", "1",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "128",
        "--rollout-temperature", "0.8", "--global-batch-size", "8",
        "--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "1", "--recompute-granularity", "full", "--recompute-method", "uniform",
        "--recompute-num-layers", "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096",
        "--advantage-estimator", "grpo", "--kl-loss-coef", "0.00", "--kl-loss-type", "low_var_kl",
        "--kl-coef", "0.00", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
        "--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
        "--adam-beta1", "0.9", "--adam-beta2", "0.98",
        "--rollout-num-gpus-per-engine", "1", "--sglang-mem-fraction-static", "0.7", "--sglang-enable-metrics",
        "--sglang-speculative-algorithm", "EAGLE", "--sglang-speculative-num-steps", "2",
        "--sglang-speculative-eagle-topk", "1", "--sglang-speculative-num-draft-tokens", "3",
        "--mtp-num-layers", "1", "--enable-mtp-training", "--mtp-loss-scaling-factor", "0.2", "--mtp-only-training",
        "--ci-test", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--accumulate-allreduce-grads-in-fp32", "--attention-softmax-in-fp32", "--attention-backend", "flash",
        "--colocate", "--rollout-engine", "sglang",
    ]  # fmt: skip


def test_mimo_mtp_only_training_moves_the_mtp_layer_alone(tmp_path):
    hf, dist = twins.model("XiaomiMiMo/MiMo-7B-RL", torch_dist=True)
    data = twins.dataset("dapo-math-17k")
    proc = twins.train(_args(hf, dist, data), NUM_GPUS)
    assert proc.returncode == 0, twins.tail(proc)
