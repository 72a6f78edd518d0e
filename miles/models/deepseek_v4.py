"""DeepSeek-V4 (DeepSeek-V4-Flash): config.json keys, switches, tiny sizes."""

from miles.models.facts import COMMON, MLA, MOE, MTP, ROUTED_EXPERTS, Family, Key, window

FAMILY = Family(
    "deepseek_v4",
    model_types=("deepseek_v4",),
    attention="dsa",
    keys=(
        *COMMON, *MLA, *MOE, *ROUTED_EXPERTS, *MTP,
        Key("scoring_func", "--moe-router-score-function", default="softmax"),
        Key("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
        Key("q_lora_rank", "--q-lora-rank"),
        Key("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
        Key("index_n_heads", "--dsa-indexer-n-heads"),
        Key("index_head_dim", "--dsa-indexer-head-dim"),
        Key("index_topk", "--dsa-indexer-topk"),
        Key("sliding_window", "--window-size", window),
        Key("rope_scaling_factor", "--rotary-scaling-factor"),
    ),
    tiny_model_type="deepseek_v4",
    tiny_dims={
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "moe_intermediate_size": 64, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 2,
        "index_head_dim": 32, "index_topk": 16, "hc_mult": 2, "sliding_window": 32, "num_nextn_predict_layers": 1,
    },
    sdpa=False,
    mtp_style="mtp",
)  # fmt: skip
