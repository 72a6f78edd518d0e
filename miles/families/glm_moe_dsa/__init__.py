"""GLM-5 / GLM-5.2 (transformers' GlmMoeDsaForCausalLM, model_type glm_moe_dsa) as megatron-core GPTModel.

Multi-latent attention with the DSA indexer and GLM-5.2's cross-layer top-k sharing
(`dsa.py` here: megatron-core 0.16.1 wires DSA into no spec and lacks the sharing),
dense first layers, then MoE layers with a sigmoid router whose expert bias picks experts
but does not weight them, top-k weights renormalised and scaled, and a shared expert. Every
config.json value that changes the math is mapped or refused by name. The MTP layers
(`model.layers.{L+k}.*`) are carried: converted, saved, loaded and handed to the rollout
engine, frozen unless --enable-mtp-training trains them (miles.megatron.mtp).

Weights (transformers names on the right, all rows as they are): the layer's input norm;
linear_q_down_proj [q_a_proj], linear_q_up_proj [q_b_proj] with the q latent norm fused
(layer_norm_weight [q_a_layernorm]), linear_kv_down_proj [kv_a_proj_with_mqa],
linear_kv_up_proj [kv_b_proj] with layer_norm_weight [kv_a_layernorm], linear_proj [o_proj];
on layers that run their own indexer core_attention.indexer.{linear_wq_b, linear_wk, k_norm,
linear_weights_proj}; the MLP as Qwen3's, plus mlp.router.expert_bias
[mlp.gate.e_score_correction_bias] and mlp.shared_experts.linear_fc1/fc2; MTP layer k as
mtp.layers.k.{enorm, hnorm, eh_proj, final_layernorm [shared_head.norm], transformer_layer.*}.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.families.facts import (
    COMMON,
    MOE,
    MTP,
    ROUTED_EXPERTS,
    Fixed,
    Key,
    dense_prefix,
    indexer_types,
    rope_parameters,
    value,
)
from miles.families.family import GPTFamily, UnmappedModel
from miles.families.schema import COMMON_SCHEMA, TOPK, AtMost, Int, PerLayer, Real
from miles.families.weights import Weights, dense_mlp, gate_up_pieces, whole

_CLASS = "transformers' GlmMoeDsaForCausalLM"


def mtp_layers(config: Mapping[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


def layer_kinds(config: Mapping[str, Any]) -> tuple[str, ...]:
    """ "full" or "shared" for every layer, the MTP layers after the decoder's."""
    return indexer_types(config, int(config["num_hidden_layers"]) + mtp_layers(config))


def moe_layers(config: Mapping[str, Any]) -> list[bool]:
    """Which layers (the MTP layers too) are MoE: all but the first `first_k_dense_replace`."""
    total = int(config["num_hidden_layers"]) + mtp_layers(config)
    written = [kind == "sparse" for kind in config.get("mlp_layer_types") or []]
    dense = int(config.get("first_k_dense_replace") or 0)
    return [written[i] if i < len(written) else i >= dense for i in range(total)]


def _experts_per_token(config: Mapping[str, Any]) -> int:
    return int(config.get("num_experts_per_tok") or 1)


def _full(config: Mapping[str, Any], i: int) -> bool:
    return layer_kinds(config)[i] == "full"


