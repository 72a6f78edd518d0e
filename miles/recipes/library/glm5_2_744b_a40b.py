"""GRPO on GLM-5.2-744B-A40B (a 5-layer slice in CI): MLA with DSA sparse attention, FP8 rollouts.

Trained by miles' Megatron backend (miles.families.glm_moe_dsa: MLA, GLM's DSA indexer with
its cross-layer top-k sharing, sigmoid-routed MoE with a shared expert, MTP layers carried) from
the torch_dist prepare-ckpt converts; its CPU profile trains the tiny model at TP 2 with sequence
parallelism and EP 2.
"""

from miles.parallel import ParallelLayout
from miles.recipes import defaults as d
from miles.recipes import references
from miles.recipes.fidelity import deviation
from miles.recipes.models import ModelSpec, Published
from miles.recipes.recipe import Overlay, Recipe, gpu_profile, groups, source_file

GLM5_2_744B_A40B = ModelSpec(
    "GLM-5.2-744B-A40B", "glm_moe_dsa", "zai-org/GLM-5.2", num_layers=78, num_attention_heads=64,
    num_experts=256, first_k_dense=3,
    arch_args=(
        ("--hidden-size", 6144), ("--ffn-hidden-size", 12288), ("--normalization", "RMSNorm"), ("--swiglu", True), ("--disable-bias-linear", True), ("--untie-embeddings-and-output-weights", True),
        ("--vocab-size", 154880), ("--make-vocab-size-divisible-by", 16), ("--position-embedding-type", "rope"),
        ("--no-position-embedding", True), ("--rotary-base", 8000000), ("--qk-layernorm", True),
        ("--multi-latent-attention", True), ("--q-lora-rank", 2048), ("--kv-lora-rank", 512), ("--qk-head-dim", 192),
        ("--qk-pos-emb-head-dim", 64), ("--v-head-dim", 256), ("--kv-channels", 192),
        ("--experimental-attention-variant", "dsa"), ("--dsa-indexer-n-heads", 32), ("--dsa-indexer-head-dim", 128),
        ("--dsa-indexer-topk", 2048), ("--moe-ffn-hidden-size", 2048), ("--moe-shared-expert-intermediate-size", 2048),
        ("--moe-router-topk", 8), ("--moe-router-score-function", "sigmoid"), ("--moe-router-pre-softmax", True),
        ("--moe-router-enable-expert-bias", True), ("--moe-router-bias-update-rate", 0),
        ("--moe-router-load-balancing-type", "seq_aux_loss"), ("--moe-router-topk-scaling-factor", 2.5),
        ("--moe-aux-loss-coeff", 0), ("--moe-router-dtype", "fp32"), ("--moe-token-dispatcher-type", "alltoall"),
    ),
    kernel_args=(("--moe-grouped-gemm", True), ("--moe-permute-fusion", True)),
    published=Published(
        # transformers 5.24's GlmMoeDsaConfig defaults are zai-org/GLM-5's config.json (its
        # docstring's checkpoint); GLM-5.2 keeps that architecture and changes the RoPE base.
        "zai-org/GLM-5 config.json as transformers 5.24's GlmMoeDsaConfig defaults (GLM-5.2 keeps the architecture)",
        (
            ("num_hidden_layers", 78), ("hidden_size", 6144), ("intermediate_size", 12288),
            ("moe_intermediate_size", 2048), ("num_attention_heads", 64), ("num_key_value_heads", 64),
            ("n_routed_experts", 256), ("n_shared_experts", 1), ("num_experts_per_tok", 8),
            ("routed_scaling_factor", 2.5), ("first_k_dense_replace", 3), ("q_lora_rank", 2048),
            ("kv_lora_rank", 512), ("qk_nope_head_dim", 192), ("qk_rope_head_dim", 64), ("v_head_dim", 256),
            ("rms_norm_eps", 1e-5), ("vocab_size", 154880), ("tie_word_embeddings", False),
            ("index_n_heads", 32), ("index_head_dim", 128), ("index_topk", 2048), ("rope_theta", 8000000),
            ("index_topk_freq", 4), ("index_skip_topk_offset", 3), ("num_nextn_predict_layers", 1),
        ),
        sources=(
            ("rope_theta", "radixark/miles scripts/models/glm5.2-744B-A40B.py@31f1ca961a94 (--rotary-base 8000000)"),
            (
                "index_topk_freq", "radixark/miles scripts/run_glm5_2_744b_a40b.py@31f1ca961a94 notes "
                "(index_topk_freq=4, index_skip_topk_offset=3: indexers on layers 1, 2, 3, 7, 11, ..., 75)",
            ),
            (
                "index_skip_topk_offset", "radixark/miles scripts/run_glm5_2_744b_a40b.py@31f1ca961a94 notes "
                "(index_topk_freq=4, index_skip_topk_offset=3: indexers on layers 1, 2, 3, 7, 11, ..., 75)",
            ),
        ),
    ),
    choices=(
        (
            "num_nextn_predict_layers",
            "the MTP layer is carried (converted, handed to SGLang for speculative decoding), not trained: the "
            "reference trains without it too (no --enable-mtp-training), which would train it as megatron-core's "
            "MTP block",
        ),
    ),
    known_differences=(
        (
            "q/kv latent norm eps",
            "transformers' GlmMoeDsaRMSNorm and so miles' trainer normalise the q and kv latents with eps 1e-6; "
            "SGLang 0.5.23 uses rms_norm_eps 1e-5 (models/deepseek_v2.py:2077, 2163): trainer and rollout logits "
            "differ by about 1e-4 in float32, below bf16's rounding",
        ),
    ),
)  # fmt: skip


