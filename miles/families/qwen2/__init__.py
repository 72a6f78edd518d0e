"""Qwen2 / Qwen2.5 (Qwen2.5-0.5B; transformers' Qwen2ForCausalLM) as megatron-core GPTModel.

Qwen2's attention has biases on its q, k and v projections and none on the output projection,
no q/k norms, grouped-query heads of hidden_size / num_attention_heads; the MLP is SwiGLU
without biases; the norms are RMSNorm. Every config.json value that changes the math is mapped
or refused by name (sliding-window layers and non-default rope are refused). Weights: the
Transformer Engine spec's attention (input norm fused into linear_qkv; q, k, v weights and
biases grouped per query group) and dense MLP (its norm fused into linear_fc1).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.families.facts import COMMON, GQA, Fixed, flag_values, rope_parameters
from miles.families.family import GPTFamily, UnmappedModel
from miles.families.schema import QWEN_SCHEMA
from miles.families.weights import Weights, dense_mlp, qkv_pieces, whole

_CLASS = "transformers' Qwen2ForCausalLM"


class Qwen2(GPTFamily):
    name = "qwen2"
    model_types = ("qwen2",)
    attention = "gqa"
    # Qwen2's config.json has no attention_bias key: its q/k/v biases are fixed by the class
    keys = tuple(k for k in (*COMMON, *GQA) if k.key != "attention_bias")
    fixed = (
        Fixed("--add-qkv-bias", True, f"{_CLASS} gives its q, k and v projections biases"),
        Fixed("--disable-bias-linear", True, f"{_CLASS} has no other linear biases"),
        Fixed("--qk-layernorm", False, f"{_CLASS} has no q/k norms"),
    )
    schema = QWEN_SCHEMA
    tiny_model_type = "qwen2"
    # Qwen2.5-0.5B's switches at tiny sizes: tied embeddings, 7 query heads per KV head's ratio
    # kept as 4 per KV head, head_dim = hidden / heads, rope theta 1e6
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 384, "max_position_embeddings": 4096, "tie_word_embeddings": True,
        "rope_theta": 1_000_000, "use_sliding_window": False,
    }  # fmt: skip

    def tiny_values(self, model, gen) -> None:
        """Seeded q/k/v biases and norms: transformers starts the biases at 0 and the norms at 1,
        which would hide a bias or norm read from the wrong place."""
        import torch

        for name, param in sorted(model.named_parameters()):
            if name.endswith("proj.bias") or "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        if config.get("use_sliding_window"):
            raise UnmappedModel(
                "config.json use_sliding_window=true: Qwen2's sliding-window layers are not mapped to megatron"
            )
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
        import torch

        from miles.families.transformer import model_fields

        fields = model_fields(self.keys, config)
        fields.setdefault("layernorm_epsilon", 1e-6)  # Qwen2Config's rms_norm_eps
        fields.update(
            normalization="RMSNorm",
            qk_layernorm=False,
            add_bias_linear=False,
            add_qkv_bias=True,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            hidden_dropout=0.0,
            attention_dropout=float(config.get("attention_dropout", 0.0)),
        )
        return fields

    def layer_weights(self, config: Mapping[str, Any], i: int, mg: str, hf: str | None = None) -> Weights:
        """Decoder layer `i` (or, with `hf`, the decoder layer under that prefix) under megatron prefix `mg`."""
        hidden = config["hidden_size"]
        heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
        dim = int(flag_values(GQA, config)["--kv-channels"])
        hf, at = hf if hf is not None else f"model.layers.{i}.", mg + "self_attention."
        yield at + "linear_qkv.layer_norm_weight", (whole(hf + "input_layernorm.weight", hidden),)
        yield at + "linear_qkv.weight", qkv_pieces(hf + "self_attn.", heads, groups, dim)
        yield at + "linear_qkv.bias", qkv_pieces(hf + "self_attn.", heads, groups, dim, leaf="bias")
        yield at + "linear_proj.weight", (whole(hf + "self_attn.o_proj.weight", hidden),)
        post_norm = (whole(hf + "post_attention_layernorm.weight", hidden),)
        yield from dense_mlp(mg, hf, post_norm, config["intermediate_size"], hidden)


FAMILY = Qwen2()
