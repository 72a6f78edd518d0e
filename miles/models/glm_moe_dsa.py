"""GLM-5 / GLM-5.2 (glm_moe_dsa: MLA with the DSA indexer, routed and shared experts): keys, switches, tiny sizes."""

from miles.models.facts import COMMON, MLA, MOE, MTP, ROUTED_EXPERTS, Family, Key, dense_prefix

FAMILY = Family(
    "glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    attention="dsa",
    keys=(
        *COMMON, *MLA, *MOE, *ROUTED_EXPERTS, *MTP,
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
    tiny_model_type="glm_moe_dsa",
    tiny_dims={
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 48, "v_head_dim": 16, "index_topk": 64, "index_head_dim": 32, "index_n_heads": 2,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
    },
    mtp_style="layers",
)  # fmt: skip
