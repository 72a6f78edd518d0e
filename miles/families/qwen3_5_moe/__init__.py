"""Qwen3.5-MoE (Qwen3.5-35B-A3B; transformers' Qwen3_5MoeForConditionalGeneration, model_type qwen3_5_moe) as megatron-core GPTModel.

The release is a vision-language model: config.json nests the decoder under `text_config`, the
checkpoint names it `model.language_model.*` beside the vision tower `model.visual.*` (left out:
miles trains the text decoder; `not_decoder` names it) and the MTP block `mtp.*`. The decoder mixes
two kinds of layer (`layer_types`, every fourth full): linear-attention layers, megatron-core's
GatedDeltaNet (`gdn.py`: its output norm, context parallelism), and full attention with an output
gate (`attention_output_gate`: q_proj holds each head's query and gate), zero-centred q/k norms and
rope on the first quarter of each head (`partial_rotary_factor`). Every layer is MoE: softmax top-k
renormalised, and a shared expert scaled by sigmoid(shared_expert_gate). Every RMS norm but the
gated one computes x * (1 + w) (`layernorm_zero_centered_gamma`). M-RoPE (`mrope_section`) rotates
text tokens, whose three position ids are equal, exactly as plain rope does.

Weights (transformers names on the right, L = model.language_model.layers.i): a linear-attention
layer's self_attention.in_proj [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a] with
layer_norm_weight [input_layernorm], conv1d, dt_bias, A_log, out_norm [norm], out_proj; a full
layer's linear_qkv per query group [its heads' queries; their gates; k; v] with layer_norm_weight,
q_layernorm/k_layernorm [q_norm/k_norm], linear_proj [o_proj]; the MoE as Qwen3-MoE's (experts one
tensor each, as transformers saves them), shared_experts.linear_fc1/fc2 and gate_weight
[shared_expert_gate]. MTP layer k (DeepSeek-V3 style in megatron) is mtp.layers.k.{enorm
[mtp.pre_fc_norm_embedding], hnorm [mtp.pre_fc_norm_hidden], eh_proj [mtp.fc], final_layernorm
[mtp.norm], transformer_layer [mtp.layers.k.*]}.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from miles.families.facts import ABSENT, COMMON, GQA, MOE, Fixed, Key, rope_parameters
from miles.families.family import GPTFamily, UnmappedModel
from miles.families.schema import COMMON_SCHEMA, TOPK, AtMost, Divides, Int, PerLayer, Real
from miles.families.weights import Piece, Weights, gate_up_pieces, whole
from miles.parallel import FamilyLimits

_CLASS = "transformers' Qwen3_5MoeForConditionalGeneration"
TEXT = "model.language_model."
LINEAR, FULL = "linear_attention", "full_attention"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # the release, and its text_config
_EXPERT = re.compile(
    r"^(?P<base>.+\.mlp\.experts\.)(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def mtp_layers(config: Mapping[str, Any]) -> int:
    return int(config.get("mtp_num_hidden_layers") or 0)


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """Each decoder layer's kind, as Qwen3_5MoeTextConfig derives it when config.json has no list."""
    written = config.get("layer_types")
    if written:
        return list(written)
    every = int(config.get("full_attention_interval") or 4)
    return [LINEAR if (i + 1) % every else FULL for i in range(int(config["num_hidden_layers"]))]


def _rotary_percent(config: Mapping[str, Any]) -> object:
    return rope_parameters(config).get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))


def _ours(derive):
    """A key's fallback for this family's configs only (every family's rows read other configs too)."""

    def fallback(config: Mapping[str, Any]) -> object:
        if config.get("model_type") not in MODEL_TYPES or "num_hidden_layers" not in config:
            return ABSENT
        return derive(config)

    return fallback


def _linear_pattern(value: object, config: Mapping[str, Any]) -> object:
    return [int(kind == LINEAR) for kind in layer_types(config)]


# Megatron-LM takes the gated delta net's sizes as flags; the reference passes none (its layer spec reads
# config.json), and neither does miles' family, which builds the layer from config.json
_GDN_READ = "not passed: the family builds the gated delta net from config.json, as the reference's spec does"


