"""Inkling (transformers' InklingForCausalLM, inkling_text; its release, inkling_mm_model) as megatron-core GPTModel.

Inkling's layers (`miles.megatron.inkling`: short convolutions, relative attention bias,
1/head_dim-scaled sliding-window and global attention with log scaling, the dense MLP's
global scale, the shared-expert-sink router, shared experts of the routed width, the
embedding norm, the final norm's division) in megatron-core's GPTModel, its layers and MoE
layer. Every config.json value that changes the math is mapped or refused by name. No
position embedding. The MTP layers the published checkpoint may carry are not built
(transformers' causal LM has no forward for them).

The published release (inkling_mm_model, transformers' InklingForConditionalGeneration) nests
the decoder's config under text_config with keys of its own (`dense_intermediate_size` is the
dense width, `intermediate_size` then the experts'; the MTP block at the top level), which
`decoder_config` normalises as transformers' InklingConfig does; its weights have the
release's names (transformers' conversion_mapping.py, "inkling_mm_model"): model.llm.embed,
embed_norm, norm and unembed, a layer's attn.{wq_du, wk_dv, wv_dv, wr_du, wo_ud}, attn.{q,k}_norm,
attn.{k,v}_sconv, attn.rel_logits_proj.proj, attn_norm, attn_sconv, mlp_norm, mlp_sconv, the
dense mlp.w13_dn (gate and up rows interleaved: gate, up, gate, ...), mlp.w2_md and
mlp.global_scale, an MoE layer's mlp.gate.{weight, global_scale, bias}, mlp.experts.w13_weight
[experts, interleaved gate/up, hidden] and w2_weight, mlp.shared_experts.shared_w13_weight
(interleaved too) and shared_w2_weight. Its vision and audio towers and MTP layers are not part
of the decoder: the conversion leaves them out and says so.

Weights (transformers names on the right): linear_qkv [q_proj, k_proj, v_proj, r_proj rows
per query group: its q heads, k, v, then its heads' r] with layer_norm_weight
[input_layernorm], k_sconv / v_sconv [self_attn.{k,v}_sconv.conv1d], q_layernorm / k_layernorm
[q_norm, k_norm], rel_proj [rel_logits_proj.proj], linear_proj [o_proj], attn_sconv; the dense
MLP as Qwen3's plus global_scale and mlp_sconv; an MoE layer's pre_mlp_layernorm
[post_attention_layernorm], router.{weight, global_scale, expert_bias}
[gate.{weight, global_scale, e_score_correction_bias}], expert e's linear_fc1 / linear_fc2
[experts.gate_up_proj[e] / down_proj[e]], shared expert j's [shared_experts.{gate,up}_proj[j]
/ down_proj[j]]; embedding.embed_norm [embed_tokens.embed_norm].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.megatron.families import GPTMapping, UnmappedModel
from miles.megatron.hf_names import Piece, Weights, whole

SLIDING = "hybrid_sliding"
RELEASE = "inkling_mm_model"  # the published multimodal checkpoint


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """ "hybrid_sliding" or "hybrid" (global) per layer, as InklingTextConfig derives them."""
    layers = int(config["num_hidden_layers"])
    if config.get("layer_types"):
        return list(config["layer_types"])
    local = config.get("local_layer_ids")
    if local is not None:
        return [SLIDING if i in set(local) else "hybrid" for i in range(layers)]
    return [SLIDING if (i + 1) % 6 else "hybrid" for i in range(layers)]


def moe_layers(config: Mapping[str, Any]) -> list[bool]:
    layers = int(config["num_hidden_layers"])
    if config.get("mlp_layer_types"):
        return [t == "sparse" for t in config["mlp_layer_types"]]
    dense = int(config.get("dense_mlp_idx") or 0)
    return [i >= dense for i in range(layers)]


# InklingTextConfig.attribute_map: the names a config.json may use for its keys
ALIASES = {
    "sconv_kernel_size": "conv_kernel_size", "sliding_window": "sliding_window_size",
    "num_local_experts": "n_routed_experts", "model_max_length": "max_position_embeddings",
    "embedding_multiplier": "logits_mup_width_multiplier",
}  # fmt: skip


def normalised(config: Mapping[str, Any]) -> dict:
    """The config under InklingTextConfig's key names, with the per-layer lists it derives."""
    out = dict(config)
    for alias, name in ALIASES.items():
        if alias in out and name not in out:
            out[name] = out[alias]
    out["layer_types"] = layer_types(out)
    out["mlp_layer_types"] = ["sparse" if m else "dense" for m in moe_layers(out)]
    return out


