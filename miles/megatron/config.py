"""Hugging Face Qwen3 / Qwen3-MoE as megatron-core GPTModel: the config, the model, the weights.

`transformer_config` maps every config.json field that changes the math (heads, head_dim,
query groups, norms and their epsilon, qk-norm, rope theta and scaling, tied embeddings,
experts, top-k and whether the top-k weights are renormalised, dense-first layers) and
refuses the ones it cannot map. `build_model` builds the GPTModel of one pipeline stage with
the Transformer Engine layer spec (`miles.megatron.spec`), so its keys are those of a
TE job. `layout` says where every row of every megatron weight comes from in the HF
checkpoint: q, k and v become one `linear_qkv` whose rows are grouped per query group
([q heads of the group, k, v] for each group), gate and up become `linear_fc1` ([gate; up]),
and norms fused into a linear take that linear's `layer_norm_weight` name.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from miles.ckpt.errors import CheckpointError
from miles.parallel import ParallelLayout

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


def moe_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which decoder layers are MoE: every `decoder_sparse_step`-th, except `mlp_only_layers`."""
    if config["model_type"] != "qwen3_moe":
        return [False] * config["num_hidden_layers"]
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(config["num_hidden_layers"])]


def num_experts(config: Mapping[str, Any]) -> int:
    # Hub configs say num_experts; transformers 5 writes num_local_experts.
    return int(config.get("num_experts") or config["num_local_experts"])


def head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def checkpoint_dtype(config: Mapping[str, Any]):
    """The dtype the HF checkpoint stores its weights in (bf16 when the config does not say)."""
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise CheckpointError(f"config.json dtype {name!r} is not a floating-point torch dtype")
    return dtype


def _refuse_unmapped(config: Mapping[str, Any]) -> None:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"no megatron GPT mapping for model_type {model_type!r}; mapped: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if config.get("attention_bias"):
        raise CheckpointError(
            "config.json attention_bias=true is not mapped to megatron (Qwen3 checkpoints have none)"
        )
    if config.get("use_sliding_window"):
        raise CheckpointError("config.json use_sliding_window=true is not mapped to megatron's GPTModel")
    if config.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"config.json hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is mapped"
        )
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") not in ("default", "linear"):
        raise CheckpointError(
            f"config.json rope_type {rope.get('rope_type')!r} is not mapped to megatron (default and linear are)"
        )


def rope_parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers 5 writes rope_parameters; older configs write rope_theta / rope_scaling."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    return rope


def transformer_config(
    config: Mapping[str, Any],
    parallel: ParallelLayout | None = None,
    *,
    dtype=None,
    on_cpu: bool = True,
    initialize: bool = False,
    **overrides: Any,
):
    """megatron-core's TransformerConfig for a Qwen3 / Qwen3-MoE config.json.

    `dtype` is the parameter dtype (default: the checkpoint's); `overrides` set any other
    TransformerConfig field (router dtype, aux-loss coefficient, recomputation, ...).
    `initialize` runs megatron's weight initialisation, which is also where it marks which
    parameters are tensor-parallel (and along which dimension): a model that trains with
    TP needs it even though its weights are then loaded from a checkpoint.
    """
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    _refuse_unmapped(config)
    dtype = dtype or checkpoint_dtype(config)
    moe = moe_layers(config)
    kwargs: dict[str, Any] = {}
    if any(moe):
        kwargs = {
            "num_moe_experts": num_experts(config),
            "moe_router_topk": config["num_experts_per_tok"],
            "moe_ffn_hidden_size": config["moe_intermediate_size"],
            # Softmax over all experts then top-k keeps the weights as they are (HF
            # norm_topk_prob=false); top-k of the logits then softmax renormalises them (true).
            "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
            "moe_router_load_balancing_type": "none",
            "moe_token_dispatcher_type": "alltoall",
            # An int (all layers MoE) keeps Megatron's stacked per-layer keys, as a job run
            # with the default --moe-layer-freq builds them; a mixed pattern must be a list.
            "moe_layer_freq": 1 if all(moe) else [int(m) for m in moe],
        }
    kwargs.update((parallel or ParallelLayout()).transformer_config_kwargs())
    kwargs.update(overrides)
    return TransformerConfig(
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_query_groups=config["num_key_value_heads"],
        kv_channels=head_dim(config),
        ffn_hidden_size=config["intermediate_size"],
        layernorm_epsilon=config.get("rms_norm_eps", 1e-6),
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(config.get("attention_dropout", 0.0)),
        params_dtype=dtype,
        pipeline_dtype=dtype,  # what pipeline stages exchange
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=initialize,
        **kwargs,
    )


