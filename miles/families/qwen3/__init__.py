"""Qwen3 (dense; Qwen3-4B; transformers' Qwen3ForCausalLM) as megatron-core GPTModel.

Every config.json field that changes the math is mapped (heads, head_dim, query groups, norms
and their epsilon, qk-norm, rope theta and scaling, tied embeddings; for Qwen3-MoE, which
builds on this family (miles.families.qwen3_moe), experts, top-k and whether the top-k
weights are renormalised, dense-first layers) and the ones megatron-core's GPTModel cannot
express are refused by name. Weights: the attention of the Transformer Engine spec (norm fused
into linear_qkv), a dense MLP with its norm fused into linear_fc1, an MoE layer with its own
pre_mlp_layernorm, a router and one SequentialMLP expert per HF expert.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.families.facts import COMMON, GQA, flag_values, rope_parameters, value
from miles.families.family import GPTFamily, UnmappedModel
from miles.families.weights import Weights, dense_mlp, gate_up_pieces, qkv_pieces, whole


def head_dim(config: Mapping[str, Any]) -> int:
    return int(flag_values(GQA, config)["--kv-channels"])


def num_experts(config: Mapping[str, Any]) -> int:
    return int(value(config, "num_experts"))


def moe_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which decoder layers are MoE: every `decoder_sparse_step`-th, except `mlp_only_layers`."""
    if config["model_type"] != "qwen3_moe":
        return [False] * config["num_hidden_layers"]
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]


_COMMON_TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "max_position_embeddings": 4096,
}


class Qwen3(GPTFamily):
    name = "qwen3"
    model_types = ("qwen3",)
    attention = "gqa"
    keys = (*COMMON, *GQA)
    tiny_model_type = "qwen3"
    # Qwen3-4B ties its embeddings, has heads x head_dim != hidden and rope theta 1e6.
    tiny_dims = {
        **_COMMON_TINY, "num_attention_heads": 8, "intermediate_size": 384, "num_key_value_heads": 2,
        "head_dim": 32, "tie_word_embeddings": True, "rope_theta": 1_000_000,
    }  # fmt: skip

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        if config.get("attention_bias"):
            raise UnmappedModel(
                "config.json attention_bias=true is not mapped to megatron (Qwen3 checkpoints have none)"
            )
        if config.get("use_sliding_window"):
            raise UnmappedModel("config.json use_sliding_window=true is not mapped to megatron's GPTModel")
        if config.get("hidden_act", "silu") != "silu":
            raise UnmappedModel(
                f"config.json hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is mapped"
            )
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") not in ("default", "linear"):
            raise UnmappedModel(
                f"config.json rope_type {rope.get('rope_type')!r} is not mapped to megatron (default and linear are)"
            )

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        """What megatron-core needs beyond the facts table's fields (`miles.families.transformer.model_fields`),
        and transformers' defaults for the keys a config.json may leave out."""
        import torch

        from miles.families.transformer import model_fields

        fields = model_fields(self.keys, config)
        fields.setdefault("layernorm_epsilon", 1e-6)  # Qwen3Config's rms_norm_eps
        fields.setdefault("add_bias_linear", False)  # no attention_bias: none
        fields.update(
            normalization="RMSNorm",
            qk_layernorm=True,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            hidden_dropout=0.0,
            attention_dropout=float(config.get("attention_dropout", 0.0)),
        )
        moe = moe_layers(config)
        if not any(moe):
            for name in (
                "num_moe_experts",
                "moe_router_topk",
                "moe_ffn_hidden_size",
                "moe_router_pre_softmax",
            ):
                fields.pop(name, None)
            return fields
        # Softmax over all experts then top-k keeps the weights as they are (HF norm_topk_prob=false,
        # Qwen3MoeConfig's default); top-k of the logits then softmax renormalises them (true).
        fields.setdefault("moe_router_pre_softmax", True)
        fields.update(
            moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="alltoall",
            # An int (all layers MoE) keeps Megatron's stacked per-layer keys, as a job run with the
            # default --moe-layer-freq builds them; a mixed pattern must be a list.
            moe_layer_freq=1 if all(moe) else [int(m) for m in moe],
        )
        return fields

    def layer_weights(self, config: Mapping[str, Any], i: int, mg: str) -> Weights:
        """The weights of decoder layer `i` of the HF model, under megatron layer prefix `mg`."""
        hidden = config["hidden_size"]
        heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], head_dim(config)
        hf = f"model.layers.{i}."
        # The TE spec fuses the input norm into linear_qkv; a dense MLP's norm into linear_fc1,
        # while an MoE layer keeps its own pre_mlp_layernorm (the router needs the normed input).
        yield (
            mg + "self_attention.linear_qkv.layer_norm_weight",
            (whole(hf + "input_layernorm.weight", hidden),),
        )
        yield mg + "self_attention.linear_qkv.weight", qkv_pieces(hf + "self_attn.", heads, groups, dim)
        yield mg + "self_attention.q_layernorm.weight", (whole(hf + "self_attn.q_norm.weight", dim),)
        yield mg + "self_attention.k_layernorm.weight", (whole(hf + "self_attn.k_norm.weight", dim),)
        yield mg + "self_attention.linear_proj.weight", (whole(hf + "self_attn.o_proj.weight", hidden),)
        post_norm = (whole(hf + "post_attention_layernorm.weight", hidden),)
        if not moe_layers(config)[i]:
            yield from dense_mlp(mg, hf, post_norm, config["intermediate_size"], hidden)
            return
        yield mg + "pre_mlp_layernorm.weight", post_norm
        yield mg + "mlp.router.weight", (whole(hf + "mlp.gate.weight", num_experts(config)),)
        for e in range(num_experts(config)):
            src, at = f"{hf}mlp.experts.{e}.", mg + f"mlp.experts.local_experts.{e}."
            yield at + "linear_fc1.weight", gate_up_pieces(src, config["moe_intermediate_size"])
            yield at + "linear_fc2.weight", (whole(src + "down_proj.weight", hidden),)


FAMILY = Qwen3()
