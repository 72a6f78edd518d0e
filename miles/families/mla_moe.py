"""What GLM's DeepSeek-V3-style families share: multi-latent attention, sigmoid-routed experts, MTP layers.

`MlaMoeFamily` is a GPTFamily for transformers' GlmMoeDsa and Glm4MoeLite: MLA with q and kv
latents (their norms fused into the up-projections, at eps 1e-6 as transformers builds them),
dense first layers, then MoE layers whose sigmoid router picks experts by score plus an expert
bias that does not weight them, top-k weights renormalised and scaled, and shared experts. The
MTP layers (`model.layers.{L+k}.*`: enorm, hnorm, eh_proj, shared_head.norm and a decoder layer
built like the last one) are carried as megatron-core's `mtp.layers.k`, frozen unless --enable-mtp-training trains them (miles.megatron.mtp).
A family adds its attention's own keys, weights and spec (GLM-5's DSA indexer) by overriding
the hooks here. Standard library only.

Weights (transformers names on the right): the layer's input norm; linear_q_down_proj
[q_a_proj], linear_q_up_proj [q_b_proj] with the q latent norm fused (layer_norm_weight
[q_a_layernorm]) or, without a q latent, linear_q_proj [q_proj]; linear_kv_down_proj
[kv_a_proj_with_mqa], linear_kv_up_proj [kv_b_proj] with layer_norm_weight [kv_a_layernorm],
linear_proj [o_proj]; the MLP as Qwen3's, plus mlp.router.expert_bias
[mlp.gate.e_score_correction_bias] and mlp.shared_experts.linear_fc1/fc2; MTP layer k as
mtp.layers.k.{enorm, hnorm, eh_proj, final_layernorm [shared_head.norm], transformer_layer.*}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from miles.families.facts import COMMON, MOE, MTP, ROUTED_EXPERTS, Fixed, Key, rope_parameters, value
from miles.families.family import GPTFamily, UnmappedModel
from miles.families.weights import Weights, dense_mlp, gate_up_pieces, whole


def mtp_layers(config: Mapping[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


def experts_per_token(config: Mapping[str, Any]) -> int:
    return int(config.get("num_experts_per_tok") or 1)


def refuse(message: str) -> None:
    raise UnmappedModel(f"config.json {message}")


# The rows every such family has: MLA's sizes, DeepSeek's routed and shared experts, MTP layers.
MLA_MOE_KEYS: tuple[Key, ...] = (
    *COMMON, *MOE, *ROUTED_EXPERTS, *MTP,
    # MLA expands its KV latent to one key and value per attention head. config.json's head_dim is
    # the rope part (the configs' attribute_map says so), not the value head: no row reads it.
    Key("num_key_value_heads", "--num-attention-heads", describes_model=False),
    Key("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
    Key("q_lora_rank", "--q-lora-rank"),
    Key("kv_lora_rank", "--kv-lora-rank"),
    Key("qk_nope_head_dim", "--qk-head-dim"),
    Key("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
    Key("v_head_dim", "--v-head-dim"),
)  # fmt: skip


def mla_moe_fixed(cls: str) -> tuple[Fixed, ...]:
    """The flags the architecture of transformers' class `cls` fixes."""
    return (
        Fixed("--multi-latent-attention", True, f"{cls} attends with MLA"),
        Fixed("--moe-router-score-function", "sigmoid", f"{cls} routes by sigmoid scores"),
        Fixed("--moe-router-enable-expert-bias", True, f"{cls} selects experts with e_score_correction_bias"),
        Fixed(
            "--moe-router-bias-update-rate", 0,
            f"{cls} keeps e_score_correction_bias as a buffer nothing updates, and miles trains it so",
        ),
    )  # fmt: skip


