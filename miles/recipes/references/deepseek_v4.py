"""DeepSeek-V4-Flash in the reference: scripts/run_deepseek_v4.py and scripts/amd/run_deepseek_v4.py for the
4-layer FP8 prune on one node (their defaults: dapo_aime task, FP8 rollout and training, R3, deterministic)."""

import json

from miles.parallel import ParallelLayout
from miles.recipes.fidelity import Placement, Reference, flags
from miles.recipes.references import LAUNCHER_ENV, OPTIMIZER, RECOMPUTE

MODEL_SCRIPT = (
    "radixark/miles scripts/models/deepseek-v4-flash.py@12cab3e3 via deepseek-v4-flash-4layer.py@57b381de"
)
MODEL = flags(
    "--disable-bias-linear --num-layers 4 --hidden-size 4096 --ffn-hidden-size 2048 --num-attention-heads 64 "
    "--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-6 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 129280 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--multi-latent-attention --q-lora-rank 1024 --kv-lora-rank 512 --qk-head-dim 512 --qk-pos-emb-head-dim 64 "
    "--v-head-dim 512 --qk-layernorm --rotary-scaling-factor 16 --rotary-base 10000 "
    "--original-max-position-embeddings 65536 --beta-fast 32 --beta-slow 1 --attention-softmax-in-fp32 "
    "--no-rope-fusion --num-experts 256 --moe-layer-freq [1]*4 --moe-ffn-hidden-size 2048 --moe-router-topk 6 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax --moe-router-score-function sqrtsoftplus "
    "--moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall "
    "--moe-aux-loss-coeff 0 --moe-grouped-gemm --moe-router-topk-scaling-factor 1.5 "
    "--experimental-attention-variant dsv4 --dsv4-hc-mult 4 --dsv4-hc-sinkhorn-iters 20 "
    "--dsv4-compress-ratios 0 0 4 128 --dsv4-compress-rope-theta 160000 --dsv4-o-groups 8 --dsv4-o-lora-rank 1024 "
    "--dsv4-n-hash-layers 3 --dsv4-window-size 128 --dsa-indexer-n-heads 64 --dsa-indexer-head-dim 128 "
    "--dsa-indexer-topk 512 --spec miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec "
    "--activation-func-clamp-value 10 --no-bias-swiglu-fusion --no-activation-func-clamp-shared-expert"
)
THINKING = json.dumps({"thinking_mode": "thinking"}, separators=(",", ":"))


def _common(rm: str, response: int) -> tuple:
    return (
        *MODEL,
        *flags(
            "--hf-checkpoint {hf_checkpoint} --ref-load {ref_load} --load {save_dir} --save {save_dir} "
            "--save-interval 20 --save-retain-interval 20"
        ),
        *flags(
            f"--label-key label --apply-chat-template --rollout-shuffle {rm} --num-rollout 3000 "
            "--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-temperature 0.8 --num-steps-per-rollout 1 "
            "--balance-data --prompt-data {data_dir}/dapo-math-17k/dapo-math-17k.jsonl --input-key prompt "
            f"--rollout-max-response-len {response} --apply-chat-template-kwargs '{THINKING}'"
        ),
        *flags(
            "--eval-interval 20 --eval-top-p 0.7 --n-samples-per-eval-prompt 8 --eval-max-response-len 4096"
        ),
        *RECOMPUTE,
        *flags("--micro-batch-size 1 --max-tokens-per-gpu 2048"),
        *flags(
            "--advantage-estimator grpo --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00 "
            "--eps-clip 0.2 --eps-clip-high 0.28"
        ),
        *OPTIMIZER,
        *flags("--optimizer-cpu-offload --use-precision-aware-optimizer --overlap-cpu-optimizer-d2h-h2d"),
        *flags(
            "--sglang-tp-size 4 --sglang-dp-size 1 --sglang-ep-size 4 --router-health-success-threshold 1 "
            "--router-health-check-interval-secs 15 --router-health-failure-threshold 40"
        ),
        *flags(
            f"--attention-dropout 0.0 --hidden-dropout 0.0 --attention-softmax-in-fp32 --update-weight-buffer-size {1024**3} "
            "--train-memory-margin-bytes 3221225472 --accumulate-allreduce-grads-in-fp32 --model-name deepseekv4 "
            "--moe-router-freeze-gate --freeze-e-score-correction-bias --rollout-health-check-interval 300 "
            "--rollout-health-check-timeout 300 --colocate --use-fault-tolerance --use-rollout-routing-replay "
            "--deterministic-mode --transformer-impl transformer_engine --bf16 --fp8-format e4m3 --fp8-recipe blockwise"
        ),
    )


