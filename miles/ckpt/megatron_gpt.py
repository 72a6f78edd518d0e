"""Hugging Face Qwen3 / Qwen3-MoE weights in megatron-core GPTModel's names and layouts.

megatron-core fuses what Hugging Face keeps apart: q, k and v become one `linear_qkv`
whose rows are grouped per query group ([q heads of the group, k, v] for each group), and
gate and up become one `linear_fc1` ([gate; up]). The model itself (built from the HF
config with the local layer spec) decides names, stacking and sharding when it writes
its sharded state dict, so the checkpoint keys are the ones a TE-spec model on GPU loads.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a Hugging Face tensor, placed at row `at` of a megatron tensor."""

    hf_name: str
    start: int
    stop: int
    at: int


def _whole(hf_name: str, rows: int, at: int = 0) -> Piece:
    return Piece(hf_name, 0, rows, at)


def qkv_pieces(prefix: str, heads: int, groups: int, head_dim: int) -> tuple[Piece, ...]:
    """linear_qkv holds, for each query group, its q heads, then its k head, then its v head."""
    q_rows = heads // groups * head_dim
    block = q_rows + 2 * head_dim
    pieces = []
    for g in range(groups):
        pieces.append(Piece(prefix + "q_proj.weight", g * q_rows, (g + 1) * q_rows, g * block))
        pieces.append(Piece(prefix + "k_proj.weight", g * head_dim, (g + 1) * head_dim, g * block + q_rows))
        pieces.append(
            Piece(prefix + "v_proj.weight", g * head_dim, (g + 1) * head_dim, g * block + q_rows + head_dim)
        )
    return tuple(pieces)


def gate_up_pieces(prefix: str, rows: int) -> tuple[Piece, ...]:
    """linear_fc1 is [gate; up]: megatron's SwiGLU activates the first half."""
    return (_whole(prefix + "gate_proj.weight", rows), _whole(prefix + "up_proj.weight", rows, rows))


def layout(config: Mapping[str, Any]) -> Iterator[tuple[str, tuple[Piece, ...]]]:
    """(megatron state-dict name, where each of its rows comes from) for every weight."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    heads, groups = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    yield "embedding.word_embeddings.weight", (_whole("model.embed_tokens.weight", vocab),)
    for i, is_moe in enumerate(_moe_layers(config)):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        yield mg + "input_layernorm.weight", (_whole(hf + "input_layernorm.weight", hidden),)
        yield mg + "self_attention.linear_qkv.weight", qkv_pieces(hf + "self_attn.", heads, groups, head_dim)
        yield mg + "self_attention.q_layernorm.weight", (_whole(hf + "self_attn.q_norm.weight", head_dim),)
        yield mg + "self_attention.k_layernorm.weight", (_whole(hf + "self_attn.k_norm.weight", head_dim),)
        yield mg + "self_attention.linear_proj.weight", (_whole(hf + "self_attn.o_proj.weight", hidden),)
        yield mg + "pre_mlp_layernorm.weight", (_whole(hf + "post_attention_layernorm.weight", hidden),)
        if not is_moe:
            yield mg + "mlp.linear_fc1.weight", gate_up_pieces(hf + "mlp.", config["intermediate_size"])
            yield mg + "mlp.linear_fc2.weight", (_whole(hf + "mlp.down_proj.weight", hidden),)
            continue
        experts = num_experts(config)
        yield mg + "mlp.router.weight", (_whole(hf + "mlp.gate.weight", experts),)
        for e in range(experts):
            src, dst = hf + f"mlp.experts.{e}.", mg + f"mlp.experts.local_experts.{e}."
            yield dst + "linear_fc1.weight", gate_up_pieces(src, config["moe_intermediate_size"])
            yield dst + "linear_fc2.weight", (_whole(src + "down_proj.weight", hidden),)
    yield "decoder.final_layernorm.weight", (_whole("model.norm.weight", hidden),)
    if not config.get("tie_word_embeddings"):
        yield "output_layer.weight", (_whole("lm_head.weight", vocab),)
