"""Inkling-Small in the reference: scripts/run_inkling.py (GB300 nodes of 4) and scripts/amd/run_inkling.py,
full-parameter GRPO on the dapo_math task, colocated, for the 4-layer slice on one node."""

from miles.parallel import ParallelLayout
from miles.recipes.fidelity import Placement, Reference, flags
from miles.recipes.references import LAUNCHER_ENV, OPTIMIZER, RECOMPUTE

MODEL_SCRIPT = "radixark/miles scripts/models/inkling-small.sh@03193ed0 (MODEL_ARGS_NUM_LAYERS=4)"
MODEL = flags(
    "--disable-bias-linear --num-layers 4 --hidden-size 4096 --ffn-hidden-size 2048 --num-attention-heads 32 "
    "--group-query-attention --num-query-groups 8 --kv-channels 128 --normalization RMSNorm --norm-epsilon 1e-6 "
    "--swiglu --untie-embeddings-and-output-weights --vocab-size 201024 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--attention-softmax-in-fp32 --position-embedding-type none --no-rope-fusion --no-masked-softmax-fusion "
    "--max-position-embeddings 1048576 --num-experts 256 --moe-ffn-hidden-size 2048 --moe-router-topk 6 "
    "--moe-shared-expert-intermediate-size 2048 --moe-router-pre-softmax --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall "
    "--moe-aux-loss-coeff 0 --moe-grouped-gemm --qk-layernorm "
    "--custom-model-provider-path miles_plugins.models.inkling.model.inkling_model_provider"
)
COMMON = (
    *MODEL,
    *flags(
        "--hf-checkpoint {hf_checkpoint} --load {ref_load} --model-name inkling --megatron-to-hf-mode raw "
        "--no-load-optim --no-load-rng --finetune"
    ),
    *flags(
        "--input-key prompt --label-key label --rollout-shuffle --rm-type math --num-rollout 100 "
        "--rollout-batch-size 32 --n-samples-per-prompt 8 --rollout-max-response-len 4096 --rollout-temperature 1 "
        "--global-batch-size 64 --balance-data --prompt-data {data_dir}/dapo-math-17k/dapo-math-17k.jsonl "
        "--apply-chat-template"
    ),
    *flags(
        "--advantage-estimator grpo --entropy-coef 0.0 --eps-clip 0.2 --eps-clip-high 0.28 --eps-clip-c 3.0 "
        "--use-tis --use-rollout-routing-replay"
    ),
    *OPTIMIZER,
    *flags(
        "--use-distributed-optimizer --no-check-for-nan-in-loss-and-grad --accumulate-allreduce-grads-in-fp32 "
        "--offload-train-target disk --offload-train-disk-dir /tmp/train_offload"
    ),
    *RECOMPUTE,
    *flags("--micro-batch-size 1"),
    *flags(
        "--sglang-mem-fraction-static 0.6 --sglang-max-running-requests 64 --sglang-max-total-tokens 327680 "
        "--sglang-moe-runner-backend triton --sglang-mamba-radix-cache-strategy extra_buffer "
        "--sglang-enable-multimodal --sglang-context-length 8192 --sglang-disable-custom-all-reduce"
    ),
    *flags(
        "--transformer-impl transformer_engine --bf16 --attention-dropout 0.0 --hidden-dropout 0.0 "
        "--attention-softmax-in-fp32 --no-bias-dropout-fusion --distributed-timeout-minutes 30 "
        "--num-gpus-per-node 4 --colocate"
    ),
)
# The nine variables both scripts hand their launcher; NCCL_NVLS_ENABLE=0 here wins over its probe.
ENV = (
    ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "1"),
    ("SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV_NORM", "false"),
    ("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1"),
    ("MILES_SGLANG_DUMMY_LOAD", "0"),
    ("SGLANG_SERVER_ENGINE_ROLLOUT_RETURN_LOGPROB", "1"),
    ("RAY_memory_monitor_refresh_ms", "0"),
    ("NCCL_MNNVL_ENABLE", "1"),
    ("NCCL_NVLS_ENABLE", "0"),
    ("NCCL_RAS_ENABLE", "0"),
)
TP4_EP4 = ParallelLayout(tp=4, sp=True, ep=4, etp=1)

CUDA = Reference(
    platform="cuda",
    script="radixark/miles scripts/run_inkling.py@067dc320 (Inkling-Small-4layer, one node, full mode)",
    model_script=MODEL_SCRIPT,
    model="Inkling-Small-4layer",
    args=(*COMMON, *flags("--sglang-attention-backend fa4")),
    env=(*LAUNCHER_ENV, *ENV),
    layouts=(Placement(4, TP4_EP4, 16, "a GB300 node of 4; the rollout engine default spans 16 GPUs"),),
)

ROCM = Reference(
    platform="rocm",
    script="radixark/miles scripts/amd/run_inkling.py@1cdca66f (Inkling-Small-4layer, one node)",
    model_script=MODEL_SCRIPT,
    model="Inkling-Small-4layer",
    args=(*COMMON, *flags("--sglang-attention-backend triton")),
    env=(*LAUNCHER_ENV, *ENV),
    layouts=(Placement(4, TP4_EP4, 4, "4 MI355X GPUs"),),
)
