"""Qwen3-30B-A3B in the reference: scripts/run_qwen3_30b_a3b.py (H100 / GB200 nodes) and its AMD twin."""

from miles.parallel import ParallelLayout
from miles.recipes.fidelity import Placement, Reference, flags
from miles.recipes.references import (
    AIME_EVAL,
    CHECKPOINT,
    DAPO,
    LAUNCHER_ENV,
    MEGATRON_MISC,
    OPTIMIZER,
    OPTIMIZER_OFFLOAD,
    RECOMPUTE,
)  # fmt: skip

MODEL_SCRIPT = "radixark/miles scripts/models/qwen3-30B-A3B.sh@122af30d"
# The script spells the layer pattern out ([1,1,...], 48 entries); it is written compactly here.
MODEL = flags(
    "--disable-bias-linear --qk-layernorm --group-query-attention --num-attention-heads 32 --num-query-groups 4 "
    "--kv-channels 128 --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --normalization RMSNorm "
    "--position-embedding-type rope --norm-epsilon 1e-6 --rotary-percent 1.0 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 151936 --rotary-base 10000000 --moe-ffn-hidden-size 768 "
    "--moe-router-score-function softmax --moe-token-dispatcher-type alltoall --moe-router-topk 8 "
    "--moe-layer-freq [1]*48 --num-experts 128 --moe-grouped-gemm --moe-token-drop-policy probs "
    "--moe-router-dtype fp32 --moe-permute-fusion --moe-aux-loss-coeff 0"
)
GRPO = flags(
    "--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
    "--eps-clip 0.2 --eps-clip-high 0.28"
)
MISC = flags(
    "--attention-backend flash --num-gpus-per-node 8 --colocate --use-fault-tolerance --dump-details {run_dir}/dump_details"
)


def _rollout(temperature: str) -> tuple:
    return (
        *DAPO,
        *flags(
            "--rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
            f"--rollout-max-response-len 8192 --rollout-temperature {temperature} --global-batch-size 256 --balance-data"
        ),
    )


CUDA = Reference(
    platform="cuda",
    script="radixark/miles scripts/run_qwen3_30b_a3b.py@024bc5f3 (H100 one node, --rollout-fp8)",
    model_script=MODEL_SCRIPT,
    model="Qwen3-30B-A3B",
    args=(
        *MODEL, *CHECKPOINT, *flags("--save-retain-interval 20"), *_rollout("0.8"), *AIME_EVAL,
        *flags("--eval-top-p 0.7"), *RECOMPUTE, *flags("--use-dynamic-batch-size --max-tokens-per-gpu 32768"),
        *GRPO, *OPTIMIZER, *OPTIMIZER_OFFLOAD,
        *flags("--sglang-mem-fraction-static 0.7 --sglang-cuda-graph-max-bs 512"), *MEGATRON_MISC, *MISC,
    ),
    env=(*LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "1")),
    layouts=(
        Placement(8, ParallelLayout(tp=4, sp=True, ep=8, etp=1), 2, "H100 (FP8 rollout: 2-GPU engines)"),
        Placement(4, ParallelLayout(tp=4, sp=True, ep=4, etp=1), 2, "GB200/GB300 node of 4 GPUs"),
    ),
)  # fmt: skip

ROCM = Reference(
    platform="rocm",
    script="radixark/miles scripts/amd/run_qwen3_30b_a3b.py@2686d667 (MI350X / MI355X, bf16 rollout)",
    model_script=MODEL_SCRIPT,
    model="Qwen3-30B-A3B",
    args=(
        *MODEL, *CHECKPOINT, *flags("--save-retain-interval 20"), *_rollout("1"), *AIME_EVAL,
        *flags("--eval-top-p 1"), *RECOMPUTE, *flags("--use-dynamic-batch-size --max-tokens-per-gpu 16384"),
        *GRPO, *OPTIMIZER, *OPTIMIZER_OFFLOAD,
        *flags("--sglang-mem-fraction-static 0.7 --sglang-max-running-requests 512"), *MEGATRON_MISC, *MISC,
    ),
    # Its launcher's NVLink probe finds none on MI350 (no nvidia-smi), so NVLS is off.
    env=(*LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "0")),
    layouts=(Placement(8, ParallelLayout(tp=1, sp=True, pp=2, cp=2, ep=4, etp=1), 2, "MI355X node"),),
)  # fmt: skip
