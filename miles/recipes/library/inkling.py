"""GRPO on Inkling-Small (a 4-layer slice in CI), rolled out with SGLang.

Trained by miles' Megatron backend (miles.families.inkling: short convolutions,
relative attention bias, sliding-window and global attention with log scaling, the router
normalised over its shared experts, which replays the rollout's experts: R3) from the torch_dist
prepare-ckpt converts; its CPU profile trains the tiny model at TP 2 with sequence parallelism and EP 2.
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

INKLING_SMALL = ModelSpec(
    "Inkling-Small", "inkling", "thinkingmachines/Inkling-Small", num_layers=42, num_attention_heads=32,
    num_query_groups=8, num_experts=256, first_k_dense=2,
    arch_args=(
        ("--hidden-size", 4096), ("--ffn-hidden-size", 16384), ("--kv-channels", 128), ("--normalization", "RMSNorm"),
        ("--norm-epsilon", 1e-6), ("--swiglu", True), ("--disable-bias-linear", True),
        ("--untie-embeddings-and-output-weights", True), ("--vocab-size", 201024),
        ("--position-embedding-type", "none"), ("--max-position-embeddings", 1048576), ("--qk-layernorm", True),
        ("--window-size", "511,0"), ("--window-attn-skip-freq", 6),
        ("--moe-ffn-hidden-size", 2048), ("--moe-router-topk", 6), ("--moe-shared-expert-intermediate-size", 4096),
        ("--moe-router-pre-softmax", True), ("--moe-router-score-function", "sigmoid"),
        ("--moe-router-enable-expert-bias", True), ("--moe-router-load-balancing-type", "seq_aux_loss"),
        ("--moe-aux-loss-coeff", 0), ("--moe-token-dispatcher-type", "alltoall"),
    ),
    kernel_args=(("--moe-grouped-gemm", True), ("--no-rope-fusion", True), ("--no-masked-softmax-fusion", True)),
    published=Published(
        # The release's config.json, as read field by field in a public Inkling-Small
        # conversion project's notes ("Inkling-Small support"); the 42-layer figure is also
        # the reference's scripts/models/inkling-small.sh.
        "huggingface.co/thinkingmachines/Inkling-Small config.json (fields tabulated from the release)",
        (
            ("num_hidden_layers", 42), ("hidden_size", 4096), ("intermediate_size", 16384),
            ("num_attention_heads", 32), ("num_key_value_heads", 8), ("swa_num_attention_heads", 32),
            ("swa_num_key_value_heads", 8), ("head_dim", 128), ("vocab_size", 201024),
            ("max_position_embeddings", 1048576), ("dense_mlp_idx", 2), ("n_routed_experts", 256),
            ("num_experts_per_tok", 6), ("n_shared_experts", 2), ("moe_intermediate_size", 2048),
            ("sliding_window_size", 512), ("global_layer_period", 6), ("d_rel", 16), ("rel_extent", 1024),
            ("conv_kernel_size", 4), ("logits_mup_width_multiplier", 16), ("log_scaling_n_floor", 128000),
            ("log_scaling_alpha", 0.1),
        ),
        sources=(("global_layer_period", "derived from the release's global attention layers 5, 11, ..., 41"),),
    ),
)  # fmt: skip


MODEL = "Inkling-Small-4layer"
# TP4 with sequence parallel and all experts spread over the 4 GPUs (ETP1): both references.
TP4_EP4 = ParallelLayout(tp=4, sp=True, ep=4, etp=1)
# The GPU form's dimensions on the CPU lane's two ranks: tensor (with sequence) and expert parallel.
CPU_TP2_EP2 = ParallelLayout(tp=2, sp=True, ep=2, etp=1)

ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: SGLang's triton attention (the AMD reference); Inkling's processor needs numba",
    args=groups(rollout_engine=(("--sglang-attention-backend", "triton"),)),
    profiles=(
        gpu_profile(
            "rocm", 1, 4, MODEL, TP4_EP4, rollout_gpus_per_engine=4,
            suite="stage-c-4-gpu-mi350", source="the layout the AMD reference script runs on 4 MI355X GPUs",
        ),
    ),
    pins=(("numba", "0.65.1"),),
)  # fmt: skip

RECIPE = Recipe(
    name="inkling",
    description="GRPO on Inkling-Small with the Megatron backend and SGLang rollouts",
    model=INKLING_SMALL,
    models=(MODEL,),
    defined_in=source_file(__name__),
    args=d.args_with(
        rollout=(
            ("--rm-type", "math"),
            ("--num-rollout", 100),
            ("--rollout-max-response-len", 4096),
            ("--global-batch-size", 64),
        ),
        grpo=(
            ("--use-kl-loss", None),
            ("--kl-loss-coef", None),
            ("--kl-loss-type", None),
            ("--eps-clip-c", 3.0),
            ("--use-tis", True),
            ("--use-rollout-routing-replay", True),
        ),
        optimizer=(("--use-distributed-optimizer", True),),
        rollout_engine=(
            ("--sglang-mem-fraction-static", 0.6),
            ("--sglang-max-running-requests", 64),
            ("--sglang-max-total-tokens", 327680),
            ("--sglang-moe-runner-backend", "triton"),
            ("--sglang-mamba-radix-cache-strategy", "extra_buffer"),
            ("--sglang-enable-multimodal", True),
            ("--sglang-context-length", 8192),
            ("--sglang-disable-custom-all-reduce", True),
        ),
        perf=(
            ("--use-dynamic-batch-size", None),
            ("--max-tokens-per-gpu", None),
            ("--micro-batch-size", 1),
            ("--transformer-impl", "transformer_engine"),
            ("--no-bias-dropout-fusion", True),
        ),
    ),
    env=(
        *d.ENV,
        ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "1"),
        ("SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV_NORM", "false"),
        ("SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK", "1"),
        ("MILES_SGLANG_DUMMY_LOAD", "0"),
        ("SGLANG_SERVER_ENGINE_ROLLOUT_RETURN_LOGPROB", "1"),
        ("RAY_memory_monitor_refresh_ms", "0"),
        ("NCCL_MNNVL_ENABLE", "1"),
        ("NCCL_NVLS_ENABLE", "0"),
        ("NCCL_RAS_ENABLE", "0"),
    ),
    profiles=(
        gpu_profile("cuda", 1, 4, MODEL, TP4_EP4, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200"),
        d.cpu_tiny_profile(CPU_TP2_EP2, "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("inkling"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--load={output_dir}/{run_id}/checkpoints",
            "--ref-load={model_dir}/Inkling-Small-4layer_torch_dist",
            "--save={output_dir}/{run_id}/checkpoints",
            "--save-interval=20",
            "--finetune",
            "--no-load-optim",
            "--no-load-rng",
            reason="miles.train starts from the weights at --ref-load and resumes from its own --save (the CI test "
            "checks checkpoints are written); the reference loads the torch_dist as --load with --finetune and "
            "saves only when given a directory",
        ),
        deviation(
            "--model-name",
            reason="selects the reference's Megatron-to-HF weight mapping; miles maps Inkling's weights by its "
            "config.json's model type (miles.families.inkling)",
        ),
        deviation(
            "--custom-model-provider-path",
            "--ffn-hidden-size=16384",
            "--moe-shared-expert-intermediate-size=4096",
            "--moe-layer-freq=[0,0,1,1]",
            "--window-size=511,0",
            "--window-attn-skip-freq=6",
            reason="the reference builds Inkling with its own provider from the checkpoint's config; so does miles "
            "(miles.families.inkling.layers, read from config.json), and it passes config.json's shape in megatron-core's "
            "terms, which its backend checks against config.json (dense width 16384 in layers 0-1, 2 shared experts "
            "of 2048, a 512-token window with a global layer every 6th; see `facts inkling`). The window is 511,0 in "
            "megatron-core's LEFT,RIGHT terms, whose LEFT counts the keys before the query's own",
        ),
        deviation(
            "--megatron-to-hf-mode",
            reason="the reference's raw weight conversion for the rollout engine; miles.train's Megatron backend "
            "converts the trained weights back to the checkpoint's names itself (miles.megatron.export), its only "
            "mode, so the recipe leaves the flag at its default",
        ),
        deviation(
            "--offload-train-target",
            "--offload-train-disk-dir",
            "--no-check-for-nan-in-loss-and-grad",
            "--distributed-timeout-minutes",
            reason="the reference's memory and fault handling for the full 276B model (training state spilled to "
            "NVMe, NaN checks off, 30-minute collectives); miles.train has no such options",
        ),
        deviation(
            "--sglang-attention-backend",
            reason="fa4 kernels need Blackwell (the reference runs GB300); on H200 SGLang picks its own",
            platforms=("cuda",),
        ),
        deviation(
            "env:MODEL_ARGS_NUM_LAYERS",
            reason="the reference hands the 4-layer depth to its model script through the environment (its Ray "
            "workers inherit it); miles passes --num-layers 4",
        ),
    ),
)
