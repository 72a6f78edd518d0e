"""Inkling (Inkling-Small; text and multimodal checkpoints): config.json keys, switches, tiny sizes."""

from miles.models.facts import COMMON, GQA, MOE, ROUTED_EXPERTS, Family, Key, dense_prefix, window

FAMILY = Family(
    "inkling",
    model_types=("inkling_text", "inkling_mm_model"),
    attention="gqa",
    keys=(
        *COMMON, *GQA, *MOE, *ROUTED_EXPERTS,
        Key("dense_mlp_idx", "--moe-layer-freq", dense_prefix),
        # its sliding-window layers' heads, the same counts as the global layers'
        Key("swa_num_attention_heads", "--num-attention-heads"),
        Key("swa_num_key_value_heads", "--num-query-groups"),
        Key("sliding_window_size", "--window-size", window),
        Key("global_layer_period", "--window-attn-skip-freq"),
    ),
    tiny_model_type="inkling_text",
    tiny_dims={
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 32,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 32, "sliding_window_size": 32,
        "rel_extent": 64, "d_rel": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    },
)  # fmt: skip