class MlaMoeFamily(GPTFamily):
    """MLA, DeepSeek-style experts and DeepSeek-V3-style MTP layers; the hooks below are a family's own."""

    attention = "mla"
    # how refusals name the model and its attention ("GLM-5", "DSA")
    published: ClassVar[str]
    attention_label: ClassVar[str] = "MLA"
    mtp_style = "layers"
    # the MTP block's projection stays bf16 (SGLang loads it so)
    fp8_keep = frozenset({"eh_proj"})
    config_class = "MLATransformerConfig"

    # --- hooks -------------------------------------------------------------------------------------

    def moe_layers(self, config: Mapping[str, Any]) -> list[bool]:
        """Which layers (the MTP layers too, after the decoder's) are MoE."""
        raise NotImplementedError(self.name)

    def attention_weights(self, config: Mapping[str, Any], i: int, at: str) -> Weights:
        """Layer `i`'s attention weights beyond MLA's, under megatron prefix `at`."""
        return iter(())

    def attention_fields(self, config: Mapping[str, Any]) -> dict:
        """TransformerConfig fields the family's attention sets beyond MLA's."""
        return {}

    def refuse_attention(self, config: Mapping[str, Any]) -> None:
        """Refusals of the family's own attention (UnmappedModel, through `refuse`)."""

    # --- the shared model --------------------------------------------------------------------------

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        if config.get("attention_bias") or config.get("mlp_bias"):
            refuse(
                f"attention_bias/mlp_bias=true is not mapped to megatron ({self.published} checkpoints have no biases)"
            )
        if config.get("hidden_act", "silu") != "silu":
            refuse(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is mapped")
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") != "default":
            refuse(
                f"rope_type {rope.get('rope_type')!r} is not mapped for {self.name} "
                f"({self.published}'s default rope is)"
            )
        if config.get("num_key_value_heads", config["num_attention_heads"]) != config["num_attention_heads"]:
            refuse(
                f"num_key_value_heads {config['num_key_value_heads']} != num_attention_heads "
                f"{config['num_attention_heads']}: MLA expands its KV latent to every head, and transformers would "
                f"then repeat them again; {self.published} keeps them equal"
            )
        if config.get("attention_dropout"):
            refuse(
                f"attention_dropout {config['attention_dropout']}: megatron-core's {self.attention_label} "
                "attention applies none"
            )
        self.refuse_attention(config)
        if not config.get("norm_topk_prob", True) or experts_per_token(config) == 1:
            refuse(
                "norm_topk_prob=false or num_experts_per_tok=1: megatron-core renormalises sigmoid top-k weights "
                f"exactly when more than one expert is picked; {self.published} renormalises them"
            )
        groups, topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        if groups > 1 and experts_per_token(config) // topk_group != 2:
            refuse(
                f"n_group {groups} with topk_group {topk_group} and num_experts_per_tok {experts_per_token(config)}: "
                "transformers scores a group by its top-2 experts, megatron-core by its top "
                "num_experts_per_tok // topk_group; they agree only when that is 2"
            )
        if mtp_layers(config) and not self.moe_layers(config)[int(config["num_hidden_layers"]) - 1]:
            refuse(
                "num_nextn_predict_layers with a dense last layer: the MTP layer is built like the last layer"
            )

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        """The MLATransformerConfig fields of the model beyond the facts table's."""
        import torch

        from miles.families.transformer import model_fields

        fields = model_fields(self.keys, config)
        fields.setdefault("layernorm_epsilon", 1e-5)  # the configs' rms_norm_eps
        fields.setdefault("add_bias_linear", False)
        fields.update(
            normalization="RMSNorm",
            qk_layernorm=True,  # the q and kv latent norms (fused into the up-projections)
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            multi_latent_attention=True,
            rope_type="rope",
            rotary_base=float(rope_parameters(config)["rope_theta"]),
            rotary_percent=1.0,
            rotary_scaling_factor=1.0,  # with default rope the softmax scale has no mscale
            mscale=1.0,
            mscale_all_dim=0.0,
            rotary_interleaved=False,  # MLA de-interleaves each head's rope pairs, as GLM's rope does
            apply_rope_fusion=False,
            q_lora_rank=config.get("q_lora_rank") or None,  # MLATransformerConfig's default is 512
            **self.attention_fields(config),
        )
        moe = self.moe_layers(config)[: int(config["num_hidden_layers"])]
        if not any(moe):
            for name in ("num_moe_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                         "moe_router_topk_scaling_factor"):  # fmt: skip
                fields.pop(name, None)
            return fields
        groups = int(config.get("n_group") or 1)
        fields.update(
            moe_layer_freq=[int(m) for m in moe],
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,  # transformers never moves e_score_correction_bias
            moe_router_dtype="fp32",  # the gate's logits in float32, as transformers computes them
            moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="alltoall",
            moe_shared_expert_overlap=False,
            moe_router_num_groups=groups if groups > 1 else None,
            moe_router_group_topk=int(config.get("topk_group") or 1) if groups > 1 else None,
        )
        return fields

    def layer_weights(self, config: Mapping[str, Any], i: int, mg: str) -> Weights:
        """The weights of decoder (or MTP) layer `i` of the HF model, under megatron layer prefix `mg`."""
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        q_lora, kv_lora, rope = config.get("q_lora_rank"), config["kv_lora_rank"], config["qk_rope_head_dim"]
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        hf, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        at = mg + "self_attention."
        yield mg + "input_layernorm.weight", (whole(hf + "input_layernorm.weight", hidden),)
        if q_lora:
            yield at + "linear_q_down_proj.weight", (whole(attn + "q_a_proj.weight", q_lora),)
            yield at + "linear_q_up_proj.layer_norm_weight", (whole(attn + "q_a_layernorm.weight", q_lora),)
            yield at + "linear_q_up_proj.weight", (whole(attn + "q_b_proj.weight", heads * (nope + rope)),)
        else:
            yield at + "linear_q_proj.weight", (whole(attn + "q_proj.weight", heads * (nope + rope)),)
        yield at + "linear_kv_down_proj.weight", (whole(attn + "kv_a_proj_with_mqa.weight", kv_lora + rope),)
        yield at + "linear_kv_up_proj.layer_norm_weight", (whole(attn + "kv_a_layernorm.weight", kv_lora),)
        yield at + "linear_kv_up_proj.weight", (whole(attn + "kv_b_proj.weight", heads * (nope + v)),)
        yield at + "linear_proj.weight", (whole(attn + "o_proj.weight", hidden),)
        yield from self.attention_weights(config, i, at)
        post_norm = (whole(hf + "post_attention_layernorm.weight", hidden),)
        if not self.moe_layers(config)[i]:
            yield from dense_mlp(mg, hf, post_norm, config["intermediate_size"], hidden)
            return
        experts, width = int(value(config, "n_routed_experts")), config["moe_intermediate_size"]
        yield mg + "pre_mlp_layernorm.weight", post_norm
        yield mg + "mlp.router.weight", (whole(hf + "mlp.gate.weight", experts),)
        yield mg + "mlp.router.expert_bias", (whole(hf + "mlp.gate.e_score_correction_bias", experts),)
        for e in range(experts):
            src, to = f"{hf}mlp.experts.{e}.", mg + f"mlp.experts.local_experts.{e}."
            yield to + "linear_fc1.weight", gate_up_pieces(src, width)
            yield to + "linear_fc2.weight", (whole(src + "down_proj.weight", hidden),)
        shared = width * int(config.get("n_shared_experts") or 0)
        if shared:
            yield (
                mg + "mlp.shared_experts.linear_fc1.weight",
                gate_up_pieces(hf + "mlp.shared_experts.", shared),
            )
            yield (
                mg + "mlp.shared_experts.linear_fc2.weight",
                (whole(hf + "mlp.shared_experts.down_proj.weight", hidden),),
            )

    def extra_weights(self, config: Mapping[str, Any]) -> Weights:
        """The MTP layers: checkpoint layer L+k (DeepSeek-V3's naming) as megatron's mtp.layers.k."""
        hidden, layers = config["hidden_size"], int(config["num_hidden_layers"])
        for k in range(mtp_layers(config)):
            hf, mg = f"model.layers.{layers + k}.", f"mtp.layers.{k}."
            yield mg + "enorm.weight", (whole(hf + "enorm.weight", hidden),)
            yield mg + "hnorm.weight", (whole(hf + "hnorm.weight", hidden),)
            yield mg + "eh_proj.weight", (whole(hf + "eh_proj.weight", hidden),)
            yield mg + "final_layernorm.weight", (whole(hf + "shared_head.norm.weight", hidden),)
            yield from self.layer_weights(config, layers + k, mg + "transformer_layer.")

    def mtp_extras(self, prefix: str, config: Mapping[str, Any], hidden: int):
        """DeepSeek-V3 style: the projection of [embedding; hidden state] and three norms."""
        yield prefix + "eh_proj.weight", (hidden, 2 * hidden), "model"
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            yield f"{prefix}{norm}.weight", (hidden,), "norm"

    def lm_args(self, config: Mapping[str, Any]) -> dict:
        fields = self.transformer_fields(config)
        out = {
            "multi_latent_attention": True,
            "position_embedding_type": "rope",
            "mtp_num_layers": mtp_layers(config) or None,
            **{k: fields[k] for k in ("experimental_attention_variant",) if k in fields},
        }
        if "moe_layer_freq" in fields:
            out.update(
                moe_layer_freq=fields["moe_layer_freq"],
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
            )
        return out

    def block_spec(self, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"):
        """This chunk's decoder block spec: the Transformer Engine GPT spec's layers (MLA, the dense
        MLP or the MoE layer) with the family's attention (`attention_spec`)."""
        from dataclasses import replace

        from miles.megatron.spec import decoder_block_spec, layer_provider

        block = decoder_block_spec(tc, impl=impl, vp_stage=vp_stage)
        attention = self.attention_spec(layer_provider(impl), config)
        layers = [
            replace(s, submodules=replace(s.submodules, self_attention=attention)) for s in block.layer_specs
        ]
        return replace(block, layer_specs=layers)

    def attention_spec(self, provider, config: Mapping[str, Any]):
        """Every layer's self-attention spec: MLA with transformers' latent norms."""
        from miles.megatron.mla import mla_attention_spec

        return mla_attention_spec(provider)

    def finish_chunk(self, model, tc, config: Mapping[str, Any], vp_stage: int | None) -> None:
        """What the family checks or adds to a chunk before the MTP layers are carried."""

    def finish_model(
        self, model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
    ) -> None:
        """On the last stage, carry the MTP layers; keep the routers' gate weights in float32, as
        transformers keeps `mlp.gate.weight` (its checkpoints store them so: a bf16 model would
        round them)."""
        from miles.megatron.mla import keep_router_weights_fp32
        from miles.megatron.mtp import carry_mtp

        self.finish_chunk(model, tc, config, vp_stage)
        carry_mtp(model, tc, mtp_layers(config), impl, vp_stage)
        keep_router_weights_fp32(model)
