"""GLM-5.2 in the reference: scripts/run_glm5_2_744b_a40b.py and scripts/amd/run_glm5_2_744b_a40b.py for the
5-layer slice on one node (so mode debug_minimal), with --fp8-rollout (the option miles follows)."""

from miles.parallel import ParallelLayout
from miles.recipes.fidelity import Placement, Reference, flags
from miles.recipes.references import CHECKPOINT, DAPO, LAUNCHER_ENV, MEGATRON_MISC, OPTIMIZER, RECOMPUTE

MODEL_SCRIPT = (
    "radixark/miles scripts/models/glm5-744B-A40B.sh@600ac745 with GLM-5.2's rotary base 8000000 (its "
    "glm5.2 script is not in the stored history) and the 5-layer override of glm5-744B-A40B_5layer.sh@59118e2c"
)
MODEL = flags(
    "--spec miles_plugins.models.glm5.glm5 get_glm5_spec --moe-layer-freq [0]*3+[1]*2 --num-experts 256 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 --moe-grouped-gemm --moe-permute-fusion "
    "--moe-ffn-hidden-size 2048 --moe-router-score-function sigmoid --moe-router-pre-softmax "
    "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0 --moe-router-load-balancing-type seq_aux_loss "
    "--moe-router-topk-scaling-factor 2.5 --moe-aux-loss-coeff 0 --moe-router-dtype fp32 "
    "--make-vocab-size-divisible-by 16 --num-layers 5 --hidden-size 6144 --ffn-hidden-size 12288 "
    "--num-attention-heads 64 --disable-bias-linear --swiglu --untie-embeddings-and-output-weights "
    "--position-embedding-type rope --no-position-embedding --normalization RMSNorm --qk-layernorm "
    "--multi-latent-attention --q-lora-rank 2048 --kv-lora-rank 512 --qk-head-dim 192 --v-head-dim 256 "
    "--kv-channels 192 --qk-pos-emb-head-dim 64 --vocab-size 154880 --rotary-base 8000000 --enable-experimental"
)
COMMON = (
    *MODEL, *CHECKPOINT, *DAPO,
    *flags(
        "--rm-type deepscaler --num-rollout 3000 --rollout-batch-size 8 --n-samples-per-prompt 8 "
        "--rollout-max-response-len 100 --rollout-temperature 1 --global-batch-size 64"
    ),
    *RECOMPUTE,
    *flags("--use-dynamic-batch-size --max-tokens-per-gpu 2048 --data-pad-size-multiplier 1024 --log-probs-chunk-size 16384"),
    *flags(
        "--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --kl-coef 0.00 --entropy-coef 0.00 "
        "--eps-clip 0.2 --eps-clip-high 0.28 --use-tis --tis-clip-low 0.5 --tis-clip 2.0"
    ),
    *OPTIMIZER,
)  # fmt: skip


def _sglang(gpus: int, a2a: str, dsa_decode: str, dsa_prefill: str) -> tuple:
    return flags(
        f"--sglang-mem-fraction-static 0.70 --sglang-ep-size {gpus} --sglang-router-policy consistent_hashing "
        f"--sglang-moe-a2a-backend {a2a} --sglang-deepep-mode auto --sglang-kv-cache-dtype fp8_e4m3 "
        f"--sglang-dsa-decode-backend {dsa_decode} --sglang-dsa-prefill-backend {dsa_prefill} "
        "--sglang-attention-backend nsa --sglang-page-size 64 --sglang-cuda-graph-max-bs-decode 32 "
        f"--sglang-max-running-requests 512 --sglang-chunked-prefill-size {2048 * gpus} --sglang-watchdog-timeout 3600"
    )


def _misc(gpus: int) -> tuple:
    return (
        *MEGATRON_MISC,
        *flags(
            f"--attention-backend flash --allgather-cp --update-weight-buffer-size {2 * 1024**3} "
            f"--num-gpus-per-node {gpus} --colocate --rematerialize-param-from-master-weight"
        ),
    )


TP4 = ParallelLayout(tp=4, sp=True, ep=4, etp=1)

CUDA = Reference(
    platform="cuda",
    script="radixark/miles scripts/run_glm5_2_744b_a40b.py@044f7c8c (GLM-5.2_5layer, one H200 node, --fp8-rollout)",
    model_script=MODEL_SCRIPT,
    model="GLM-5.2-744B-A40B-5layer",
    args=(
        *COMMON, *_sglang(8, "deepep", "flashmla_kv", "flashmla_sparse"), *_misc(8),
        *flags("--moe-enable-deepep --moe-token-dispatcher-type flex"),
    ),
    env=(
        *LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "1"), ("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "256"),
        ("SGLANG_NSA_FORCE_MLA", "1"), ("INDEXER_ROPE_NEOX_STYLE", "0"), ("NVSHMEM_DISABLE_NCCL", "1"),
    ),
    layouts=(
        Placement(4, TP4, 4, "4 H200s (--num-gpus-per-node 4: the smoke test its notes size memory for)"),
        Placement(8, ParallelLayout(tp=4, sp=True, ep=8, etp=1), 8, "an H200 node"),
    ),
)  # fmt: skip

ROCM = Reference(
    platform="rocm",
    script="radixark/miles scripts/amd/run_glm5_2_744b_a40b.py@31564534 (GLM-5.2_5layer, 4 MI355X, --fp8-rollout)",
    model_script=MODEL_SCRIPT,
    model="GLM-5.2-744B-A40B-5layer",
    args=(*COMMON, *_sglang(4, "mori", "tilelang", "tilelang"), *_misc(4), *flags("--moe-token-dispatcher-type alltoall")),
    env=(*LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "0"), ("SGLANG_NSA_FORCE_MLA", "1"), ("INDEXER_ROPE_NEOX_STYLE", "0")),
    layouts=(Placement(4, TP4, 4, "4 MI355X GPUs"),),
)  # fmt: skip
