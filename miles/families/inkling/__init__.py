"""Inkling (transformers' InklingForCausalLM, inkling_text; its release, inkling_mm_model) as megatron-core GPTModel.

Inkling's layers (`layers.py` here: short convolutions, relative attention bias,
1/head_dim-scaled sliding-window and global attention with log scaling, the dense MLP's
global scale, the shared-expert-sink router, shared experts of the routed width, the
embedding norm, the final norm's division) in megatron-core's GPTModel, its layers and MoE
layer. Every config.json value that changes the math is mapped or refused by name. No
position embedding. The MTP layers the published checkpoint may carry are not built
(transformers' causal LM has no forward for them).

The published release (inkling_mm_model, transformers' InklingForConditionalGeneration) nests
the decoder's config under text_config with keys of its own (`dense_intermediate_size` is the
dense width, `intermediate_size` then the experts'; the MTP block at the top level), which
`decoder_config` normalises as transformers' InklingConfig does. Its weights have the
release's names (transformers' conversion_mapping.py, "inkling_mm_model"), and its gate and up
rows interleaved (gate, up, gate, ...) where transformers' class keeps them apart: one table,
`NAMES`, gives each tensor's name in both forms, and `layer_weights` reads it. Its vision and
audio towers and MTP layers are not part of the decoder: the conversion leaves them out and
says so.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.families.facts import COMMON, GQA, MOE, ROUTED_EXPERTS, Key, dense_prefix, window
from miles.families.family import GPTFamily, UnmappedModel
from miles.families.schema import COMMON_SCHEMA, GQA_SCHEMA, TOPK, AtMost, Divides, Int, LayerIds, PerLayer
from miles.families.weights import Piece, Weights, whole
from miles.parallel import FamilyLimits

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


# Each tensor of a decoder layer, by megatron name (under the layer's prefix), with its name in
# transformers' class (inkling_text: model.layers.{i}.*) and in the release (model.llm.layers.{i}.*).
NAMES: Mapping[str, tuple[str, str]] = {
    "self_attention.linear_qkv.layer_norm_weight": ("input_layernorm.weight", "attn_norm.weight"),
    "q": ("self_attn.q_proj.weight", "attn.wq_du.weight"),
    "k": ("self_attn.k_proj.weight", "attn.wk_dv.weight"),
    "v": ("self_attn.v_proj.weight", "attn.wv_dv.weight"),
    "r": ("self_attn.r_proj.weight", "attn.wr_du.weight"),
    "self_attention.k_sconv.weight": ("self_attn.k_sconv.conv1d.weight", "attn.k_sconv.weight"),
    "self_attention.v_sconv.weight": ("self_attn.v_sconv.conv1d.weight", "attn.v_sconv.weight"),
    "self_attention.q_layernorm.weight": ("self_attn.q_norm.weight", "attn.q_norm.weight"),
    "self_attention.k_layernorm.weight": ("self_attn.k_norm.weight", "attn.k_norm.weight"),
    "self_attention.rel_proj.weight": ("self_attn.rel_logits_proj.proj", "attn.rel_logits_proj.proj"),
    "self_attention.linear_proj.weight": ("self_attn.o_proj.weight", "attn.wo_ud.weight"),
    "self_attention.attn_sconv.weight": ("attn_sconv.conv1d.weight", "attn_sconv.weight"),
    "post_norm": ("post_attention_layernorm.weight", "mlp_norm.weight"),
    "mlp.mlp_sconv.weight": ("mlp_sconv.conv1d.weight", "mlp_sconv.weight"),
    # the dense MLP: [gate; up] from two tensors, or from the release's interleaved w13
    "dense.gate_up": ("mlp.gate_proj.weight+mlp.up_proj.weight", "mlp.w13_dn.weight"),
    "dense.down": ("mlp.down_proj.weight", "mlp.w2_md.weight"),
    "mlp.global_scale": ("mlp.global_scale", "mlp.global_scale"),
    "mlp.router.weight": ("mlp.gate.weight", "mlp.gate.weight"),
    "mlp.router.global_scale": ("mlp.gate.global_scale", "mlp.gate.global_scale"),
    "mlp.router.expert_bias": ("mlp.gate.e_score_correction_bias", "mlp.gate.bias"),
    # stacked [experts, rows, hidden]: transformers fuses [gate; up], the release interleaves them
    "experts.gate_up": ("mlp.experts.gate_up_proj", "mlp.experts.w13_weight"),
    "experts.down": ("mlp.experts.down_proj", "mlp.experts.w2_weight"),
    # stacked [shared, rows, hidden]: transformers keeps gate and up apart, the release interleaves them
    "shared.gate_up": ("mlp.shared_experts.gate_proj+mlp.shared_experts.up_proj", "mlp.shared_experts.shared_w13_weight"),
    "shared.down": ("mlp.shared_experts.down_proj", "mlp.shared_experts.shared_w2_weight"),
}  # fmt: skip


def release_names(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == RELEASE


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


def _gate_up(name: str, rows: int, index: int | None, release: bool) -> tuple[Piece, ...]:
    """megatron's [gate; up] of `rows` each: from the release's interleaved rows (gate, up, gate,
    up, ...: two pieces of step 2), from two tensors ("gate+up"), or from one fused [gate; up]."""
    if release:
        return (Piece(name, 0, 2 * rows, 0, index, 2), Piece(name, 1, 2 * rows, rows, index, 2))
    if "+" in name:
        gate, up = name.split("+")
        return (Piece(gate, 0, rows, 0, index), Piece(up, 0, rows, rows, index))
    return (Piece(name, 0, 2 * rows, 0, index),)


# switches transformers' Inkling hard-codes, which SGLang reads: a config asking otherwise
# describes a model neither transformers nor miles computes
_ON = ("use_sconv", "use_embed_norm", "use_global_scale", "shared_expert_sink", "norm_after_topk")
_OFF = ("q_bias", "o_bias", "attention_bias", "mlp_bias", "final_logit_softcapping", "tie_word_embeddings")


class Inkling(GPTFamily):
    name = "inkling"
    model_types = ("inkling_text", RELEASE)
    attention = "gqa"
    keys = (
        *COMMON, *GQA, *MOE, *ROUTED_EXPERTS,
        Key("dense_mlp_idx", "--moe-layer-freq", dense_prefix),
        # its sliding-window layers' heads, the same counts as the global layers'
        Key("swa_num_attention_heads", "--num-attention-heads"),
        Key("swa_num_key_value_heads", "--num-query-groups"),
        Key("sliding_window_size", "--window-size", window),
        Key("global_layer_period", "--window-attn-skip-freq"),
    )  # fmt: skip
    read_by_model = {
        "conv_kernel_size": "miles.families.inkling.layers: the short convolutions on k, v and both branches",
        "d_rel": "miles.families.inkling.layers: the relative-bias states per head",
        "rel_extent": "miles.families.inkling.layers: the global layers' relative-bias extent",
        "log_scaling_n_floor": "miles.families.inkling.layers: the global layers' log scaling of q and the bias",
        "log_scaling_alpha": "miles.families.inkling.layers: the global layers' log scaling of q and the bias",
        "logits_mup_width_multiplier": "miles.families.inkling.layers: the final norm's output is divided by it",
    }
    # transformers' InklingTextConfig: its sizes and windows, the KV heads dividing the query heads
    # in both kinds of layer, the experts a token picks among the routed ones, its per-layer lists
    # and the sliding layers' ids (its layer_types derivation reads them as layer indices)
    schema = (
        *COMMON_SCHEMA, *GQA_SCHEMA,
        Int("swa_num_attention_heads", required=False), Int("swa_num_key_value_heads", required=False),
        Int("swa_head_dim", required=False),
        Int("sliding_window_size", required=False, why="keys the sliding-window attention sees"),
        Int("d_rel", required=False), Int("rel_extent", required=False), Int("conv_kernel_size", required=False),
        Int("moe_intermediate_size"), Int("n_routed_experts"), Int("num_experts_per_tok"),
        Int("n_shared_experts", 0, required=False), Int("dense_mlp_idx", 0, required=False),
        Int("num_mtp_layers", 0, required=False),
        Divides(
            "swa_num_attention_heads", "swa_num_key_value_heads",
            "each key/value head serves a whole group of query heads",
        ),
        AtMost("num_experts_per_tok", "n_routed_experts", TOPK),
        PerLayer("layer_types", ("hybrid_sliding", "hybrid")),
        PerLayer("mlp_layer_types", ("dense", "sparse")),
        LayerIds("local_layer_ids"),
    )  # fmt: skip
    schema_aliases = ALIASES
    router_classes = ("InklingTopkRouter",)
    tiny_model_type = "inkling_text"
    # Inkling-Small's switches at tiny sizes: a sliding layer then a global one, a dense first
    # layer then MoE, two shared experts, the logits' width multiplier 16, log scaling from 128000 tokens
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "intermediate_size": 384, "moe_intermediate_size": 64, "num_key_value_heads": 2, "head_dim": 32,
        "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 32, "sliding_window_size": 32,
        "rel_extent": 64, "d_rel": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "dense_mlp_idx": 1, "local_layer_ids": [0], "logits_mup_width_multiplier": 16.0, "log_scaling_n_floor": 128000,
    }  # fmt: skip
    position_embedding_type = "none"
    # checkpoint tensors outside the decoder the conversion leaves out: (prefix, what it is)
    not_decoder = (
        ("model.visual.", "the vision tower"),
        ("model.audio.", "the audio tower"),
        ("model.mtp.", "the MTP layers (speculative decoding; not built)"),
    )

    def limits(self, config: Mapping[str, Any]) -> FamilyLimits:
        return FamilyLimits(
            context_parallel=(
                "Inkling's short convolutions and relative bias read each token's preceding rows in order, "
                "which context parallelism splits"
            )
        )

    def schema_view(self, config: Mapping[str, Any]) -> Mapping[str, Any]:
        """The decoder's keys as written (text_config in a release), under InklingTextConfig's
        names (ALIASES); a release's `dense_intermediate_size` is the dense width, its
        `intermediate_size` then the experts' (as decoder_config reads them)."""
        text = config.get("text_config")
        out = super().schema_view(text if isinstance(text, Mapping) else config)
        if out.get("dense_intermediate_size") is not None:
            out["moe_intermediate_size"] = out.get("intermediate_size")
            out["intermediate_size"] = out["dense_intermediate_size"]
        return out

    def decoder_config(self, config: Mapping[str, Any]) -> dict:
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

    def outer_names(self, config: Mapping[str, Any]) -> tuple[str, str, str]:
        if release_names(config):
            return "model.llm.embed.weight", "model.llm.norm.weight", "model.llm.unembed.weight"
        return super().outer_names(config)

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        def refuse(message: str) -> None:
            raise UnmappedModel(f"config.json {message}")

        if config.get("model_type") not in ("inkling_text", RELEASE):
            refuse(
                f"model_type {config.get('model_type')!r}: the Megatron mapping reads inkling_text and {RELEASE} "
                "checkpoints"
            )
        if "text_config" in config:
            refuse(
                "text_config: the family reads the decoder's config (miles.families.decoder_config of "
                "config.json), not the release's top level"
            )
        for key in _ON:
            if key in config and not config[key]:
                refuse(
                    f"{key}=false: transformers' Inkling always applies it, so miles does too; remove the key"
                )
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

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        """The TransformerConfig fields of the model beyond the facts table's (the attention's own
        dims per layer are read by layers.py from the config itself)."""
        import torch

        from miles.families.transformer import model_fields

        config = normalised(config)
        fields = model_fields(self.keys, config)
        fields.setdefault("layernorm_epsilon", 1e-6)  # InklingTextConfig's rms_norm_eps
        fields.setdefault("kv_channels", int(config.get("head_dim") or 128))
        fields.pop("moe_shared_expert_intermediate_size", None)  # miles.families.inkling.layers builds them
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

    def layer_weights(self, config: Mapping[str, Any], i: int, mg: str) -> Weights:
        """The weights of decoder layer `i` of the checkpoint, under megatron layer prefix `mg`, in
        the names its form uses (`NAMES`)."""
        from miles.families.inkling.layers import attention_dims

        config = normalised(config)
        release = release_names(config)
        hf = f"model.llm.layers.{i}." if release else f"model.layers.{i}."

        def name(role: str) -> str:
            return "+".join(hf + part for part in NAMES[role][release].split("+"))

        hidden, dims = int(config["hidden_size"]), attention_dims(config, i)
        kv = dims["groups"] * dims["dim"]
        at = mg + "self_attention."
        yield (
            at + "linear_qkv.layer_norm_weight",
            (whole(name("self_attention.linear_qkv.layer_norm_weight"), hidden),),
        )
        yield at + "linear_qkv.weight", _qkvr_pieces(tuple(name(p) for p in "qkvr"), dims)
        for leaf, rows in (("k_sconv", kv), ("v_sconv", kv), ("q_layernorm", dims["dim"]), ("k_layernorm", dims["dim"]),
                           ("rel_proj", dims["d_rel"]), ("linear_proj", hidden), ("attn_sconv", hidden)):  # fmt: skip
            yield f"{at}{leaf}.weight", (whole(name(f"self_attention.{leaf}.weight"), rows),)
        post_norm = (whole(name("post_norm"), hidden),)
        yield mg + "mlp.mlp_sconv.weight", (whole(name("mlp.mlp_sconv.weight"), hidden),)
        if not moe_layers(config)[i]:
            width = int(config["intermediate_size"])
            yield mg + "mlp.linear_fc1.layer_norm_weight", post_norm
            yield mg + "mlp.linear_fc1.weight", _gate_up(name("dense.gate_up"), width, None, release)
            yield mg + "mlp.linear_fc2.weight", (whole(name("dense.down"), hidden),)
            yield mg + "mlp.global_scale", (whole(name("mlp.global_scale"), 1),)
            return
        experts, shared = int(config["n_routed_experts"]), int(config["n_shared_experts"])
        width = int(config["moe_intermediate_size"])
        yield mg + "pre_mlp_layernorm.weight", post_norm
        yield mg + "mlp.router.weight", (whole(name("mlp.router.weight"), experts + shared),)
        yield mg + "mlp.router.global_scale", (whole(name("mlp.router.global_scale"), 1),)
        yield mg + "mlp.router.expert_bias", (whole(name("mlp.router.expert_bias"), experts),)
        for e in range(experts):
            to = mg + f"mlp.experts.local_experts.{e}."
            yield to + "linear_fc1.weight", _gate_up(name("experts.gate_up"), width, e, release)
            yield to + "linear_fc2.weight", (Piece(name("experts.down"), 0, hidden, 0, e),)
        for j in range(shared):
            to = mg + f"mlp.shared_experts.experts.{j}."
            yield to + "linear_fc1.weight", _gate_up(name("shared.gate_up"), width, j, release)
            yield to + "linear_fc2.weight", (Piece(name("shared.down"), 0, hidden, 0, j),)

    def embedding_weights(self, config: Mapping[str, Any]) -> Weights:
        name = (
            "model.llm.embed_norm.weight" if release_names(config) else "model.embed_tokens.embed_norm.weight"
        )
        yield "embedding.embed_norm.weight", (whole(name, int(config["hidden_size"])),)

    def block_spec(self, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"):
        from miles.families.inkling import layers

        return layers.block_spec(tc, normalised(config), vp_stage, impl=impl)

    def finish_model(
        self, model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
    ) -> None:
        """The embedding's norm on the first stage; fp32 convolutions and router scale; refuse
        context parallelism (its limits: the convolutions and the relative bias need each row's whole
        prefix in order, which miles' zigzag context split does not give)."""
        from miles.families.inkling import layers

        problem = self.limits(config).cp_problem(tc.context_parallel_size)
        if problem:
            raise UnmappedModel(problem)
        if model.pre_process:
            layers.add_embedding_norm(model, float(config.get("rms_norm_eps", 1e-6)))
        layers.keep_fp32(model)

    def lm_args(self, config: Mapping[str, Any]) -> dict:
        out = {"position_embedding_type": "none", "qk_layernorm": True}
        moe = moe_layers(config)
        if any(moe):
            out.update(
                moe_layer_freq=[int(m) for m in moe],
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
            )
        return out


FAMILY = Inkling()
