"""GRPO on DeepSeek-V4-Flash (a 4-layer slice in CI), FP8 rollouts.

Trained by miles' Megatron backend with its own DeepSeek-V4 model (miles.families.deepseek_v4.model, mapped by
miles.families.deepseek_v4: the hybrid sliding/compressed attention with its indexer,
hyper-connections, sqrt-softplus and hash routers with megatron-core's experts, the rollout's
experts replayed (R3), clamped SwiGLU, MTP layers carried), read from config.json, from the torch_dist prepare-ckpt converts; its CPU
profile trains the tiny model at TP 2 with sequence parallelism and EP 2.
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
from miles.recipes.models import Gap, ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

_DSV4_SPEC = "the reference builds it with its own spec (miles_plugins.models.deepseek_v4, --experimental-attention-variant dsv4)"

DEEPSEEK_V4_FLASH = ModelSpec(
    "DeepSeek-V4-Flash", "deepseek_v4", "deepseek-ai/DeepSeek-V4-Flash", num_layers=43, num_attention_heads=64,
    num_experts=256,
    arch_args=(
        ("--hidden-size", 4096), ("--ffn-hidden-size", 2048), ("--normalization", "RMSNorm"), ("--norm-epsilon", 1e-6),
        ("--swiglu", True), ("--disable-bias-linear", True), ("--untie-embeddings-and-output-weights", True),
        ("--vocab-size", 129280), ("--position-embedding-type", "rope"), ("--multi-latent-attention", True),
        ("--q-lora-rank", 1024), ("--kv-lora-rank", 512), ("--qk-head-dim", 512), ("--qk-pos-emb-head-dim", 64),
        ("--v-head-dim", 512), ("--qk-layernorm", True), ("--rotary-base", 10000), ("--rotary-scaling-factor", 16),
        ("--original-max-position-embeddings", 65536), ("--beta-fast", 32), ("--beta-slow", 1),
        ("--dsa-indexer-n-heads", 64), ("--dsa-indexer-head-dim", 128), ("--dsa-indexer-topk", 512),
        ("--moe-ffn-hidden-size", 2048), ("--moe-router-topk", 6), ("--moe-shared-expert-intermediate-size", 2048),
        ("--moe-router-pre-softmax", True), ("--moe-router-load-balancing-type", "seq_aux_loss"),
        ("--moe-aux-loss-coeff", 0), ("--moe-router-topk-scaling-factor", 1.5), ("--moe-token-dispatcher-type", "alltoall"),
    ),
    kernel_args=(("--moe-grouped-gemm", True), ("--no-rope-fusion", True)),
    published=Published(
        # transformers 5.24's DeepseekV4Config defaults are deepseek-ai/DeepSeek-V4-Flash-Base's
        # config.json (its docstring's checkpoint); Flash adds YaRN scaling of the RoPE.
        "deepseek-ai/DeepSeek-V4-Flash-Base config.json as transformers 5.24's DeepseekV4Config defaults",
        (
            ("num_hidden_layers", 43), ("hidden_size", 4096), ("moe_intermediate_size", 2048),
            ("num_attention_heads", 64), ("num_key_value_heads", 1), ("head_dim", 512), ("qk_rope_head_dim", 64),
            ("q_lora_rank", 1024), ("num_experts_per_tok", 6), ("n_routed_experts", 256), ("n_shared_experts", 1),
            ("scoring_func", "sqrtsoftplus"), ("routed_scaling_factor", 1.5), ("rope_theta", 10000),
            ("compress_rope_theta", 160000), ("hc_mult", 4), ("hc_sinkhorn_iters", 20), ("swiglu_limit", 10.0),
            ("sliding_window", 128), ("o_groups", 8), ("o_lora_rank", 1024), ("index_n_heads", 64),
            ("index_head_dim", 128), ("index_topk", 512), ("num_nextn_predict_layers", 1), ("rms_norm_eps", 1e-6),
            ("vocab_size", 129280), ("tie_word_embeddings", False), ("rope_scaling_factor", 16),
        ),
        sources=(
            ("rope_scaling_factor", "radixark/miles scripts/models/deepseek-v4-flash.py@31f1ca961a94 (YaRN factor 16 over 65536)"),
        ),
    ),
    gaps=(
        Gap(
            "hybrid compressed sparse attention", "compressed and heavily compressed KV (ratios 4 and 128), a "
            "128-token sliding window, grouped low-rank output, with the DSA indexer; megatron-core 0.16.1 has only "
            f"plain MLA and DSA; {_DSV4_SPEC}",
            ("num_key_value_heads", "sliding_window", "o_groups", "o_lora_rank", "compress_rope_theta"),
        ),
        Gap("hyper-connections", f"4 residual streams mixed by Sinkhorn (20 iterations); {_DSV4_SPEC}", ("hc_mult", "hc_sinkhorn_iters")),
        Gap(
            "sqrt-softplus routing with expert bias", "megatron-core 0.16.1 routes with softmax or sigmoid, and "
            "expert bias only with sigmoid; the reference passes --moe-router-score-function sqrtsoftplus "
            "--moe-router-enable-expert-bias to its own Megatron", ("scoring_func",),
        ),
        Gap(
            "SwiGLU clamped at 10 in the experts", "megatron-core 0.16.1 clamps only quick-GELU; the reference passes "
            "--activation-func-clamp-value 10 to its own Megatron", ("swiglu_limit",),
        ),
        Gap("hash-routed first layers", f"the first 3 MoE layers route by token id; {_DSV4_SPEC}"),
    ),
    choices=(
        (
            "num_nextn_predict_layers",
            "the MTP head is not trained: the reference trains without it too and uses it only to draft in SGLang",
        ),
    ),
)  # fmt: skip


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
        grpo=(("--use-kl-loss", None), ("--use-rollout-routing-replay", True)),
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
            "its own modules (miles.families.deepseek_v4.model: hybrid attention, hyper-connections, hash and sqrt-softplus "
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
            "--num-steps-per-rollout",
            "--apply-chat-template-kwargs",
            "--global-batch-size=256",
            reason="one optimizer step per rollout is miles.train's only mode (global batch = 32 x 8); the "
            "template's thinking switch has no miles.train flag",
        ),
    ),
)
