"""What each model family's checkpoint looks like: config types, layer naming, tiny sizes.

The transformers classes themselves are the source of truth for tensor names and shapes
(validate builds the model on the meta device); this file holds only what transformers
cannot say: which model types a recipe family accepts, how small a tiny model is, whether
megatron-core 0.16.1 has a GPT layer spec for the architecture, and how a checkpoint names
its MTP layers (the classes do not build those).

A tiny model is small in sizes only: every switch the published model sets has the
published value (Qwen3-4B ties its embeddings; Qwen3-30B-A3B renormalizes its top-k
weights; both have heads x head_dim != hidden and rope theta 1e6; DeepSeek-V4-Flash and
GLM-5 carry one MTP layer), because each switch is a code path the GPU meets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from miles.ckpt.errors import CheckpointError
from miles.ckpt.plan import FAMILIES

_COMMON_TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values this family accepts
    tiny_model_type: str  # the causal-LM config make_tiny_checkpoint builds
    tiny_dims: Mapping[str, Any] = field(default_factory=dict)
    megatron_gpt: bool = False  # torch_dist in megatron-core GPTModel names (else HF names kept)
    sdpa: bool = True  # transformers' class supports attn_implementation="sdpa"
    # How the checkpoint names MTP layers: "layers" = model.layers.{L+k}.* with eh_proj/enorm/hnorm
    # (DeepSeek-V3 style, GLM-5); "mtp" = mtp.{k}.* with e_proj/h_proj (DeepSeek-V4); None = none.
    mtp_style: str | None = None


_SPECS = (
    Family(
        "qwen3",
        ("qwen3",),
        "qwen3",
        {
            **_COMMON_TINY, "num_attention_heads": 8, "intermediate_size": 384, "num_key_value_heads": 2,
            "head_dim": 32, "tie_word_embeddings": True, "rope_theta": 1_000_000,
        },
        megatron_gpt=True,
    ),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        "qwen3_moe",
        {
            **_COMMON_TINY, "num_attention_heads": 8, "intermediate_size": 384, "moe_intermediate_size": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "num_key_value_heads": 2, "head_dim": 32,
            "norm_topk_prob": True, "rope_theta": 1_000_000,
        },
        megatron_gpt=True,
    ),
    Family(
        "deepseek_v4",
        ("deepseek_v4",),
        "deepseek_v4",
        {
            **_COMMON_TINY, "moe_intermediate_size": 64, "num_key_value_heads": 1, "head_dim": 64,
            "q_lora_rank": 64, "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2,
            "o_lora_rank": 32, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 16, "hc_mult": 2,
            "sliding_window": 32, "num_nextn_predict_layers": 1,
        },
        sdpa=False,
        mtp_style="mtp",
    ),
    Family(
        "glm_moe_dsa",
        ("glm_moe_dsa",),
        "glm_moe_dsa",
        {
            **_COMMON_TINY, "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 4,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 64,
            "qk_rope_head_dim": 16, "qk_nope_head_dim": 48, "v_head_dim": 16, "index_topk": 64,
            "index_head_dim": 32, "index_n_heads": 2, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
        },
        mtp_style="layers",
    ),
    Family(
        "inkling",
        ("inkling_text", "inkling_mm_model"),
        "inkling_text",
        {
            **_COMMON_TINY, "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 2,
            "head_dim": 32, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 32,
            "sliding_window_size": 32, "rel_extent": 64, "d_rel": 8, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1,
        },
    ),
)  # fmt: skip
SPECS: Mapping[str, Family] = {f.name: f for f in _SPECS}
assert tuple(SPECS) == FAMILIES, "families.py and plan.FAMILIES must list the same families"

# Decoder layers: model.layers.N.*, or model.language_model.layers.N.* / model.llm.layers.N.* in
# multimodal checkpoints (the latter is Inkling's published naming).
LAYER_RE = re.compile(
    r"^(?P<prefix>(?:model\.)?(?:language_model\.|llm\.)?layers)\.(?P<index>\d+)\.(?P<rest>.+)$"
)
# Per-layer lists in config.json that must keep one entry per layer when a checkpoint is cut.
LAYER_LIST_KEYS = ("layer_types", "mlp_layer_types", "indexer_types")
_NAME_LAYERS_RE = re.compile(r"-(\d+)[-_]?layers?\b", re.IGNORECASE)


def family(name: str) -> Family:
    try:
        return SPECS[name]
    except KeyError:
        raise CheckpointError(f"unknown model family '{name}'; known: {', '.join(SPECS)}") from None


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The decoder's part of a config (multimodal configs nest it under text_config)."""
    nested = config.get("text_config")
    return nested if isinstance(nested, Mapping) else config


def num_layers(config: Mapping[str, Any]) -> int | None:
    value = text_config(config).get("num_hidden_layers")
    return value if isinstance(value, int) else None


def mtp_layers(config: Mapping[str, Any]) -> int:
    """How many MTP layers the config declares (they follow the decoder layers in the checkpoint)."""
    text = text_config(config)
    value = text.get("num_nextn_predict_layers", text.get("num_mtp_layers"))
    return value if isinstance(value, int) else 0


def layers_in_name(model_name: str) -> int | None:
    """N of a "-Nlayer" model name (e.g. Inkling-Small-4layer -> 4), else None."""
    m = _NAME_LAYERS_RE.search(model_name)
    return int(m.group(1)) if m else None


def expected_architectures(model_type: str) -> tuple[str, ...]:
    """The class names transformers registers for a model type (causal LM or multimodal)."""
    from transformers.models.auto import modeling_auto

    names = []
    for mapping in ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES"):
        value = getattr(modeling_auto, mapping, {}).get(model_type)
        if value:
            names.extend([value] if isinstance(value, str) else value)
    return tuple(dict.fromkeys(names))
