"""Hugging Face Qwen3 / Qwen3-MoE weights in megatron-core GPTModel's names and layouts.

megatron-core fuses what Hugging Face keeps apart: q, k and v become one `linear_qkv`
whose rows are grouped per query group ([q heads of the group, k, v] for each group), and
gate and up become one `linear_fc1` ([gate; up]). The model itself (built from the HF
config with the local layer spec) decides names, stacking and sharding when it writes
its sharded state dict, so the checkpoint keys are the ones a TE-spec model on GPU loads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from miles.ckpt.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


def _moe_layers(config: Mapping[str, Any]) -> list[bool]:
    if config["model_type"] != "qwen3_moe":
        return [False] * config["num_hidden_layers"]
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]


def num_experts(config: Mapping[str, Any]) -> int:
    # Hub configs say num_experts; transformers 5 writes num_local_experts.
    return int(config.get("num_experts") or config["num_local_experts"])


def transformer_config(config: Mapping[str, Any]):
    """megatron-core's TransformerConfig for a Qwen3 / Qwen3-MoE config.json."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"no megatron GPT mapping for model_type {config.get('model_type')!r}")
    if config.get("attention_bias"):
        raise CheckpointError("attention_bias=true is not mapped to megatron (Qwen3 checkpoints have none)")
    moe = _moe_layers(config)
    kwargs: dict[str, Any] = {}
    if any(moe):
        kwargs = {
            "num_moe_experts": num_experts(config),
            "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": config["moe_intermediate_size"],
            "moe_grouped_gemm": False,
            # An int (all layers MoE) keeps Megatron's stacked per-layer keys, as a job run
            # with the default --moe-layer-freq builds them; a mixed pattern must be a list.
            "moe_layer_freq": 1 if all(moe) else [int(m) for m in moe],
        }
    return TransformerConfig(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config["num_key_value_heads"],
        kv_channels=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        ffn_hidden_size=config["intermediate_size"],
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=False,
        **kwargs,
    )


def build_model(config: Mapping[str, Any], vocab_size: int | None = None):
    """An uninitialised GPTModel (local spec, CPU) shaped like the HF config."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    tc = transformer_config(config)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    rope = config.get("rope_parameters") or {}
    model = GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=vocab_size or config["vocab_size"],
        max_sequence_length=config.get("max_position_embeddings", 4096),
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", config.get("rope_theta", 10000))),
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
    )
    # The local spec keeps norms in fp32; the checkpoint stores every weight in the model's
    # dtype, as a bf16 run with Transformer Engine layers writes it.
    return model.to(tc.params_dtype)


def fuse_qkv(q, k, v, groups: int):
    """[q; k; v] rows regrouped per query group, as megatron's linear_qkv holds them."""
    import torch

    hidden = q.shape[-1]
    q = q.reshape(groups, -1, hidden)
    k = k.reshape(groups, -1, hidden)
    v = v.reshape(groups, -1, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(qkv, heads: int, groups: int, head_dim: int):
    """The inverse of fuse_qkv: (q, k, v) in Hugging Face's row order."""
    hidden = qkv.shape[-1]
    per_group = qkv.reshape(groups, (heads // groups + 2) * head_dim, hidden)
    q_rows = heads // groups * head_dim
    q = per_group[:, :q_rows].reshape(-1, hidden)
    k = per_group[:, q_rows : q_rows + head_dim].reshape(-1, hidden)
    v = per_group[:, q_rows + head_dim :].reshape(-1, hidden)
    return q, k, v


def hf_to_megatron(config: Mapping[str, Any], read: Callable[[str], Any]) -> Iterator[tuple[str, Any]]:
    """(megatron state-dict name, tensor) for every weight, reading HF tensors through `read`."""
    import torch

    groups = config["num_key_value_heads"]
    yield "embedding.word_embeddings.weight", read("model.embed_tokens.weight")
    for i, is_moe in enumerate(_moe_layers(config)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield mg + "input_layernorm.weight", read(hf + "input_layernorm.weight")
        qkv = [read(hf + f"self_attn.{p}_proj.weight") for p in "qkv"]
        yield mg + "self_attention.linear_qkv.weight", fuse_qkv(*qkv, groups)
        yield mg + "self_attention.q_layernorm.weight", read(hf + "self_attn.q_norm.weight")
        yield mg + "self_attention.k_layernorm.weight", read(hf + "self_attn.k_norm.weight")
        yield mg + "self_attention.linear_proj.weight", read(hf + "self_attn.o_proj.weight")
        yield mg + "pre_mlp_layernorm.weight", read(hf + "post_attention_layernorm.weight")
        if not is_moe:
            gate_up = [read(hf + f"mlp.{p}_proj.weight") for p in ("gate", "up")]
            yield mg + "mlp.linear_fc1.weight", torch.cat(gate_up)
            yield mg + "mlp.linear_fc2.weight", read(hf + "mlp.down_proj.weight")
            continue
        yield mg + "mlp.router.weight", read(hf + "mlp.gate.weight")
        for e in range(num_experts(config)):
            src, dst = hf + f"mlp.experts.{e}.", mg + f"mlp.experts.local_experts.{e}."
            yield (
                dst + "linear_fc1.weight",
                torch.cat([read(src + "gate_proj.weight"), read(src + "up_proj.weight")]),
            )
            yield dst + "linear_fc2.weight", read(src + "down_proj.weight")
    yield "decoder.final_layernorm.weight", read("model.norm.weight")
    if not config.get("tie_word_embeddings"):
        yield "output_layer.weight", read("lm_head.weight")
