"""Qwen3-4B in the reference: scripts/run_qwen3_4b.py (8 H100s, Megatron) and its AMD twin."""

from miles.parallel import ParallelLayout
from miles.recipes.fidelity import Placement, Reference, flags
from miles.recipes.references import (
    AIME_EVAL,
    AMD_ENV,
    CHECKPOINT,
    DAPO,
    LAUNCHER_ENV,
    MEGATRON_MISC,
    OPTIMIZER,
    RECOMPUTE,
)  # fmt: skip

# radixark/miles keeps no copy of scripts/models/qwen3-4B.sh in the stored history; its content
# is the slime model script the miles one follows.
MODEL_SCRIPT = "zyzshishui/slime scripts/models/qwen3-4B.sh (the slime script radixark/miles's follows)"
MODEL = flags(
    "--swiglu --num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --use-rotary-position-embeddings --disable-bias-linear "
    "--normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 --vocab-size 151936 --kv-channels 128 "
    "--qk-layernorm"
)
GRPO = flags(
    "--advantage-estimator grpo --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 --use-kl-loss "
    "--kl-loss-coef 0.00 --kl-loss-type low_var_kl"
)

CUDA = Reference(
    platform="cuda",
    script="radixark/miles scripts/run_qwen3_4b.py@06ea7c62 (hardware H100, train_backend megatron)",
    model_script=MODEL_SCRIPT,
    model="Qwen3-4B",
    args=(
        *MODEL, *CHECKPOINT, *flags("--save-retain-interval 20"), *DAPO,
        *flags(
            "--rm-type math --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
            "--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data"
        ),
        *AIME_EVAL, *flags("--eval-top-p 1"), *GRPO, *OPTIMIZER,
        *flags("--sglang-chunked-prefill-size 4096 --sglang-mem-fraction-static 0.7"),
        *RECOMPUTE, *MEGATRON_MISC,
        *flags("--attention-backend flash --train-memory-margin-bytes 3221225472"),
        *flags("--use-dynamic-batch-size --max-tokens-per-gpu 9216"),
        *flags("--num-gpus-per-node 8 --colocate --use-fault-tolerance --dump-details {run_dir}/dump_details"),
    ),
    env=(*LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "1")),
    layouts=(Placement(8, ParallelLayout(tp=2, sp=True, cp=4, etp=1), 1, "H100"),),
)  # fmt: skip

ROCM = Reference(
    platform="rocm",
    script="radixark/miles scripts/amd/run_qwen3_4b.py@3f3e4c52 (MI350X / MI355X)",
    model_script=MODEL_SCRIPT,
    model="Qwen3-4B",
    args=(
        *MODEL, *CHECKPOINT, *DAPO,
        *flags(
            "--rm-type deepscaler --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8 "
            "--rollout-max-response-len 8192 --rollout-temperature 1 --global-batch-size 256 --balance-data"
        ),
        *AIME_EVAL, *flags("--eval-top-p 1"), *RECOMPUTE,
        *flags("--use-dynamic-batch-size --max-tokens-per-gpu 9216"), *GRPO, *OPTIMIZER,
        *flags("--sglang-mem-fraction-static 0.7"), *MEGATRON_MISC,
        *flags("--attention-backend flash --colocate --num-gpus-per-node 8"),
    ),
    env=(*LAUNCHER_ENV, *AMD_ENV),
    layouts=(Placement(8, ParallelLayout(tp=2, sp=True, etp=1), 2, "MI355X"),),
)  # fmt: skip
