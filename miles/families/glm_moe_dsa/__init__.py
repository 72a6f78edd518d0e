"""GLM-5 / GLM-5.2 (transformers' GlmMoeDsaForCausalLM, model_type glm_moe_dsa) as megatron-core GPTModel.

Multi-latent attention with the DSA indexer and GLM-5.2's cross-layer top-k sharing
(`dsa.py` here: megatron-core 0.16.1 wires DSA into no spec and lacks the sharing); the rest
(MLA, dense first layers, sigmoid-routed MoE with expert bias and a shared expert, the MTP
layers `model.layers.{L+k}.*` carried as mtp.layers.k) is what GLM's MLA families share
(miles.families.mla_moe). Every config.json value that changes the math is mapped or refused
by name.

Weights beyond the shared ones: on layers that run their own indexer
core_attention.indexer.{linear_wq_b, linear_wk, k_norm, linear_weights_proj}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.families.facts import Fixed, Key, dense_prefix, indexer_types
from miles.families.family import UnmappedModel
from miles.families.mla_moe import MLA_MOE_KEYS, MlaMoeFamily, mla_moe_fixed, mtp_layers, refuse
from miles.families.schema import COMMON_SCHEMA, TOPK, AtMost, Int, PerLayer, Real
from miles.families.weights import Weights, whole

_CLASS = "transformers' GlmMoeDsaForCausalLM"


def layer_kinds(config: Mapping[str, Any]) -> tuple[str, ...]:
    """ "full" or "shared" for every layer, the MTP layers after the decoder's."""
    return indexer_types(config, int(config["num_hidden_layers"]) + mtp_layers(config))


def _full(config: Mapping[str, Any], i: int) -> bool:
    return layer_kinds(config)[i] == "full"