def decoder_config(config: Mapping[str, Any]) -> dict:
    """The decoder's config of a release config.json (model_type inkling_mm_model), as
    transformers' InklingConfig and InklingTextConfig normalise it: text_config's keys, the
    top-level mtp_config block as num_mtp_layers / chain_hidden_post_norm /
    mtp_local_layer_ids, and with `dense_intermediate_size` present the widths swapped
    (`intermediate_size` is then the experts' width, moe_intermediate_size). It keeps the
    release's model_type: its weights have the release's names. A config already normalised
    (no text_config) is returned normalised again, unchanged."""
    text = config.get("text_config")
    if text is None and "hidden_size" in config:
        return normalised(config)
    if not isinstance(text, Mapping):
        raise UnmappedModel(
            f"config.json model_type {RELEASE!r} has no text_config object (the decoder's config); "
            "is this an Inkling release checkpoint?"
        )
    out = dict(text)
    if out.get("dense_intermediate_size") is not None:
        out["moe_intermediate_size"] = out["intermediate_size"]
        out["intermediate_size"] = out.pop("dense_intermediate_size")
    mtp = config.get("mtp_config") or {}
    out.setdefault("num_mtp_layers", mtp.get("num_nextn_predict_layers"))
    out.setdefault("chain_hidden_post_norm", mtp.get("chain_hidden_post_norm", False))
    out.setdefault("mtp_local_layer_ids", mtp.get("local_layer_ids"))
    for key in ("dtype", "torch_dtype"):  # the weights' dtype, where only the top level records it
        if key in config and key not in out:
            out[key] = config[key]
    out["model_type"] = RELEASE
    return normalised(out)