class GlmMoeDsa(GPTFamily):
    name = "glm_moe_dsa"
    model_types = ("glm_moe_dsa",)
    attention = "dsa"
    keys = (
        *COMMON, *MOE, *ROUTED_EXPERTS, *MTP,
        # MLA expands its KV latent to one key and value per attention head. config.json's
        # head_dim is the rope part (GlmMoeDsaConfig sets it), not the value head: no row reads it.
        Key("num_key_value_heads", "--num-attention-heads", describes_model=False),
        Key("first_k_dense_replace", "--moe-layer-freq", dense_prefix),
        Key("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
        Key("q_lora_rank", "--q-lora-rank"),
        Key("kv_lora_rank", "--kv-lora-rank"),
        Key("qk_nope_head_dim", "--qk-head-dim"),
        Key("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
        Key("v_head_dim", "--v-head-dim"),
        Key("index_n_heads", "--dsa-indexer-n-heads"),
        Key("index_head_dim", "--dsa-indexer-head-dim"),
        Key("index_topk", "--dsa-indexer-topk"),
    )  # fmt: skip
    fixed = (
        Fixed("--multi-latent-attention", True, f"{_CLASS} attends with MLA"),
        Fixed("--experimental-attention-variant", "dsa", f"{_CLASS} selects keys with the DSA indexer"),
        Fixed("--moe-router-score-function", "sigmoid", f"{_CLASS} routes by sigmoid scores"),
        Fixed("--moe-router-enable-expert-bias", True, f"{_CLASS} selects experts with e_score_correction_bias"),
        Fixed(
            "--moe-router-bias-update-rate", 0,
            f"{_CLASS} keeps e_score_correction_bias as a buffer nothing updates, and miles trains it so",
        ),
    )  # fmt: skip
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
    mtp_style = "layers"
    tiny_layers = 4
    # the MTP block's projection and the DSA indexer's head weights stay bf16 (SGLang loads them so)
    fp8_keep = frozenset({"eh_proj", "weights_proj"})
    config_class = "MLATransformerConfig"

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        def refuse(message: str) -> None:
            raise UnmappedModel(f"config.json {message}")

        if config.get("attention_bias") or config.get("mlp_bias"):
            refuse(
                "attention_bias/mlp_bias=true is not mapped to megatron (GLM-5 checkpoints have no biases)"
            )
        if config.get("hidden_act", "silu") != "silu":
            refuse(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is mapped")
        rope = rope_parameters(config)
        if rope.get("rope_type", "default") != "default":
            refuse(
                f"rope_type {rope.get('rope_type')!r} is not mapped for glm_moe_dsa (GLM-5's default rope is)"
            )
        if config.get("q_lora_rank") is None:
            refuse("q_lora_rank null: the DSA indexer reads the q latent, so GLM-5 needs one")
        if config.get("num_key_value_heads", config["num_attention_heads"]) != config["num_attention_heads"]:
            refuse(
                f"num_key_value_heads {config['num_key_value_heads']} != num_attention_heads "
                f"{config['num_attention_heads']}: MLA expands its KV latent to every head, and transformers would "
                "then repeat them again; GLM-5 keeps them equal"
            )
        if config.get("attention_dropout"):
            refuse(
                f"attention_dropout {config['attention_dropout']}: megatron-core's DSA attention applies none"
            )
        if config.get("indexer_rope_interleave") is False:
            refuse(
                "indexer_rope_interleave=false: transformers' GlmMoeDsaIndexer (and miles) rotate the indexer's "
                "interleaved pairs, SGLang would rotate halves; remove the key or set it true"
            )
        if not config.get("norm_topk_prob", True) or _experts_per_token(config) == 1:
            refuse(
                "norm_topk_prob=false or num_experts_per_tok=1: megatron-core renormalises sigmoid top-k weights "
                "exactly when more than one expert is picked; GLM-5 renormalises 8"
            )
        groups, topk_group = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
        if groups > 1 and _experts_per_token(config) // topk_group != 2:
            refuse(
                f"n_group {groups} with topk_group {topk_group} and num_experts_per_tok {_experts_per_token(config)}: "
                "transformers scores a group by its top-2 experts, megatron-core by its top "
                "num_experts_per_tok // topk_group; they agree only when that is 2"
            )
        if layer_kinds(config)[0] != "full":
            refuse(
                "indexer_types/index_topk_pattern: layer 0 is shared, but no layer below it has a top-k to share"
            )
        if mtp_layers(config) and not moe_layers(config)[int(config["num_hidden_layers"]) - 1]:
            refuse(
                "num_nextn_predict_layers with a dense last layer: the MTP layer is built like the last layer"
            )

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        """The MLATransformerConfig fields of the model beyond the facts table's."""
        import torch

        from miles.families.transformer import model_fields

        fields = model_fields(self.keys, config)
        fields.setdefault("layernorm_epsilon", 1e-5)  # GlmMoeDsaConfig's rms_norm_eps
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
            experimental_attention_variant="dsa",  # MLA hands its core attention x and the q latent
            dsa_indexer_loss_coeff=0.0,
        )
        moe = moe_layers(config)[: int(config["num_hidden_layers"])]
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
        q_lora, kv_lora, rope = config["q_lora_rank"], config["kv_lora_rank"], config["qk_rope_head_dim"]
        nope, v = config["qk_nope_head_dim"], config["v_head_dim"]
        hf, attn = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        at = mg + "self_attention."
        yield mg + "input_layernorm.weight", (whole(hf + "input_layernorm.weight", hidden),)
        yield at + "linear_q_down_proj.weight", (whole(attn + "q_a_proj.weight", q_lora),)
        yield at + "linear_q_up_proj.layer_norm_weight", (whole(attn + "q_a_layernorm.weight", q_lora),)
        yield at + "linear_q_up_proj.weight", (whole(attn + "q_b_proj.weight", heads * (nope + rope)),)
        yield at + "linear_kv_down_proj.weight", (whole(attn + "kv_a_proj_with_mqa.weight", kv_lora + rope),)
        yield at + "linear_kv_up_proj.layer_norm_weight", (whole(attn + "kv_a_layernorm.weight", kv_lora),)
        yield at + "linear_kv_up_proj.weight", (whole(attn + "kv_b_proj.weight", heads * (nope + v)),)
        yield at + "linear_proj.weight", (whole(attn + "o_proj.weight", hidden),)
        if _full(config, i):  # a shared layer has no indexer, in either model
            index, dim, src = config["index_n_heads"], config["index_head_dim"], attn + "indexer."
            to = at + "core_attention.indexer."
            yield to + "linear_wq_b.weight", (whole(src + "wq_b.weight", index * dim),)
            yield to + "linear_wk.weight", (whole(src + "wk.weight", dim),)
            yield to + "k_norm.weight", (whole(src + "k_norm.weight", dim),)
            yield to + "k_norm.bias", (whole(src + "k_norm.bias", dim),)
            yield to + "linear_weights_proj.weight", (whole(src + "weights_proj.weight", index),)
        post_norm = (whole(hf + "post_attention_layernorm.weight", hidden),)
        if not moe_layers(config)[i]:
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
            "experimental_attention_variant": "dsa",
            "position_embedding_type": "rope",
            "mtp_num_layers": mtp_layers(config) or None,
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
        MLP or the MoE layer) with GLM's attention, sharing one top-k holder."""
        from dataclasses import replace

        from miles.families.glm_moe_dsa import dsa
        from miles.megatron.spec import decoder_block_spec, layer_provider

        block = decoder_block_spec(tc, impl=impl, vp_stage=vp_stage)
        attention = dsa.attention_spec(layer_provider(impl), layer_kinds(config), holder={})
        layers = [
            replace(s, submodules=replace(s.submodules, self_attention=attention)) for s in block.layer_specs
        ]
        return replace(block, layer_specs=layers)

    def finish_model(
        self, model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
    ) -> None:
        """Refuse a chunk that starts on a shared layer; on the last stage, carry the MTP layers; keep
        the routers' gate weights in float32, as transformers keeps GlmMoeDsa's `mlp.gate.weight`
        (its checkpoints store them so: a bf16 model would round them)."""
        from miles.families.glm_moe_dsa import dsa
        from miles.megatron.blocks import StageStartsOnSharedLayer, check_chunk_start
        from miles.megatron.spec import layer_provider

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
        if mtp_layers(config) and model.post_process:
            from miles.megatron.mtp import carry_mtp

            carry_mtp(
                model,
                tc,
                model.decoder.submodules.layer_specs[-1],
                mtp_layers(config),
                layer_provider(impl),
                vp_stage,
            )
        dsa.keep_router_weights_fp32(model)


FAMILY = GlmMoeDsa()
