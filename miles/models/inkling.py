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
    read_by_model={
        "conv_kernel_size": "miles.megatron.inkling: the short convolutions on k, v and both branches",
        "d_rel": "miles.megatron.inkling: the relative-bias states per head",
        "rel_extent": "miles.megatron.inkling: the global layers' relative-bias extent",
        "log_scaling_n_floor": "miles.megatron.inkling: the global layers' log scaling of q and the bias",
        "log_scaling_alpha": "miles.megatron.inkling: the global layers' log scaling of q and the bias",
        "logits_mup_width_multiplier": "miles.megatron.inkling: the final norm's output is divided by it",
    },
    tiny_model_type="inkling_text",
    # Inkling-Small's switches at tiny sizes: a sliding layer then a global one, a dense first
    # layer then MoE, two shared experts, the logits' width multiplier 16, log scaling from 128000 tokens
    tiny_dims={
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 32,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 32, "sliding_window_size": 32,
        "rel_extent": 64, "d_rel": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "dense_mlp_idx": 1, "local_layer_ids": [0], "logits_mup_width_multiplier": 16.0, "log_scaling_n_floor": 128000,
    },
)  # fmt: skip
