"""GRPO on DeepSeek-V4-Flash (a 4-layer slice in CI), FP8 rollouts.

Trained by miles' Megatron backend with its own DeepSeek-V4 model (miles.megatron.dsv4, mapped by
miles.megatron.families.deepseek_v4: the hybrid sliding/compressed attention with its indexer,
hyper-connections, sqrt-softplus and hash routers with megatron-core's experts, clamped SwiGLU,
MTP layers carried), read from config.json, from the torch_dist prepare-ckpt converts; its CPU
profile trains the tiny model at TP 2 with sequence parallelism and EP 2.
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file
from miles.recipes.specs import DEEPSEEK_V4_FLASH

MODEL = "DeepSeek-V4-Flash-4layer"
FOUR_GPUS = ParallelLayout(tp=4, sp=True, ep=4, etp=1)
EIGHT_GPUS = ParallelLayout(tp=8, sp=True, ep=8, etp=1)
# The 4-GPU form's dimensions on the CPU lane's two ranks: tensor (with sequence) and expert parallel.
CPU_TP2_EP2 = ParallelLayout(tp=2, sp=True, ep=2, etp=1)

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: the AMD reference (8k responses, FlashMLA/tilelang kernel switches, half the memory "
    "for the engine)",
    args=groups(
        rollout=(("--rollout-max-response-len", 8192),),
        rollout_engine=(
            ("--sglang-fp8-gemm-runner-backend", None),
            ("--sglang-moe-runner-backend", None),
            ("--sglang-mem-fraction-static", 0.5),
            ("--sglang-watchdog-timeout", 1800),
        ),
        # as the reference: ROCm's TE has no fused weight-gradient accumulation (and neither image
        # carries Apex's), so the fusion stays off whatever is installed
        misc=(("--no-gradient-accumulation-fusion", True),),
    ),
    env=(
        ("SGLANG_DG_CACHE_DIR_PER_PROCESS", None),
        ("SGLANG_OPT_FP8_WO_A_GEMM", None),
        ("SGLANG_HACK_FLASHMLA_BACKEND", "unified_kv_triton"),
        ("SGLANG_OPT_USE_COMPRESSOR_V2", "true"),
        ("SGLANG_OPT_USE_TILELANG_INDEXER", "true"),
        ("SGLANG_OPT_USE_JIT_NORM", "true"),
        ("SGLANG_OPT_USE_FUSED_COMPRESS", "true"),
        ("AITER_BF16_FP8_MOE_BOUND", "0"),
    ),
    profiles=(
        gpu_profile("rocm", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-mi350"),
    ),
    deviations=(
        deviation(
            "--train-env-vars",
            reason="a switch of the reference's ROCm FP8 training, which miles.train does not do",
        ),
    ),
)

RECIPE = Recipe(
    name="deepseek_v4",
    description="GRPO on DeepSeek-V4-Flash with FP8 SGLang rollouts",
    model=DEEPSEEK_V4_FLASH,
    models=(MODEL,),
    defined_in=source_file(__name__),
    fp8_rollout=True,
    args=d.args_with(
        rollout=(("--rm-type", "math"), ("--rollout-max-response-len", 4096), ("--rollout-temperature", 0.8)),
        grpo=(("--use-kl-loss", None),),
        optimizer=(
            ("--optimizer-cpu-offload", True),
            ("--use-precision-aware-optimizer", True),
            ("--overlap-cpu-optimizer-d2h-h2d", True),
        ),
        rollout_engine=(
            ("--sglang-fp8-gemm-runner-backend", "auto"),
            ("--sglang-moe-runner-backend", "auto"),
            ("--sglang-tp-size", "{rollout_gpus_per_engine}"),
            ("--sglang-dp-size", 1),
            ("--sglang-ep-size", "{rollout_gpus_per_engine}"),
        ),
        perf=(
            ("--use-dynamic-batch-size", None),
            ("--micro-batch-size", 1),
            ("--max-tokens-per-gpu", 2048),
            ("--update-weight-buffer-size", 1024**3),
            ("--transformer-impl", "transformer_engine"),
        ),
    ),
    env=(
        *d.ENV,
        ("SGLANG_SKIP_CHECKPOINT_LOAD_CHECK", "1"),
        ("SGLANG_DSV4_FP4_EXPERTS", "0"),
        ("SGLANG_HEALTH_CHECK_TIMEOUT", "120"),
        ("SGLANG_DG_CACHE_DIR_PER_PROCESS", "1"),
        ("SGLANG_OPT_FP8_WO_A_GEMM", "0"),
        ("NCCL_ALGO", "Ring"),
        ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0"),
        ("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),
    ),
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200"),
        gpu_profile("cuda", 1, 8, MODEL, EIGHT_GPUS, rollout_gpus_per_engine=4, suite="stage-c-8-gpu-h200"),
        d.cpu_tiny_profile(CPU_TP2_EP2, "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("deepseek_v4"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--hf-checkpoint={model_dir}/DeepSeek-V4-Flash-4layer_fp8",
            "--ref-load={model_dir}/DeepSeek-V4-Flash-4layer_torch_dist",
            reason="miles trims DeepSeek-V4-Flash to 4 layers and converts it to FP8 and torch_dist itself "
            "(prepare-ckpt: DeepSeek-V4-Flash-4layer_fp8 and _torch_dist); the reference downloads an FP8 4-layer "
            "prune (DeepSeek-V4-Flash-FP8-4layer)",
        ),
        deviation(
            "--experimental-attention-variant",
            "--dsv4-*",
            "--spec",
            "--activation-func-clamp-value",
            "--no-bias-swiglu-fusion",
            "--moe-router-score-function",
            "--moe-router-enable-expert-bias",
            reason="the reference builds V4 with its own spec (miles_plugins.models.deepseek_v4); miles builds it with "
            "its own modules (miles.megatron.dsv4: hybrid attention, hyper-connections, hash and sqrt-softplus "
            "routers, clamped SwiGLU), every one of these values read from config.json, which megatron-core 0.16.1 "
            "has no flags for",
        ),
        deviation(
            "--no-activation-func-clamp-shared-expert",
            reason="the reference leaves the shared expert's SwiGLU unclamped; transformers' DeepSeek-V4 clamps it "
            "(swiglu_limit), and miles computes what transformers computes, so its shared expert is clamped",
        ),
        deviation(
            "--fp8-format",
            "--fp8-recipe",
            "--te-precision-config-file",
            "--deterministic-mode",
            reason="blockwise FP8 training and Megatron's deterministic mode are the reference's V4 defaults; "
            "miles.train trains in bf16 and has no deterministic switch (the determinism variables are kept)",
        ),
        deviation(
            "--model-name",
            "--qkv-format",
            "--moe-router-freeze-gate",
            "--freeze-e-score-correction-bias",
            reason="the reference's weight bridge and its frozen V4 router (gate and correction bias); miles.train "
            "has no such switches",
        ),
        deviation(
            "--use-rollout-routing-replay",
            reason="miles.train has no rollout routing replay (R3) yet: the flag would be accepted and ignored",
        ),
        deviation(
            "--num-steps-per-rollout",
            "--apply-chat-template-kwargs",
            "--global-batch-size=256",
            reason="one optimizer step per rollout is miles.train's only mode (global batch = 32 x 8); the "
            "template's thinking switch has no miles.train flag",
        ),
    ),
)
