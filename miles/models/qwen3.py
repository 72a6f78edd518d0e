"""Qwen3 (dense; Qwen3-4B): config.json keys, switches, tiny sizes."""

from miles.models.facts import COMMON, GQA, Family

_COMMON_TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
}

FAMILY = Family(
    "qwen3",
    model_types=("qwen3",),
    attention="gqa",
    keys=(*COMMON, *GQA),
    tiny_model_type="qwen3",
    # Qwen3-4B ties its embeddings, has heads x head_dim != hidden and rope theta 1e6.
    tiny_dims={
        **_COMMON_TINY, "num_attention_heads": 8, "intermediate_size": 384, "num_key_value_heads": 2,
        "head_dim": 32, "tie_word_embeddings": True, "rope_theta": 1_000_000,
    },
)  # fmt: skip
