"""GLM-5 / GLM-5.2 (glm_moe_dsa: MLA with the DSA indexer, routed and shared experts): keys, switches, tiny sizes."""

from miles.models.facts import COMMON, MOE, MTP, ROUTED_EXPERTS, Family, Fixed, Key, dense_prefix

_CLASS = "transformers' GlmMoeDsaForCausalLM"

FAMILY = Family(
    "glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    attention="dsa",
    keys=(
        *COMMON, *MOE, *ROUTED_EXPERTS, *MTP,
        # MLA expands its KV latent to one key and value per attention head. config.json's
        # head_dim is the rope part (GlmMoeDsaConfig sets it), not the value head: no row reads it.
        Key("num_key_value_heads", "--num-attention-heads", describes_model=False),
        Key("first_k_dense_replace", "--moe-layer-freq", dense_prefix),
        Key("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
        Key("q_lora_rank", "--q-lora-rank"),
        Key("kv_lora_rank", "--kv-lora-rank"),
        Key("qk_nope_head_dim", "--qk-head-dim"),
        Key("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
        Key("v_head_dim", "--v-head-dim"),
        Key("index_n_heads", "--dsa-indexer-n-heads"),
        Key("index_head_dim", "--dsa-indexer-head-dim"),
        Key("index_topk", "--dsa-indexer-topk"),
    ),
    fixed=(
        Fixed("--multi-latent-attention", True, f"{_CLASS} attends with MLA"),
        Fixed("--experimental-attention-variant", "dsa", f"{_CLASS} selects keys with the DSA indexer"),
        Fixed("--moe-router-score-function", "sigmoid", f"{_CLASS} routes by sigmoid scores"),
        Fixed("--moe-router-enable-expert-bias", True, f"{_CLASS} selects experts with e_score_correction_bias"),
        Fixed(
            "--moe-router-bias-update-rate", 0,
            f"{_CLASS} keeps e_score_correction_bias as a buffer nothing updates, and miles trains it so",
        ),
        Fixed(
            "--mtp-num-layers", 0,
            "miles carries the MTP layers (converted, handed to the rollout engine) but does not train them",
        ),
    ),
    read_by_model={
        "index_topk_freq": "miles.megatron.dsa: the indexer runs on full layers, shared layers reuse its top-k",
        "index_skip_topk_offset": "miles.megatron.dsa: which layers are full (transformers' formula)",
    },
    tiny_model_type="glm_moe_dsa",
    # GLM-5.2's switches at tiny sizes: cross-layer top-k sharing (full at layers 0, 1, 2, 6, ...:
    # four layers hold a shared one), rope theta 8e6, the indexer's interleaved rope as SGLang
    # reads it; index_topk 64 keeps the CPU lane's short sequences dense (sparse selection is
    # exercised by the parity tests). Every projection keeps a multiple of FP8's 128-row blocks.
    tiny_dims={
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 48, "v_head_dim": 16, "index_topk": 64, "index_head_dim": 32, "index_n_heads": 2,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "index_topk_freq": 4,
        "index_skip_topk_offset": 3, "rope_theta": 8_000_000, "indexer_rope_interleave": True,
    },
    mtp_style="layers",
    tiny_layers=4,
)  # fmt: skip
