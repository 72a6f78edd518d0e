"""The five recipe models: Megatron flags, published config.json values, megatron-core gaps.

The flags are what megatron-core can build; every config.json value is typed in once with its
source, and `python -m miles.recipes facts NAME` checks the flags against it. What a model
needs beyond the pinned megatron-core is a `Gap` naming how the reference recipe
(radixark/miles) gets it: its own model providers and specs, which miles does not carry.
"""

from __future__ import annotations

from miles.recipes.args import Args
from miles.recipes.models import Gap, ModelSpec, Published

_QWEN3: Args = (
    ("--normalization", "RMSNorm"),
    ("--norm-epsilon", 1e-6),
    ("--swiglu", True),
    ("--disable-bias-linear", True),
    ("--qk-layernorm", True),
    ("--position-embedding-type", "rope"),
    ("--rotary-base", 1000000),
    ("--vocab-size", 151936),
    ("--kv-channels", 128),
)

QWEN3_4B = ModelSpec(
    "Qwen3-4B", "qwen3", "Qwen/Qwen3-4B", num_layers=36, num_attention_heads=32, num_query_groups=8,
    arch_args=(*_QWEN3, ("--hidden-size", 2560), ("--ffn-hidden-size", 9728)),
    published=Published(
        "huggingface.co/Qwen/Qwen3-4B/blob/main/config.json",
        (
            ("num_hidden_layers", 36), ("hidden_size", 2560), ("intermediate_size", 9728),
            ("num_attention_heads", 32), ("num_key_value_heads", 8), ("head_dim", 128),
            ("rms_norm_eps", 1e-6), ("rope_theta", 1000000), ("vocab_size", 151936),
            ("tie_word_embeddings", True), ("attention_bias", False), ("hidden_act", "silu"),
            ("max_position_embeddings", 40960),
        ),
    ),
)  # fmt: skip

QWEN3_30B_A3B = ModelSpec(
    "Qwen3-30B-A3B", "qwen3_moe", "Qwen/Qwen3-30B-A3B", num_layers=48, num_attention_heads=32,
    num_query_groups=4, num_experts=128,
    arch_args=(
        *_QWEN3, ("--rotary-percent", 1.0), ("--hidden-size", 2048), ("--ffn-hidden-size", 6144),
        ("--untie-embeddings-and-output-weights", True), ("--moe-ffn-hidden-size", 768), ("--moe-router-topk", 8),
        ("--moe-token-dispatcher-type", "alltoall"), ("--moe-router-score-function", "softmax"),
        ("--moe-router-dtype", "fp32"), ("--moe-aux-loss-coeff", 0),
    ),
    kernel_args=(("--moe-grouped-gemm", True), ("--moe-permute-fusion", True)),
    published=Published(
        "huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json",
        (
            ("num_hidden_layers", 48), ("hidden_size", 2048), ("intermediate_size", 6144),
            ("num_attention_heads", 32), ("num_key_value_heads", 4), ("head_dim", 128),
            ("rms_norm_eps", 1e-6), ("rope_theta", 1000000), ("vocab_size", 151936),
            ("tie_word_embeddings", False), ("attention_bias", False), ("hidden_act", "silu"),
            ("num_experts", 128), ("num_experts_per_tok", 8), ("moe_intermediate_size", 768),
            ("decoder_sparse_step", 1), ("mlp_only_layers", ()), ("norm_topk_prob", True),
            ("router_aux_loss_coef", 0.001), ("max_position_embeddings", 40960),
        ),
    ),
    choices=(
        (
            "router_aux_loss_coef",
            "RL fine-tuning keeps the checkpoint's routing: no load-balancing loss, as in the reference",
        ),
    ),
)  # fmt: skip

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
            "the MTP layer is carried (converted, handed to SGLang for speculative decoding), not trained: "
            "transformers' model has no MTP forward to hold it to",
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