DETERMINISTIC_ENV = (
    ("NCCL_ALGO", "Ring"),
    ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0"),
    ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
)


def _one_node(gpus: int, hardware: str) -> Placement:
    return Placement(gpus, ParallelLayout(tp=gpus, sp=True, ep=gpus, etp=1), 4, hardware)


CUDA = Reference(
    platform="cuda",
    script="radixark/miles scripts/run_deepseek_v4.py@010e7799 (DeepSeek-V4-Flash-FP8-4layer, one H200 node)",
    model_script=MODEL_SCRIPT,
    model="DeepSeek-V4-Flash-4layer",
    args=(
        *_common("--rm-type math", 4096),
        *flags(
            "--num-gpus-per-node 8 --sglang-mem-fraction-static 0.7 --qkv-format bshd --sglang-fp8-gemm-backend auto "
            "--sglang-moe-runner-backend auto --te-precision-config-file {dsa_indexer_bf16_config}"
        ),
    ),
    env=(
        *LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "1"), ("SGLANG_SKIP_CHECKPOINT_LOAD_CHECK", "1"),
        ("SGLANG_DSV4_FP4_EXPERTS", "0"), ("SGLANG_HEALTH_CHECK_TIMEOUT", "120"), ("SGLANG_DG_CACHE_DIR_PER_PROCESS", "1"),
        ("SGLANG_OPT_FP8_WO_A_GEMM", "0"), *DETERMINISTIC_ENV,
    ),
    layouts=(_one_node(4, "4 H200s on one node"), _one_node(8, "an H200 node")),
)  # fmt: skip

ROCM = Reference(
    platform="rocm",
    script="radixark/miles scripts/amd/run_deepseek_v4.py@01c94d04 (DeepSeek-V4-Flash-FP8-4layer, one MI355X node)",
    model_script=MODEL_SCRIPT,
    model="DeepSeek-V4-Flash-4layer",
    args=(
        *_common("--rm-type dapo --reward-key score --eval-reward-key acc", 8192),
        *flags(
            "--num-gpus-per-node 4 --sglang-context-length 16384 --sglang-mem-fraction-static 0.5 "
            "--sglang-watchdog-timeout 1800 --dsv4-impl miles --qkv-format thd --no-gradient-accumulation-fusion "
            "--train-env-vars {nvte_fp8_block_scaling_fp32_scales_0}"
        ),
    ),
    env=(
        *LAUNCHER_ENV, ("NCCL_NVLS_ENABLE", "0"), ("SGLANG_SKIP_CHECKPOINT_LOAD_CHECK", "1"),
        ("SGLANG_DSV4_FP4_EXPERTS", "0"), ("SGLANG_HACK_FLASHMLA_BACKEND", "unified_kv_triton"),
        ("SGLANG_OPT_USE_COMPRESSOR_V2", "true"), ("SGLANG_OPT_USE_TILELANG_INDEXER", "true"),
        ("SGLANG_OPT_USE_JIT_NORM", "true"), ("SGLANG_OPT_USE_FUSED_COMPRESS", "true"),
        ("SGLANG_HEALTH_CHECK_TIMEOUT", "120"), ("AITER_BF16_FP8_MOE_BOUND", "0"), *DETERMINISTIC_ENV,
    ),
    layouts=(_one_node(4, "4 MI355X GPUs"),),
)  # fmt: skip