MODEL = "GLM-5.2-744B-A40B-5layer"
# DSA attention cannot use context parallel on megatron-core 0.16.1; 5 layers keep PP at 1.
FOUR_GPUS = ParallelLayout(tp=4, sp=True, ep=4, etp=1)
EIGHT_GPUS = ParallelLayout(tp=4, sp=True, ep=8, etp=1)
# The 4-GPU form's dimensions on the CPU lane's two ranks: tensor (with sequence) and expert parallel.
CPU_TP2_EP2 = ParallelLayout(tp=2, sp=True, ep=2, etp=1)


def _prefill(gpus: int) -> tuple:
    # The reference sizes a prefill chunk at 2048 tokens per GPU of the engine.
    return (("--sglang-chunked-prefill-size", 2048 * gpus),)


ROCM = Overlay(
    platform="rocm",
    reason="MI350 runners: FP8 MoE all-to-all through mori instead of DeepEP, tilelang DSA kernels (the AMD reference)",
    args=groups(
        rollout_engine=(
            ("--sglang-moe-a2a-backend", "mori"),
            ("--sglang-dsa-decode-backend", "tilelang"),
            ("--sglang-dsa-prefill-backend", "tilelang"),
        )
    ),
    env=(("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", None), ("NVSHMEM_DISABLE_NCCL", None)),
    profiles=(
        gpu_profile(
            "rocm", 1, 4, MODEL, FOUR_GPUS, rollout_gpus_per_engine=4, suite="stage-c-4-gpu-mi350",
            rollout_engine=_prefill(4),
        ),
    ),
)  # fmt: skip