def release_names(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == RELEASE


def outer_names(config: Mapping[str, Any]) -> tuple[str, str, str]:
    if release_names(config):
        return "model.llm.embed.weight", "model.llm.norm.weight", "model.llm.unembed.weight"
    return "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


# checkpoint tensors outside the decoder the conversion leaves out: (prefix, what it is)
NOT_DECODER = (
    ("model.visual.", "the vision tower"),
    ("model.audio.", "the audio tower"),
    ("model.mtp.", "the MTP layers (speculative decoding; not built)"),
)


# switches transformers' Inkling hard-codes, which SGLang reads: a config asking otherwise
# describes a model neither transformers nor miles computes
_ON = ("use_sconv", "use_embed_norm", "use_global_scale", "shared_expert_sink", "norm_after_topk")
_OFF = ("q_bias", "o_bias", "attention_bias", "mlp_bias", "final_logit_softcapping", "tie_word_embeddings")


def refuse_unmapped(config: Mapping[str, Any]) -> None:
    def refuse(message: str) -> None:
        raise UnmappedModel(f"config.json {message}")

    if config.get("model_type") not in ("inkling_text", RELEASE):
        refuse(
            f"model_type {config.get('model_type')!r}: the Megatron mapping reads inkling_text and {RELEASE} "
            "checkpoints"
        )
    if "text_config" in config:
        refuse(
            "text_config: the mapping reads the decoder's config (miles.megatron.families.decoder_config "
            "of config.json), not the release's top level"
        )
    for key in _ON:
        if key in config and not config[key]:
            refuse(f"{key}=false: transformers' Inkling always applies it, so miles does too; remove the key")
    for key in _OFF:
        if config.get(key):
            refuse(f"{key}={config[key]!r}: transformers' Inkling has none; remove the key")
    if config.get("gate_activation", "sigmoid") != "sigmoid":
        refuse(f"gate_activation {config['gate_activation']!r}: Inkling's router scores by sigmoid")
    if config.get("hidden_act", "silu") != "silu":
        refuse(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is mapped")
    for pre in ("", "swa_"):
        v_dim = config.get(f"{pre}v_head_dim")
        if v_dim is not None and v_dim != config.get(f"{pre}head_dim"):
            refuse(
                f"{pre}v_head_dim {v_dim} != {pre}head_dim: transformers' Inkling gives values the key width"
            )
    unpadded = config.get("unpadded_vocab_size")
    if unpadded is not None and unpadded != config["vocab_size"]:
        refuse(
            f"unpadded_vocab_size {unpadded} < vocab_size {config['vocab_size']}: the logits' vocabulary cut is "
            "not mapped to megatron"
        )
    if config.get("attention_dropout"):
        refuse(f"attention_dropout {config['attention_dropout']}: miles' Inkling attention applies none")
    if any(moe_layers(config)) and int(config.get("n_shared_experts") or 0) < 1:
        refuse(
            "n_shared_experts 0: Inkling's router normalises over the shared experts (its sink); it needs one"
        )


def transformer_fields(config: Mapping[str, Any]) -> dict:
    """The TransformerConfig fields of the model beyond the facts table's (the attention's own
    dims per layer are read by miles.megatron.inkling from the config itself)."""
    import torch

    from miles.megatron.config import model_fields

    config = normalised(config)
    fields = model_fields(config)
    fields.setdefault("layernorm_epsilon", 1e-6)  # InklingTextConfig's rms_norm_eps
    fields.setdefault("kv_channels", int(config.get("head_dim") or 128))
    fields.pop("moe_shared_expert_intermediate_size", None)  # miles.megatron.inkling builds them
    fields.update(
        normalization="RMSNorm",
        qk_layernorm=True,  # its q/k norms sum their gradients over TP by these names
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # sliding and global layers' attention weights differ in shape (the relative bias' extent,
        # their own head counts): every layer is saved under its own keys
        hetereogenous_dist_checkpoint=True,
    )
    moe = moe_layers(config)
    if not any(moe):
        for name in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size"):
            fields.pop(name, None)
        return fields
    fields.update(
        moe_layer_freq=[int(m) for m in moe],
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # transformers never moves e_score_correction_bias
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type="alltoall",
        moe_shared_expert_overlap=False,
    )
    return fields


def _qkvr_pieces(names: tuple[str, str, str, str], dims: dict) -> tuple[Piece, ...]:
    """linear_qkv rows per query group: its q heads, its k head, its v head, its heads' r rows
    (`names`: the q, k, v and r projections' weights)."""
    q, k, v, r = names
    groups, dim, d_rel = dims["groups"], dims["dim"], dims["d_rel"]
    rep = dims["heads"] // groups
    q_rows, r_rows = rep * dim, rep * d_rel
    block = q_rows + 2 * dim + r_rows
    pieces = []
    for g in range(groups):
        at = g * block
        pieces.append(Piece(q, g * q_rows, (g + 1) * q_rows, at))
        pieces.append(Piece(k, g * dim, (g + 1) * dim, at + q_rows))
        pieces.append(Piece(v, g * dim, (g + 1) * dim, at + q_rows + dim))
        pieces.append(Piece(r, g * r_rows, (g + 1) * r_rows, at + q_rows + 2 * dim))
    return tuple(pieces)


def _stacked_gate_up(gate: str, up: str, index: int, rows: int) -> tuple[Piece, ...]:
    return (Piece(gate, 0, rows, 0, index), Piece(up, 0, rows, rows, index))


def _interleaved_gate_up(w13: str, rows: int, index: int | None = None) -> tuple[Piece, ...]:
    """megatron's [gate; up] from the release's interleaved rows (gate, up, gate, up, ...)."""
    return (Piece(w13, 0, 2 * rows, 0, index, 2), Piece(w13, 1, 2 * rows, rows, index, 2))


def layer_weights(config: Mapping[str, Any], i: int, mg: str) -> Weights:
    """The weights of decoder layer `i` of the HF model, under megatron layer prefix `mg`."""
    from miles.megatron.inkling import attention_dims

    config = normalised(config)
    if release_names(config):
        yield from _release_layer_weights(config, i, mg, attention_dims(config, i))
        return
    hidden = int(config["hidden_size"])
    dims = attention_dims(config, i)
    hf, attn, at = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", mg + "self_attention."
    kv = dims["groups"] * dims["dim"]
    yield at + "linear_qkv.layer_norm_weight", (whole(hf + "input_layernorm.weight", hidden),)
    yield at + "linear_qkv.weight", _qkvr_pieces(tuple(attn + f"{p}_proj.weight" for p in "qkvr"), dims)
    yield at + "k_sconv.weight", (whole(attn + "k_sconv.conv1d.weight", kv),)
    yield at + "v_sconv.weight", (whole(attn + "v_sconv.conv1d.weight", kv),)
    yield at + "q_layernorm.weight", (whole(attn + "q_norm.weight", dims["dim"]),)
    yield at + "k_layernorm.weight", (whole(attn + "k_norm.weight", dims["dim"]),)
    yield at + "rel_proj.weight", (whole(attn + "rel_logits_proj.proj", dims["d_rel"]),)
    yield at + "linear_proj.weight", (whole(attn + "o_proj.weight", hidden),)
    yield at + "attn_sconv.weight", (whole(hf + "attn_sconv.conv1d.weight", hidden),)
    post_norm = (whole(hf + "post_attention_layernorm.weight", hidden),)
    yield mg + "mlp.mlp_sconv.weight", (whole(hf + "mlp_sconv.conv1d.weight", hidden),)
    if not moe_layers(config)[i]:
        width = int(config["intermediate_size"])
        yield mg + "mlp.linear_fc1.layer_norm_weight", post_norm
        yield (
            mg + "mlp.linear_fc1.weight",
            (whole(hf + "mlp.gate_proj.weight", width), whole(hf + "mlp.up_proj.weight", width, width)),
        )
        yield mg + "mlp.linear_fc2.weight", (whole(hf + "mlp.down_proj.weight", hidden),)
        yield mg + "mlp.global_scale", (whole(hf + "mlp.global_scale", 1),)
        return
    experts, shared = int(config["n_routed_experts"]), int(config["n_shared_experts"])
    width = int(config["moe_intermediate_size"])
    yield mg + "pre_mlp_layernorm.weight", post_norm
    yield mg + "mlp.router.weight", (whole(hf + "mlp.gate.weight", experts + shared),)
    yield mg + "mlp.router.global_scale", (whole(hf + "mlp.gate.global_scale", 1),)
    yield mg + "mlp.router.expert_bias", (whole(hf + "mlp.gate.e_score_correction_bias", experts),)
    src = hf + "mlp.experts."
    for e in range(experts):
        to = mg + f"mlp.experts.local_experts.{e}."
        yield to + "linear_fc1.weight", (Piece(src + "gate_up_proj", 0, 2 * width, 0, e),)
        yield to + "linear_fc2.weight", (Piece(src + "down_proj", 0, hidden, 0, e),)
    src = hf + "mlp.shared_experts."
    for j in range(shared):
        to = mg + f"mlp.shared_experts.experts.{j}."
        yield to + "linear_fc1.weight", _stacked_gate_up(src + "gate_proj", src + "up_proj", j, width)
        yield to + "linear_fc2.weight", (Piece(src + "down_proj", 0, hidden, 0, j),)


def _release_layer_weights(config: Mapping[str, Any], i: int, mg: str, dims: dict) -> Weights:
    """Decoder layer `i` under the release's names (transformers' conversion_mapping.py)."""
    hidden = int(config["hidden_size"])
    hf, at = f"model.llm.layers.{i}.", mg + "self_attention."
    attn = hf + "attn."
    kv = dims["groups"] * dims["dim"]
    yield at + "linear_qkv.layer_norm_weight", (whole(hf + "attn_norm.weight", hidden),)
    names = tuple(attn + f"{p}.weight" for p in ("wq_du", "wk_dv", "wv_dv", "wr_du"))
    yield at + "linear_qkv.weight", _qkvr_pieces(names, dims)
    yield at + "k_sconv.weight", (whole(attn + "k_sconv.weight", kv),)
    yield at + "v_sconv.weight", (whole(attn + "v_sconv.weight", kv),)
    yield at + "q_layernorm.weight", (whole(attn + "q_norm.weight", dims["dim"]),)
    yield at + "k_layernorm.weight", (whole(attn + "k_norm.weight", dims["dim"]),)
    yield at + "rel_proj.weight", (whole(attn + "rel_logits_proj.proj", dims["d_rel"]),)
    yield at + "linear_proj.weight", (whole(attn + "wo_ud.weight", hidden),)
    yield at + "attn_sconv.weight", (whole(hf + "attn_sconv.weight", hidden),)
    post_norm = (whole(hf + "mlp_norm.weight", hidden),)
    yield mg + "mlp.mlp_sconv.weight", (whole(hf + "mlp_sconv.weight", hidden),)
    if not moe_layers(config)[i]:
        width = int(config["intermediate_size"])
        yield mg + "mlp.linear_fc1.layer_norm_weight", post_norm
        yield mg + "mlp.linear_fc1.weight", _interleaved_gate_up(hf + "mlp.w13_dn.weight", width)
        yield mg + "mlp.linear_fc2.weight", (whole(hf + "mlp.w2_md.weight", hidden),)
        yield mg + "mlp.global_scale", (whole(hf + "mlp.global_scale", 1),)
        return
    experts, shared = int(config["n_routed_experts"]), int(config["n_shared_experts"])
    width = int(config["moe_intermediate_size"])
    yield mg + "pre_mlp_layernorm.weight", post_norm
    yield mg + "mlp.router.weight", (whole(hf + "mlp.gate.weight", experts + shared),)
    yield mg + "mlp.router.global_scale", (whole(hf + "mlp.gate.global_scale", 1),)
    yield mg + "mlp.router.expert_bias", (whole(hf + "mlp.gate.bias", experts),)
    src = hf + "mlp.experts."
    for e in range(experts):
        to = mg + f"mlp.experts.local_experts.{e}."
        yield to + "linear_fc1.weight", _interleaved_gate_up(src + "w13_weight", width, e)
        yield to + "linear_fc2.weight", (Piece(src + "w2_weight", 0, hidden, 0, e),)
    src = hf + "mlp.shared_experts."
    for j in range(shared):
        to = mg + f"mlp.shared_experts.experts.{j}."
        yield to + "linear_fc1.weight", _interleaved_gate_up(src + "shared_w13_weight", width, j)
        yield to + "linear_fc2.weight", (Piece(src + "shared_w2_weight", 0, hidden, 0, j),)


def embedding_weights(config: Mapping[str, Any]) -> Weights:
    name = "model.llm.embed_norm.weight" if release_names(config) else "model.embed_tokens.embed_norm.weight"
    yield "embedding.embed_norm.weight", (whole(name, int(config["hidden_size"])),)


def block_spec(tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"):
    from miles.megatron import inkling

    return inkling.block_spec(tc, normalised(config), vp_stage, impl=impl)


def finish_model(
    model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
) -> None:
    """The embedding's norm on the first stage; fp32 convolutions and router scale; refuse
    context parallelism (the convolutions and the relative bias need each row's whole prefix
    in order, which miles' zigzag context split does not give)."""
    from miles.megatron import inkling

    if tc.context_parallel_size > 1:
        raise UnmappedModel(
            f"--context-parallel-size {tc.context_parallel_size}: Inkling's short convolutions and relative "
            "bias read each token's preceding rows in order, which context parallelism splits; use 1"
        )
    if model.pre_process:
        inkling.add_embedding_norm(model, float(config.get("rms_norm_eps", 1e-6)))
    inkling.keep_fp32(model)


def lm_args(config: Mapping[str, Any]) -> dict:
    out = {"position_embedding_type": "none", "qk_layernorm": True}
    moe = moe_layers(config)
    if any(moe):
        out.update(
            moe_layer_freq=[int(m) for m in moe],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
        )
    return out


MAPPINGS = (
    GPTMapping(
        "inkling",
        ("inkling_text", RELEASE),
        refuse_unmapped,
        transformer_fields,
        layer_weights,
        block_spec=block_spec,
        finish_model=finish_model,
        embedding_weights=embedding_weights,
        lm_args=lm_args,
        position_embedding_type="none",
        outer_names=outer_names,
        decoder_config=decoder_config,
        not_decoder=NOT_DECODER,
    ),
)