class Qwen3_5Moe(GPTFamily):
    name = "qwen3_5_moe"
    model_types = MODEL_TYPES
    attention = "gqa"
    keys = (
        *COMMON, *GQA, *MOE,
        Key("num_experts", "--num-experts"),
        Key("shared_expert_intermediate_size", "--moe-shared-expert-intermediate-size"),
        Key("partial_rotary_factor", "--rotary-percent", fallback=_ours(_rotary_percent)),
        Key("layer_types", "--linear-attention-freq", _linear_pattern, fallback=_ours(layer_types)),
        Key("linear_conv_kernel_dim", "--linear-conv-kernel-dim", optional=_GDN_READ),
        Key("linear_key_head_dim", "--linear-key-head-dim", optional=_GDN_READ),
        Key("linear_value_head_dim", "--linear-value-head-dim", optional=_GDN_READ),
        Key("linear_num_key_heads", "--linear-num-key-heads", optional=_GDN_READ),
        Key("linear_num_value_heads", "--linear-num-value-heads", optional=_GDN_READ),
        Key("mtp_num_hidden_layers", "--mtp-num-layers", default=0, describes_model=False),
    )  # fmt: skip
    fixed = (
        Fixed("--attention-output-gate", True, f"{_CLASS} gates each head's output by sigmoid of q_proj's gate half"),
        Fixed("--moe-shared-expert-gate", True, f"{_CLASS} scales the shared expert by sigmoid(shared_expert_gate)"),
        Fixed("--apply-layernorm-1p", True, f"{_CLASS}'s RMS norms compute x * (1 + weight)"),
        Fixed("--qk-layernorm", True, f"{_CLASS} normalises each head's query and key"),
        Fixed("--moe-router-score-function", "softmax", f"{_CLASS} routes by softmax scores"),
        Fixed("--experimental-attention-variant", "gated_delta_net", f"{_CLASS}'s linear attention layers"),
    )  # fmt: skip
    read_by_model = {
        "full_attention_interval": "miles.families.qwen3_5_moe: which layers are full attention when layer_types is absent",
        "mrope_section": "rope: text tokens' three position ids are equal, so M-RoPE is rope (refused for images)",
    }
    schema = (
        *COMMON_SCHEMA,
        Int("num_key_value_heads"), Int("head_dim"),
        Divides("num_attention_heads", "num_key_value_heads", "each key/value head serves a whole group of query heads"),
        Int("num_experts"), Int("num_experts_per_tok"), Int("moe_intermediate_size"),
        Int("shared_expert_intermediate_size", 0, required=False),
        Int("linear_conv_kernel_dim"), Int("linear_key_head_dim"), Int("linear_value_head_dim"),
        Int("linear_num_key_heads"), Int("linear_num_value_heads"),
        Int("mtp_num_hidden_layers", 0, required=False), Int("full_attention_interval", required=False),
        Real("partial_rotary_factor", required=False),
        AtMost("num_experts_per_tok", "num_experts", TOPK),
        PerLayer("layer_types", (LINEAR, FULL)),
    )  # fmt: skip
    schema_aliases = {"num_local_experts": "num_experts"}
    router_classes = ("Qwen3_5MoeTopKRouter",)
    not_decoder = (("model.visual.", "the vision tower (miles trains the text decoder)"),)
    renames_on_load = True  # AutoModelForCausalLM loads the release's model.language_model.* as model.*
    tiny_model_type = "qwen3_5_moe"
    tiny_class = "Qwen3_5MoeForConditionalGeneration"  # the release's class: its names, a vision tower
    # Qwen3.5-35B-A3B's switches at tiny sizes: 3 linear layers then a full one, 2 value heads per
    # key head, GQA 4:1, head_dim 2x hidden/heads with a quarter rotated, rope theta 1e7, a shared
    # expert, one MTP layer; a one-block vision tower.
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 4096, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "mtp_num_hidden_layers": 1, "full_attention_interval": 4,
        "rope_parameters": {
            "rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
            "mrope_interleaved": True, "mrope_section": [2, 1, 1],
        },
    }  # fmt: skip
    tiny_vision = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
    }
    tiny_layers = 4
    mtp_style = "mtp_layers"
    mtp_layer_kinds = {"layer_types": FULL}  # the release's MTP layer is full attention
    fp8_keep = frozenset({"fc", "in_proj_a", "in_proj_b"})
    probe_length = 80  # past one 64-token chunk of the gated delta rule

    def tiny_config(self, values: Mapping[str, Any]) -> dict:
        """AutoConfig.for_model's arguments: the decoder's under text_config, a tiny vision tower."""
        text = {k: v for k, v in values.items() if k not in ("tie_word_embeddings",)}
        return {"text_config": text, "vision_config": dict(self.tiny_vision),
                "tie_word_embeddings": bool(values.get("tie_word_embeddings", False))}  # fmt: skip

    def decoder_config(self, config: Mapping[str, Any]) -> dict:
        out = super().decoder_config(config)
        if "tie_word_embeddings" in config and "tie_word_embeddings" not in out:
            out["tie_word_embeddings"] = config["tie_word_embeddings"]
        return out

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        def refuse(message: str) -> None:
            raise UnmappedModel(f"config.json {message}")

        if config.get("attention_bias"):
            refuse("attention_bias=true is not mapped (Qwen3.5 has no attention biases)")
        if config.get("hidden_act", "silu") != "silu":
            refuse(
                f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU, the conv's activation) is mapped"
            )
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") != "default":
            refuse(f"rope_type {rope.get('rope_type')!r} is not mapped for qwen3_5_moe (its default rope is)")
        if config.get("attention_dropout"):
            refuse(f"attention_dropout {config['attention_dropout']}: Qwen3.5 trains without; remove it")
        if int(config["linear_num_value_heads"]) % int(config["linear_num_key_heads"]):
            refuse(
                f"linear_num_value_heads {config['linear_num_value_heads']} is not a multiple of linear_num_key_heads "
                f"{config['linear_num_key_heads']}: each key head serves a whole group of value heads"
            )
        if config.get("mtp_use_dedicated_embeddings"):
            refuse("mtp_use_dedicated_embeddings=true: megatron's MTP layer reads the model's embedding")
        if mtp_layers(config) > 1:
            refuse(
                f"mtp_num_hidden_layers {mtp_layers(config)}: the checkpoint has one mtp.fc and mtp.norm for the "
                "MTP block, mapped to one megatron MTP layer; the release has 1"
            )
        if mtp_layers(config) and layer_types(config)[-1] != FULL:
            refuse(
                "mtp_num_hidden_layers with a linear-attention last layer: the MTP layer (full attention in "
                "the release) is built like the last layer"
            )
        if len(layer_types(config)) != int(config["num_hidden_layers"]):
            refuse(
                f"layer_types has {len(layer_types(config))} entries for {config['num_hidden_layers']} layers"
            )

    def limits(self, config: Mapping[str, Any]) -> FamilyLimits:
        # a key config.json leaves out has Qwen3_5MoeTextConfig's default
        keys = int(config.get("linear_num_key_heads") or 16)
        values = int(config.get("linear_num_value_heads") or 32)
        return FamilyLimits(
            tp_divides=(
                ("linear_num_key_heads", keys, "the gated delta net splits its key heads"),
                ("linear_num_value_heads", values, "the gated delta net splits its value heads"),
            )
        )

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        import torch

        from miles.families.transformer import model_fields

        fields = model_fields(self.keys, config)
        fields.update(
            ffn_hidden_size=int(config["moe_intermediate_size"]),
            normalization="RMSNorm",
            layernorm_zero_centered_gamma=True,
            layernorm_epsilon=float(config.get("rms_norm_eps") or 1e-6),
            qk_layernorm=True,
            attention_output_gate=True,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            rotary_interleaved=False,
            apply_rope_fusion=False,
            # experimental_attention_variant stays unset: it selects megatron-core's experimental block
            # spec (TE only; block_spec builds the layers here) and refuses context parallelism, which
            # gdn.py adds; its other checks (TP divides the heads) are `limits`
            linear_attention_freq=_linear_pattern(None, config),  # per-layer checkpoint keys
            linear_conv_kernel_dim=int(config["linear_conv_kernel_dim"]),
            linear_key_head_dim=int(config["linear_key_head_dim"]),
            linear_value_head_dim=int(config["linear_value_head_dim"]),
            linear_num_key_heads=int(config["linear_num_key_heads"]),
            linear_num_value_heads=int(config["linear_num_value_heads"]),
            moe_layer_freq=[1] * int(config["num_hidden_layers"]),
            moe_router_pre_softmax=False,  # softmax over the top-k logits: the renormalised top-k probs
            moe_router_score_function="softmax",
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type="alltoall",
            moe_shared_expert_overlap=False,
            moe_shared_expert_gate=bool(config.get("shared_expert_intermediate_size")),
        )
        return fields

    def rotary_percent(self, config: Mapping[str, Any]) -> float:
        return float(_rotary_percent(config))

    def lm_args(self, config: Mapping[str, Any]) -> dict:
        return {
            "position_embedding_type": "rope",
            "rotary_percent": float(_rotary_percent(config)),
            "apply_layernorm_1p": True,
            "qk_layernorm": True,
            "attention_output_gate": True,
            "moe_shared_expert_gate": True,
            "experimental_attention_variant": "gated_delta_net",
            "linear_attention_freq": _linear_pattern(None, config),
            "mtp_num_layers": mtp_layers(config) or None,
        }

    def model_name(self, name: str) -> str:
        """transformers' Qwen3_5MoeForCausalLM (what AutoModelForCausalLM loads the release as) names the
        decoder model.* and drops the vision tower and the MTP block."""
        return "model." + name.removeprefix(TEXT) if name.startswith(TEXT) else name

    def source_name(self, name: str, present) -> str:
        """A text-only save (Qwen3_5MoeForCausalLM's) names the decoder model.* rather than model.language_model.*."""
        if name not in present and name.startswith(TEXT):
            plain = "model." + name.removeprefix(TEXT)
            if plain in present:
                return plain
        return name

    def source_piece(self, piece: Piece, present) -> Piece:
        """The release stacks its decoder layers' experts ([experts, 2 x width, hidden] gate_up_proj, [experts,
        hidden, width] down_proj) where transformers saves one tensor per expert: expert e's rows of them."""
        from dataclasses import replace

        name = self.source_name(piece.hf_name, present)
        found = _EXPERT.match(name)
        if name in present or found is None:
            return replace(piece, hf_name=name)
        down = found["proj"] == "down_proj"
        stacked = found["base"] + ("down_proj" if down else "gate_up_proj")
        if stacked not in present:
            return replace(piece, hf_name=name)  # the converter names the missing tensor
        shift = piece.stop if found["proj"] == "up_proj" else 0  # [gate; up]: up's rows follow gate's
        return replace(
            piece, hf_name=stacked, start=piece.start + shift, stop=piece.stop + shift, index=int(found["e"])
        )

    def outer_names(self, config: Mapping[str, Any]) -> tuple[str, str, str]:
        return TEXT + "embed_tokens.weight", TEXT + "norm.weight", "lm_head.weight"

    def layer_weights(self, config: Mapping[str, Any], i: int, mg: str, hf: str | None = None) -> Weights:
        """Decoder layer `i` (or, with `hf`, the MTP layer under that prefix) under megatron prefix `mg`."""
        hidden = int(config["hidden_size"])
        kind = FULL if hf is not None else layer_types(config)[i]
        hf = hf if hf is not None else f"{TEXT}layers.{i}."
        norm = (whole(hf + "input_layernorm.weight", hidden),)
        at = mg + "self_attention."
        if kind == LINEAR:
            src = hf + "linear_attn."
            kd = int(config["linear_key_head_dim"]) * int(config["linear_num_key_heads"])
            vd = int(config["linear_value_head_dim"]) * int(config["linear_num_value_heads"])
            heads, conv = int(config["linear_num_value_heads"]), 2 * kd + vd
            yield at + "in_proj.layer_norm_weight", norm
            yield (
                at + "in_proj.weight",
                (
                    whole(src + "in_proj_qkv.weight", conv),
                    whole(src + "in_proj_z.weight", vd, conv),
                    whole(src + "in_proj_b.weight", heads, conv + vd),
                    whole(src + "in_proj_a.weight", heads, conv + vd + heads),
                ),
            )
            yield at + "conv1d.weight", (whole(src + "conv1d.weight", conv),)
            yield at + "dt_bias", (whole(src + "dt_bias", heads),)
            yield at + "A_log", (whole(src + "A_log", heads),)
            yield at + "out_norm.weight", (whole(src + "norm.weight", int(config["linear_value_head_dim"])),)
            yield at + "out_proj.weight", (whole(src + "out_proj.weight", hidden),)
        else:
            src = hf + "self_attn."
            yield at + "linear_qkv.layer_norm_weight", norm
            yield (
                at + "linear_qkv.weight",
                gated_qkv_pieces(
                    src,
                    int(config["num_attention_heads"]),
                    int(config["num_key_value_heads"]),
                    int(config["head_dim"]),
                ),
            )
            yield at + "q_layernorm.weight", (whole(src + "q_norm.weight", int(config["head_dim"])),)
            yield at + "k_layernorm.weight", (whole(src + "k_norm.weight", int(config["head_dim"])),)
            yield at + "linear_proj.weight", (whole(src + "o_proj.weight", hidden),)
        yield from self._moe_weights(config, mg, hf)

    def _moe_weights(self, config: Mapping[str, Any], mg: str, hf: str) -> Weights:
        hidden, width = int(config["hidden_size"]), int(config["moe_intermediate_size"])
        yield mg + "pre_mlp_layernorm.weight", (whole(hf + "post_attention_layernorm.weight", hidden),)
        yield mg + "mlp.router.weight", (whole(hf + "mlp.gate.weight", int(config["num_experts"])),)
        for e in range(int(config["num_experts"])):  # one tensor per expert, as transformers saves them
            to = mg + f"mlp.experts.local_experts.{e}."
            yield to + "linear_fc1.weight", gate_up_pieces(f"{hf}mlp.experts.{e}.", width)
            yield to + "linear_fc2.weight", (whole(f"{hf}mlp.experts.{e}.down_proj.weight", hidden),)
        shared = int(config.get("shared_expert_intermediate_size") or 0)
        if shared:
            yield (
                mg + "mlp.shared_experts.linear_fc1.weight",
                gate_up_pieces(hf + "mlp.shared_expert.", shared),
            )
            yield (
                mg + "mlp.shared_experts.linear_fc2.weight",
                (whole(hf + "mlp.shared_expert.down_proj.weight", hidden),),
            )
            yield mg + "mlp.shared_experts.gate_weight", (whole(hf + "mlp.shared_expert_gate.weight", 1),)

    def extra_weights(self, config: Mapping[str, Any]) -> Weights:
        hidden = int(config["hidden_size"])
        for k in range(mtp_layers(config)):
            mg = f"mtp.layers.{k}."
            yield mg + "enorm.weight", (whole("mtp.pre_fc_norm_embedding.weight", hidden),)
            yield mg + "hnorm.weight", (whole("mtp.pre_fc_norm_hidden.weight", hidden),)
            yield mg + "eh_proj.weight", (whole("mtp.fc.weight", hidden),)
            yield mg + "final_layernorm.weight", (whole("mtp.norm.weight", hidden),)
            yield from self.layer_weights(config, -1, mg + "transformer_layer.", hf=f"mtp.layers.{k}.")

    def mtp_extras(self, prefix: str, config: Mapping[str, Any], hidden: int) -> Iterator[tuple]:
        """The MTP block's projection of [embedding; hidden state] and its three norms (shared by its layers)."""
        if prefix != "mtp.layers.0.":
            return
        yield "mtp.fc.weight", (hidden, 2 * hidden), "model"
        for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            yield f"mtp.{norm}.weight", (hidden,), "norm"

    def tiny_values(self, model: Any, gen: Any) -> None:
        """Norms away from their start (0 for the zero-centred ones, 1 for the gated one)."""
        import torch

        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and ".visual." not in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)

    def block_spec(self, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"):
        """The Transformer Engine GPT spec's layers with megatron-core's gated delta net on the linear ones."""
        from dataclasses import replace

        from megatron.core.transformer.identity_op import IdentityOp
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        from miles.families.qwen3_5_moe.gdn import gdn_spec
        from miles.megatron.spec import decoder_block_spec, layer_provider

        block = decoder_block_spec(tc, impl=impl, vp_stage=vp_stage)
        mixer = gdn_spec(layer_provider(impl))
        kinds = layer_types(config)
        first = get_transformer_layer_offset(tc, vp_stage=vp_stage)
        layers = [
            replace(s, submodules=replace(s.submodules, self_attention=mixer, input_layernorm=IdentityOp))
            if kinds[first + j] == LINEAR
            else s
            for j, s in enumerate(block.layer_specs)
        ]
        return replace(block, layer_specs=layers)

    def finish_model(
        self, model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
    ):
        """On the last stage, carry the MTP layers (built like the last layer: full attention, MoE)."""
        from miles.megatron.mtp import carry_mtp

        carry_mtp(model, tc, mtp_layers(config), impl, vp_stage)


def gated_qkv_pieces(prefix: str, heads: int, groups: int, dim: int) -> tuple[Piece, ...]:
    """linear_qkv with an output gate holds, per query group, its heads' queries, their gates, k, v;
    transformers' q_proj holds each head's [query; gate]."""
    per = heads // groups
    block = (2 * per + 2) * dim
    pieces = []
    for g in range(groups):  # in the order of their rows in linear_qkv
        for half in (0, 1):  # the group's queries, then their gates
            for j in range(per):
                h = g * per + j
                start = (2 * h + half) * dim
                pieces.append(
                    Piece(prefix + "q_proj.weight", start, start + dim, g * block + (half * per + j) * dim)
                )
        pieces.append(Piece(prefix + "k_proj.weight", g * dim, (g + 1) * dim, g * block + 2 * per * dim))
        pieces.append(
            Piece(prefix + "v_proj.weight", g * dim, (g + 1) * dim, g * block + (2 * per + 1) * dim)
        )
    return tuple(pieces)


FAMILY = Qwen3_5Moe()