RECIPE = Recipe(
    name="glm5_2_744b_a40b",
    description="GRPO on GLM-5.2-744B-A40B with FP8 rollouts, the Megatron backend and SGLang",
    model=GLM5_2_744B_A40B,
    models=(MODEL,),
    defined_in=source_file(__name__),
    fp8_rollout=True,
    args=d.args_with(
        rollout=(
            ("--rollout-batch-size", 8),
            ("--rollout-max-response-len", 100),  # the reference's single-node (debug_minimal) length
            ("--global-batch-size", 64),
            ("--balance-data", None),
        ),
        grpo=(
            ("--use-kl-loss", None),
            ("--kl-coef", 0),
            ("--use-tis", True),
            ("--tis-clip-low", 0.5),
            ("--tis-clip", 2.0),
        ),
        rollout_engine=(
            # 0.70 leaves room for the weight checker's snapshot; higher turns the trimmed
            # model's spare memory into KV cache.
            ("--sglang-mem-fraction-static", 0.7),
            ("--sglang-ep-size", "{rollout_gpus_per_engine}"),
            ("--sglang-moe-a2a-backend", "deepep"),
            ("--sglang-deepep-mode", "auto"),
            ("--sglang-kv-cache-dtype", "fp8_e4m3"),
            ("--sglang-dsa-decode-backend", "flashmla_kv"),
            ("--sglang-dsa-prefill-backend", "flashmla_sparse"),
            ("--sglang-attention-backend", "nsa"),
            ("--sglang-page-size", 64),
            ("--sglang-cuda-graph-max-bs-decode", 32),
            ("--sglang-max-running-requests", 512),
            ("--sglang-watchdog-timeout", 3600),
        ),
        perf=(
            ("--max-tokens-per-gpu", 2048),
            ("--attention-backend", "flash"),
            ("--update-weight-buffer-size", 2 * 1024**3),
        ),
    ),
    env=(
        *d.ENV,
        ("SGLANG_DEEPEP_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "256"),
        ("SGLANG_NSA_FORCE_MLA", "1"),
        ("INDEXER_ROPE_NEOX_STYLE", "0"),
        ("NVSHMEM_DISABLE_NCCL", "1"),
    ),
    profiles=(
        gpu_profile(
            "cuda",
            1,
            4,
            MODEL,
            FOUR_GPUS,
            rollout_gpus_per_engine=4,
            suite="stage-c-4-gpu-h200",
            rollout_engine=_prefill(4),
        ),
        gpu_profile(
            "cuda",
            1,
            8,
            MODEL,
            EIGHT_GPUS,
            rollout_gpus_per_engine=8,
            suite="stage-c-8-gpu-h200",
            rollout_engine=_prefill(8),
        ),
        d.cpu_tiny_profile(CPU_TP2_EP2, "megatron"),
    ),
    overlays=(ROCM,),
    references=references.load("glm5_2_744b_a40b"),
    deviations=(
        *d.COMMON_DEVIATIONS,
        deviation(
            "--spec",
            "--enable-experimental",
            "--experimental-attention-variant=dsa",
            "--dsa-indexer-head-dim=128",
            "--dsa-indexer-n-heads=32",
            "--dsa-indexer-topk=2048",
            reason="the reference builds GLM-5.2's DSA with its own spec (miles_plugins.models.glm5); miles builds it "
            "with its own modules (miles.families.glm_moe_dsa.dsa: GLM's indexer and its cross-layer top-k sharing, read from "
            "config.json) and states the attention and the indexer's shape in megatron-core's flags, which its "
            "backend checks against config.json",
        ),
        deviation(
            "--moe-enable-deepep",
            "--moe-token-dispatcher-type=alltoall",
            reason="megatron-core's DeepEP (flex) dispatcher needs the deep_ep kernels; miles dispatches all-to-all, "
            "as the reference does without DeepEP (its AMD script)",
            platforms=("cuda",),
        ),
        deviation(
            "--hf-checkpoint={model_dir}/GLM-5.2-744B-A40B-5layer_fp8",
            "--ref-load={model_dir}/GLM-5.2-744B-A40B-5layer_torch_dist",
            reason="miles names prepared checkpoints after the recipe's model (GLM-5.2-744B-A40B-5layer_fp8 and "
            "_torch_dist, trimmed and converted by prepare-ckpt); the reference downloads a 5-layer prune named "
            "GLM-5.2_5layer",
        ),
        deviation(
            "--sglang-router-policy",
            reason="a policy of the reference's own router in front of its engines (miles/ray/rollout/router_manager.py "
            "there), not an SGLang server argument; miles.train sends requests to its engines without a router, and "
            "each profile runs one engine, so there is no choice to route",
        ),
        deviation(
            "--allgather-cp",
            reason="the reference's switch for DSA's all-gather context parallel; miles states it as "
            "--cp-comm-type all_gather on a layout with cp > 1 (none here)",
        ),
        deviation(
            "--rematerialize-param-from-master-weight",
            "--data-pad-size-multiplier",
            "--log-probs-chunk-size",
            reason="memory knobs of the reference's trainer (weights rebuilt from fp32 masters, padded and chunked "
            "log-prob passes); miles.train has no such options",
        ),
    ),
)