def build_model(
    config: Mapping[str, Any],
    vocab_size: int | None = None,
    *,
    transformer=None,
    vp_stage: int | None = None,
):
    """An uninitialised GPTModel of this rank's pipeline stage (and virtual stage), shaped like
    the HF config, with the Transformer Engine layer spec's module tree and keys."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from miles.megatron.spec import decoder_block_spec

    tc = transformer if transformer is not None else transformer_config(config)
    rope = rope_parameters(config)
    interpolation = float(rope["factor"]) if rope.get("rope_type") == "linear" else None
    pp_initialized = parallel_state.model_parallel_is_initialized()
    first = (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        if pp_initialized
        else True
    )
    last = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        if pp_initialized
        else True
    )
    model = GPTModel(
        config=tc,
        transformer_layer_spec=decoder_block_spec(tc, vp_stage=vp_stage),
        vocab_size=vocab_size or config["vocab_size"],
        max_sequence_length=config.get("max_position_embeddings", 4096),
        pre_process=first,
        post_process=last,
        position_embedding_type="rope",
        rotary_base=rope["rope_theta"],
        seq_len_interpolation_factor=interpolation,
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
        vp_stage=vp_stage,
    )
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


def qkv_pieces(prefix: str, heads: int, groups: int, dim: int) -> tuple[Piece, ...]:
    """linear_qkv holds, for each query group, its q heads, then its k head, then its v head."""
    q_rows = heads // groups * dim
    block = q_rows + 2 * dim
    pieces = []
    for g in range(groups):
        pieces.append(Piece(prefix + "q_proj.weight", g * q_rows, (g + 1) * q_rows, g * block))
        pieces.append(Piece(prefix + "k_proj.weight", g * dim, (g + 1) * dim, g * block + q_rows))
        pieces.append(Piece(prefix + "v_proj.weight", g * dim, (g + 1) * dim, g * block + q_rows + dim))
    return tuple(pieces)


def gate_up_pieces(prefix: str, rows: int) -> tuple[Piece, ...]:
    """linear_fc1 is [gate; up]: megatron's SwiGLU activates the first half."""
    return (_whole(prefix + "gate_proj.weight", rows), _whole(prefix + "up_proj.weight", rows, rows))


def layer_layout(config: Mapping[str, Any], i: int, mg: str) -> Iterator[tuple[str, tuple[Piece, ...]]]:
    """The weights of decoder layer `i` of the HF model, under megatron layer prefix `mg`."""
    hidden = config["hidden_size"]
    heads, groups, dim = config["num_attention_heads"], config["num_key_value_heads"], head_dim(config)
    hf = f"model.layers.{i}."
    # The TE spec fuses the input norm into linear_qkv; a dense MLP's norm into linear_fc1,
    # while an MoE layer keeps its own pre_mlp_layernorm (the router needs the normed input).
    yield mg + "self_attention.linear_qkv.layer_norm_weight", (_whole(hf + "input_layernorm.weight", hidden),)
    yield mg + "self_attention.linear_qkv.weight", qkv_pieces(hf + "self_attn.", heads, groups, dim)
    yield mg + "self_attention.q_layernorm.weight", (_whole(hf + "self_attn.q_norm.weight", dim),)
    yield mg + "self_attention.k_layernorm.weight", (_whole(hf + "self_attn.k_norm.weight", dim),)
    yield mg + "self_attention.linear_proj.weight", (_whole(hf + "self_attn.o_proj.weight", hidden),)
    post_norm = (_whole(hf + "post_attention_layernorm.weight", hidden),)
    if not moe_layers(config)[i]:
        yield mg + "mlp.linear_fc1.layer_norm_weight", post_norm
        yield mg + "mlp.linear_fc1.weight", gate_up_pieces(hf + "mlp.", config["intermediate_size"])
        yield mg + "mlp.linear_fc2.weight", (_whole(hf + "mlp.down_proj.weight", hidden),)
        return
    yield mg + "pre_mlp_layernorm.weight", post_norm
    yield mg + "mlp.router.weight", (_whole(hf + "mlp.gate.weight", num_experts(config)),)
    for e in range(num_experts(config)):
        yield from expert_layout(config, i, e, mg + f"mlp.experts.local_experts.{e}.")


def expert_layout(
    config: Mapping[str, Any], i: int, e: int, mg: str
) -> Iterator[tuple[str, tuple[Piece, ...]]]:
    src = f"model.layers.{i}.mlp.experts.{e}."
    yield mg + "linear_fc1.weight", gate_up_pieces(src, config["moe_intermediate_size"])
    yield mg + "linear_fc2.weight", (_whole(src + "down_proj.weight", config["hidden_size"]),)


def layout(config: Mapping[str, Any]) -> Iterator[tuple[str, tuple[Piece, ...]]]:
    """(megatron state-dict name, where each of its rows comes from) for every weight of the
    whole model (one pipeline stage, one expert-parallel rank)."""
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    yield "embedding.word_embeddings.weight", (_whole("model.embed_tokens.weight", vocab),)
    for i in range(config["num_hidden_layers"]):
        yield from layer_layout(config, i, f"decoder.layers.{i}.")
    yield "decoder.final_layernorm.weight", (_whole("model.norm.weight", hidden),)
    if not config.get("tie_word_embeddings"):
        yield "output_layer.weight", (_whole("lm_head.weight", vocab),)


def probe_tokens(config: Mapping[str, Any], length: int = 24, seed: int = 0):
    """A fixed [1, length] sequence of ordinary token ids to compare two models on."""
    import torch

    vocab = min(int(config["vocab_size"]), 500)
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, tokens, vocab_size: int):
    """Logits [batch, seq, vocab] of a GPTModel built for one process (tensor parallel size 1)."""
    import torch

    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model.eval()(tokens, positions, None)[..., :vocab_size].float()


def hf_logit_gap(hf_dir, megatron_model, config: Mapping[str, Any]) -> float:
    """Max |logit difference| between the HF checkpoint in `hf_dir` and a world-of-one megatron
    model holding its converted weights, both in float32, on `probe_tokens`."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    tokens = probe_tokens(config)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a check inside prepare-ckpt, whose output is one line per step
    try:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    with torch.no_grad():
        want = hf.eval()(input_ids=tokens).logits.float()
    got = megatron_logits(megatron_model, tokens, config["vocab_size"])
    return float((want - got).abs().max())