class GlmMoeDsa(MlaMoeFamily):
    name = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    attention = "dsa"
    published = "GLM-5"
    attention_label = "DSA"
    keys = (
        *MLA_MOE_KEYS,
        Key("first_k_dense_replace", "--moe-layer-freq", dense_prefix),
        Key("index_n_heads", "--dsa-indexer-n-heads"),
        Key("index_head_dim", "--dsa-indexer-head-dim"),
        Key("index_topk", "--dsa-indexer-topk"),
    )
    fixed = (
        *mla_moe_fixed(_CLASS),
        Fixed("--experimental-attention-variant", "dsa", f"{_CLASS} selects keys with the DSA indexer"),
    )
    read_by_model = {
        "index_topk_freq": "miles.families.glm_moe_dsa.dsa: the indexer runs on full layers, shared layers reuse its top-k",
        "index_skip_topk_offset": "miles.families.glm_moe_dsa.dsa: which layers are full (transformers' formula)",
    }
    # transformers' GlmMoeDsaConfig: its sizes, the experts a token picks among the routed ones,
    # and its per-layer lists (attention kind, dense or MoE MLP, full or shared indexer)
    schema = (
        *COMMON_SCHEMA,
        Int("intermediate_size"), Int("moe_intermediate_size"), Int("n_routed_experts"),
        Int("num_experts_per_tok"), Int("n_shared_experts", 0, required=False),
        Int("num_key_value_heads", required=False), Int("kv_lora_rank"), Int("q_lora_rank", required=False),
        Int("qk_rope_head_dim"), Int("qk_nope_head_dim"), Int("v_head_dim"),
        Int("index_n_heads"), Int("index_head_dim"), Int("index_topk"),
        Int("first_k_dense_replace", 0, required=False), Int("num_nextn_predict_layers", 0, required=False),
        Int("n_group", required=False), Int("topk_group", required=False),
        Real("routed_scaling_factor", None),
        AtMost("num_experts_per_tok", "n_routed_experts", TOPK),
        AtMost("topk_group", "n_group", "the expert groups a token picks are among the groups there are"),
        PerLayer("layer_types", ("indexed_attention",)),
        PerLayer("mlp_layer_types", ("dense", "sparse")),
        PerLayer("indexer_types", ("full", "shared")),
    )  # fmt: skip
    router_classes = ("GlmMoeDsaTopkRouter",)  # its group top-k comes first; the last picks the experts
    tiny_model_type = "glm_moe_dsa"
    # GLM-5.2's switches at tiny sizes: cross-layer top-k sharing (full at layers 0, 1, 2, 6, ...:
    # four layers hold a shared one), rope theta 8e6, the indexer's interleaved rope as SGLang
    # reads it; index_topk 64 keeps the CPU lane's short sequences dense (sparse selection is
    # exercised by the parity tests). Every projection keeps a multiple of FP8's 128-row blocks.
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 4, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 64, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 48, "v_head_dim": 16, "index_topk": 64, "index_head_dim": 32, "index_n_heads": 2,
        "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "index_topk_freq": 4,
        "index_skip_topk_offset": 3, "rope_theta": 8_000_000, "indexer_rope_interleave": True,
    }  # fmt: skip
    tiny_layers = 4
    # the MTP block's projection and the DSA indexer's head weights stay bf16 (SGLang loads them so)
    fp8_keep = frozenset({"eh_proj", "weights_proj"})

    def moe_layers(self, config: Mapping[str, Any]) -> list[bool]:
        """Which layers (the MTP layers too) are MoE: all but the first `first_k_dense_replace`."""
        total = int(config["num_hidden_layers"]) + mtp_layers(config)
        written = [kind == "sparse" for kind in config.get("mlp_layer_types") or []]
        dense = int(config.get("first_k_dense_replace") or 0)
        return [written[i] if i < len(written) else i >= dense for i in range(total)]

    def refuse_attention(self, config: Mapping[str, Any]) -> None:
        if config.get("q_lora_rank") is None:
            refuse("q_lora_rank null: the DSA indexer reads the q latent, so GLM-5 needs one")
        if config.get("indexer_rope_interleave") is False:
            refuse(
                "indexer_rope_interleave=false: transformers' GlmMoeDsaIndexer (and miles) rotate the indexer's "
                "interleaved pairs, SGLang would rotate halves; remove the key or set it true"
            )
        if layer_kinds(config)[0] != "full":
            refuse(
                "indexer_types/index_topk_pattern: layer 0 is shared, but no layer below it has a top-k to share"
            )

    def attention_fields(self, config: Mapping[str, Any]) -> dict:
        return {
            "experimental_attention_variant": "dsa",  # MLA hands its core attention x and the q latent
            "dsa_indexer_loss_coeff": 0.0,
        }

    def attention_weights(self, config: Mapping[str, Any], i: int, at: str) -> Weights:
        """The DSA indexer's weights, on layers that run their own (a shared layer has none, in either model)."""
        if not _full(config, i):
            return
        index, dim = config["index_n_heads"], config["index_head_dim"]
        src, to = f"model.layers.{i}.self_attn.indexer.", at + "core_attention.indexer."
        yield to + "linear_wq_b.weight", (whole(src + "wq_b.weight", index * dim),)
        yield to + "linear_wk.weight", (whole(src + "wk.weight", dim),)
        yield to + "k_norm.weight", (whole(src + "k_norm.weight", dim),)
        yield to + "k_norm.bias", (whole(src + "k_norm.bias", dim),)
        yield to + "linear_weights_proj.weight", (whole(src + "weights_proj.weight", index),)

    def attention_spec(self, provider, config: Mapping[str, Any]):
        """MLA with GLM's DSA sparse core attention, every layer of a chunk sharing one top-k holder."""
        from miles.families.glm_moe_dsa import dsa

        return dsa.attention_spec(provider, layer_kinds(config), holder={})

    def finish_chunk(self, model, tc, config: Mapping[str, Any], vp_stage: int | None) -> None:
        """Refuse a chunk that starts on a shared layer, and recomputation of shared layers under
        pipeline parallelism."""
        from miles.megatron.blocks import StageStartsOnSharedLayer, check_chunk_start

        kinds = layer_kinds(config)
        try:
            check_chunk_start(tc, kinds, vp_stage=vp_stage)
        except StageStartsOnSharedLayer as exc:
            raise UnmappedModel(str(exc)) from exc
        shared = "shared" in kinds[: tc.num_layers]
        if shared and tc.recompute_granularity and tc.pipeline_model_parallel_size > 1:
            raise UnmappedModel(
                "--recompute-granularity with pipeline parallelism: a recomputed shared DSA layer would read the "
                "top-k a later micro-batch's forward left; train GLM-5.2 with pp 1 or without recomputation"
            )


FAMILY = GlmMoeDsa()
