"""GLM-4.7-Flash (transformers' Glm4MoeLiteForCausalLM, model_type glm4_moe_lite) as megatron-core GPTModel.

GLM-5's architecture without the DSA indexer: multi-latent attention (q and kv latents, their
norms at transformers' eps 1e-6, interleaved rope pairs), dense first layers, then MoE layers
whose sigmoid router picks experts by score plus expert bias, top-k weights renormalised and
scaled, with a shared expert, and one MTP layer `model.layers.{L}.*` carried DeepSeek-V3 style
as mtp.layers.0: all of it what GLM's MLA families share (miles.families.mla_moe), with
megatron-core's own MLA attention. Every config.json value that changes the math is mapped or
refused by name.

Which layers are MoE is `mlp_layer_types` (transformers' default: the first dense, the rest
sparse); transformers never reads `first_k_dense_replace`, which GLM-4.7-Flash's config.json
still writes and SGLang reads, so one that disagrees with the list is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.families.facts import ABSENT, Key, moe_layer_freq
from miles.families.mla_moe import MLA_MOE_KEYS, MlaMoeFamily, mla_moe_fixed, mtp_layers, refuse
from miles.families.schema import COMMON_SCHEMA, TOPK, AtMost, Int, PerLayer, Real

_CLASS = "transformers' Glm4MoeLiteForCausalLM"


def mlp_kinds(config: Mapping[str, Any]) -> list[str]:
    """ "dense" or "sparse" for every decoder layer, as transformers' Glm4MoeLiteConfig reads them."""
    layers = int(config["num_hidden_layers"])
    return list(config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1))


def _written_or_default(config: Mapping[str, Any]) -> object:
    """The MoE pattern's key as transformers reads it (ABSENT for a config with no depth)."""
    return mlp_kinds(config) if config.get("num_hidden_layers") else ABSENT


def _leading_dense(kinds: list[str]) -> int:
    return kinds.index("sparse") if "sparse" in kinds else len(kinds)


def _layer_freq(kinds: object, config: Mapping[str, Any]) -> object:
    kinds = list(kinds)  # type: ignore[call-overload]
    return moe_layer_freq(_leading_dense(kinds), len(kinds))


class Glm4MoeLite(MlaMoeFamily):
    name = "glm4_moe_lite"
    model_types = ("glm4_moe_lite",)
    published = "GLM-4.7-Flash"
    keys = (
        *MLA_MOE_KEYS,
        Key("mlp_layer_types", "--moe-layer-freq", _layer_freq, fallback=_written_or_default),
    )
    fixed = mla_moe_fixed(_CLASS)
    read_by_model = {
        "first_k_dense_replace": "miles.families.glm4_moe_lite: transformers never reads it, SGLang does; refused unless "
        "it agrees with mlp_layer_types (--moe-layer-freq)",
        "rope_interleave": "megatron-core's MLA rotates each head's interleaved rope pairs (false is refused)",
    }
    # transformers' Glm4MoeLiteConfig: its sizes, the experts a token picks among the routed ones,
    # and its per-layer list (dense or MoE MLP)
    schema = (
        *COMMON_SCHEMA,
        Int("intermediate_size"), Int("moe_intermediate_size"), Int("n_routed_experts"),
        Int("num_experts_per_tok"), Int("n_shared_experts", 0, required=False),
        Int("num_key_value_heads", required=False), Int("kv_lora_rank"), Int("q_lora_rank", required=False),
        Int("qk_rope_head_dim"), Int("qk_nope_head_dim"), Int("v_head_dim"),
        Int("first_k_dense_replace", 0, required=False), Int("num_nextn_predict_layers", 0, required=False),
        Int("n_group", required=False), Int("topk_group", required=False),
        Real("routed_scaling_factor", None),
        AtMost("num_experts_per_tok", "n_routed_experts", TOPK),
        AtMost("topk_group", "n_group", "the expert groups a token picks are among the groups there are"),
        PerLayer("mlp_layer_types", ("dense", "sparse")),
    )  # fmt: skip
    router_classes = ("Glm4MoeLiteTopkRouter",)  # its group top-k comes first; the last picks the experts
    tiny_model_type = "glm4_moe_lite"
    # GLM-4.7-Flash's switches at tiny sizes: a q latent, rope theta 1e6 on interleaved pairs, one
    # dense layer, 4 of the routed experts with scale 1.8 and one shared, one MTP layer. Value heads
    # narrower than query-key heads (the core attention sizes its output by them); every projection
    # keeps a multiple of FP8's 128-row blocks (transformers' CPU dequantization misreads a part block).
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 4, "n_shared_experts": 1, "routed_scaling_factor": 1.8, "kv_lora_rank": 32,
        "q_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 48, "v_head_dim": 16,
        "num_nextn_predict_layers": 1, "rope_theta": 1_000_000, "rope_interleave": True,
    }  # fmt: skip
    tiny_layers = 2

    def moe_layers(self, config: Mapping[str, Any]) -> list[bool]:
        """Which layers are MoE: `mlp_layer_types`; an MTP layer is built as transformers builds layer
        L + k of the deeper model (its default list: sparse)."""
        kinds = mlp_kinds(config)
        return [kind == "sparse" for kind in kinds] + [True] * mtp_layers(config)

    def refuse_attention(self, config: Mapping[str, Any]) -> None:
        if config.get("rope_interleave") is False:
            refuse(
                "rope_interleave=false: megatron-core's MLA rotates each head's interleaved rope pairs; "
                "transformers would rotate halves; remove the key or set it true"
            )
        kinds = mlp_kinds(config)
        dense = _leading_dense(kinds)
        if "dense" in kinds[dense:]:
            refuse(
                f"mlp_layer_types {kinds}: a dense layer after a MoE layer; --moe-layer-freq (and SGLang's "
                "first_k_dense_replace) say leading dense layers, then MoE"
            )
        written = config.get("first_k_dense_replace")
        if written is not None and min(int(written), len(kinds)) != dense:
            refuse(
                f"first_k_dense_replace {written} with {dense} leading dense layer(s) in mlp_layer_types: "
                "transformers builds the list, SGLang reads first_k_dense_replace; make them agree"
            )


FAMILY = Glm4MoeLite()
