"""DeepSeek-V4 (DeepSeek-V4-Flash; transformers' DeepseekV4ForCausalLM, model_type deepseek_v4): its own model.

Not a GPTModel: hash routing needs the token ids inside each layer and the hyper-connections
carry several residual streams, so the model is `model.py` here (`Model`). The family builds
its own chunks (`build_model`), lays out its whole model (`weights`), reads DeepSeek's
published names too (`source_name`), names the transformers class's tensors for the built-in
engine (`model_name`) and sends its hyper-connection streams between pipeline stages
(`pipeline_rows`); megatron-core's MLA fields state the attention's shape as the seed's job
does, for the model-flag checks only (`_mla_fields`).

Weights, megatron names on the left, the checkpoint's file names (as transformers'
save_pretrained writes them) on the right: embedding.word_embeddings [model.embed_tokens],
output_layer [head], decoder.final_layernorm [model.norm], decoder.hc_head.hc_head_{fn,base,scale}
[model.hc_head.hc_{fn,base,scale}]; per layer i: hc_attn.{fn,base,scale} [hc_attn_{fn,base,scale}],
hc_ffn.* [hc_ffn_*], input_layernorm [attn_norm], pre_mlp_layernorm [ffn_norm],
self_attention.{wq_a, q_norm, wq_b, wkv, kv_norm [attn.norm], wo_a, wo_b, attn_sink},
self_attention.compressor.{ape, wkv, wgate, norm}, self_attention.indexer.{linear_wq_b [wq_b],
linear_weights_proj [weights_proj], compressor.*}, mlp.router.weight [ffn.gate.weight],
mlp.router.expert_bias [ffn.gate.bias] (top-k layers), mlp.router.tid2eid [ffn.gate.tid2eid]
(hash layers), experts e linear_fc1 [w1; w3], linear_fc2 [w2], shared_experts likewise; the carried MTP
layer k as mtp.layers.k.{enorm, hnorm, e_proj, h_proj, final_layernorm [norm], hc_head.hc_head_*
[hc_head_*], transformer_layer.* [mtp.k.*, named as a decoder layer]}. DeepSeek's published files
name the same tensors without the `model.` prefix, embed.weight and hc_head_fn (`source_name`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from miles.families.facts import COMMON, MLA, MOE, MTP, ROUTED_EXPERTS, Key, window
from miles.families.family import OwnModelFamily, UnmappedModel
from miles.families.schema import COMMON_SCHEMA, TOPK, AtMost, Divides, Int, PerLayer, Real
from miles.families.weights import Weights, whole
from miles.parallel import FamilyLimits

# DeepSeek-V4-Flash's compression ratio of each layer, the MTP layer last (0 sliding window only,
# 4 compressed sparse attention, 128 heavily compressed attention): radixark/miles
# scripts/models/deepseek-v4-flash.py COMPRESS_RATIOS at fe30593dd. transformers folds
# `compress_ratios` into `layer_types` and keeps the first num_hidden_layers entries.
FLASH_COMPRESS_RATIOS = (0, 0, *(4, 128) * 20, 4, 0)


SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _mla_fields(config: Mapping[str, Any]) -> dict:
    """The attention's shape as the seed's DeepSeek-V4 job states it in megatron-core's MLA fields
    (radixark/miles scripts/models/deepseek-v4-flash.py at fe30593dd: --multi-latent-attention,
    --q-lora-rank, --kv-lora-rank and --qk-head-dim and --v-head-dim at head_dim, --qk-pos-emb-head-dim
    the rope part, --qk-layernorm for the q-latent and kv norms, the compressed layers' YaRN), so the
    run's model flags are checked against the model config.json describes. miles.families.deepseek_v4.model reads
    none of them: its attention is its own, built from config.json."""
    dim = int(config["head_dim"])
    rope = (config.get("rope_parameters") or {}).get("compress") or {}
    fields = dict(
        q_lora_rank=int(config["q_lora_rank"]), kv_lora_rank=dim, qk_head_dim=dim, v_head_dim=dim,
        qk_pos_emb_head_dim=int(config.get("qk_rope_head_dim") or dim * float(rope.get("partial_rotary_factor", 1))),
        qk_layernorm=True,
    )  # fmt: skip
    if rope.get("rope_type") == "yarn":
        fields.update(
            rope_type="yarn",
            rotary_scaling_factor=float(rope["factor"]),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    else:
        fields.update(rope_type="rope")
    return fields


def layer_weights(config: Mapping[str, Any], i: int, mg: str) -> Weights:
    """The weights of decoder layer `i` of the checkpoint file, under megatron layer prefix `mg`."""
    yield from _layer(
        config, f"model.layers.{i}.", config["layer_types"][i], config["mlp_layer_types"][i], mg
    )


def _layer(config: Mapping[str, Any], hf: str, kind: str, mlp_kind: str, mg: str) -> Weights:
    """A decoder layer's weights under checkpoint prefix `hf` (attention `kind`, MLP `mlp_kind`)."""
    d, heads, dim = int(config["hidden_size"]), int(config["num_attention_heads"]), int(config["head_dim"])
    q_lora, o_lora, groups = int(config["q_lora_rank"]), int(config["o_lora_rank"]), int(config["o_groups"])
    n, experts, width = (
        int(config["hc_mult"]),
        int(config["n_routed_experts"]),
        int(config["moe_intermediate_size"]),
    )
    for part in ("attn", "ffn"):
        yield mg + f"hc_{part}.fn", (whole(f"{hf}hc_{part}_fn", (2 + n) * n),)
        yield mg + f"hc_{part}.base", (whole(f"{hf}hc_{part}_base", (2 + n) * n),)
        yield mg + f"hc_{part}.scale", (whole(f"{hf}hc_{part}_scale", 3),)
    yield mg + "input_layernorm.weight", (whole(hf + "attn_norm.weight", d),)
    yield mg + "pre_mlp_layernorm.weight", (whole(hf + "ffn_norm.weight", d),)
    at, src = mg + "self_attention.", hf + "attn."
    for ours, theirs, rows in (
        ("wq_a.weight", "wq_a.weight", q_lora), ("q_norm.weight", "q_norm.weight", q_lora),
        ("wq_b.weight", "wq_b.weight", heads * dim), ("wkv.weight", "wkv.weight", dim),
        ("kv_norm.weight", "norm.weight", dim), ("wo_a.weight", "wo_a.weight", groups * o_lora),
        ("wo_b.weight", "wo_b.weight", d), ("attn_sink", "attn_sink", heads),
    ):  # fmt: skip
        yield at + ours, (whole(src + theirs, rows),)
    if kind != SLIDING:
        ratio = int(config["compress_rates"][kind])
        yield from _compressor(
            at + "compressor.", src + "compressor.", ratio, (2 if kind == CSA else 1) * dim, dim
        )
    if kind == CSA:
        index_heads, index_dim = int(config["index_n_heads"]), int(config["index_head_dim"])
        to, fr = at + "indexer.", src + "indexer."
        yield to + "linear_wq_b.weight", (whole(fr + "wq_b.weight", index_heads * index_dim),)
        yield to + "linear_weights_proj.weight", (whole(fr + "weights_proj.weight", index_heads),)
        ratio = int(config["compress_rates"][CSA])
        yield from _compressor(to + "compressor.", fr + "compressor.", ratio, 2 * index_dim, index_dim)
    ffn = hf + "ffn."
    yield mg + "mlp.router.weight", (whole(ffn + "gate.weight", experts),)
    if mlp_kind == "moe":
        yield mg + "mlp.router.expert_bias", (whole(ffn + "gate.bias", experts),)
    else:
        yield mg + "mlp.router.tid2eid", (whole(ffn + "gate.tid2eid", int(config["vocab_size"])),)
    for e in range(experts):
        yield from _swiglu(mg + f"mlp.experts.local_experts.{e}.", f"{ffn}experts.{e}.", width, d)
    # transformers' DeepseekV4MoE builds exactly one shared expert of moe_intermediate_size
    # (refuse_unmapped holds n_shared_experts to 1)
    yield from _swiglu(mg + "mlp.shared_experts.", ffn + "shared_experts.", width, d)


def _compressor(mg: str, hf: str, ratio: int, width: int, dim: int) -> Weights:
    yield mg + "ape", (whole(hf + "ape", ratio),)
    yield mg + "wkv.weight", (whole(hf + "wkv.weight", width),)
    yield mg + "wgate.weight", (whole(hf + "wgate.weight", width),)
    yield mg + "norm.weight", (whole(hf + "norm.weight", dim),)


def _swiglu(mg: str, hf: str, width: int, hidden: int) -> Weights:
    """linear_fc1 is [gate (w1); up (w3)], linear_fc2 is down (w2)."""
    yield mg + "linear_fc1.weight", (whole(hf + "w1.weight", width), whole(hf + "w3.weight", width, width))
    yield mg + "linear_fc2.weight", (whole(hf + "w2.weight", hidden),)


def mtp_weights(config: Mapping[str, Any]) -> Weights:
    """The carried MTP layers: checkpoint mtp.{k}.* as mtp.layers.{k}.*, the layer as the published
    model's MTP layer is built (DeepseekV4.mtp_layer_kinds)."""
    d, n = int(config["hidden_size"]), int(config["hc_mult"])
    kinds = DeepseekV4.mtp_layer_kinds
    for k in range(int(config.get("num_nextn_predict_layers") or 0)):
        hf, mg = f"mtp.{k}.", f"mtp.layers.{k}."
        for norm, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("final_layernorm", "norm")):
            yield f"{mg}{norm}.weight", (whole(f"{hf}{theirs}.weight", d),)
        yield mg + "e_proj.weight", (whole(hf + "e_proj.weight", d),)
        yield mg + "h_proj.weight", (whole(hf + "h_proj.weight", d),)
        for part, rows in (("fn", n), ("base", n), ("scale", 1)):
            yield f"{mg}hc_head.hc_head_{part}", (whole(f"{hf}hc_head_{part}", rows),)
        yield from _layer(
            config, hf, kinds["layer_types"], kinds["mlp_layer_types"], mg + "transformer_layer."
        )


_PUBLISHED = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_fn": "hc_head_fn",
              "model.hc_head.hc_base": "hc_head_base", "model.hc_head.hc_scale": "hc_head_scale"}  # fmt: skip


def published_name(name: str) -> str:
    """The name DeepSeek's published files give a tensor `weights` names as transformers saves it:
    no `model.` prefix, `embed.weight`, `hc_head_{fn,base,scale}`; every other leaf the same
    (transformers 5.24 conversion_mapping.py "deepseek_v4" renames both forms to the same model)."""
    return _PUBLISHED.get(name, name.removeprefix("model."))


# transformers 5.24 DeepseekV4ForCausalLM's names of a layer's checkpoint tensors (its
# conversion_mapping.py "deepseek_v4" renames them on load), by the name's tail after model.layers.{i}.
_MODEL_NAMES = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_base": "attn_hc.base", "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_base": "ffn_hc.base", "hc_ffn_scale": "ffn_hc.scale",
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight", "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.norm.weight": "self_attn.kv_norm.weight", "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight", "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight", "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    # the routed experts arrive fused, already under the class's names
    "mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj", "mlp.experts.down_proj": "mlp.experts.down_proj",
}  # fmt: skip
_MODEL_TOP = {"head.weight": "lm_head.weight"}
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_EXPERT_MODEL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def layer_model_name(tail: str) -> str:
    """A decoder layer's tensor (its name after the layer's prefix, as DeepSeek publishes it) under
    the transformers class's name; a routed expert's w1/w3/w2 as mlp.experts.{e}.{gate,up,down}_proj
    (miles.train.speculative.as_model_names fuses them as the class holds them); any other name as
    given (an MTP block's own tensors)."""
    m = _EXPERT.match(tail)
    if m:
        return f"mlp.experts.{m[1]}.{_EXPERT_MODEL[m[2]]}.weight"
    return _MODEL_NAMES.get(tail, tail)


def tiny_values(model, gen) -> None:
    """Seeded values where DeepseekV4PreTrainedModel._init_weights sets a constant: attention sinks,
    compressor position biases, hyper-connection biases and scales, norms (at 0, 1, 0, 1) hide which
    half of a split or which side of a norm a value is on; the expert bias at 0 hides that it only
    selects; `tid2eid` at 0 sends every token to expert 0 twice. Every row of `tid2eid` gets
    distinct experts, as a published table has."""
    import torch

    def noise(shape, scale):
        return torch.randn(shape, generator=gen) * scale

    for name, param in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("sinks", "position_bias", "base", "hc_base"):
            param.copy_(noise(param.shape, 0.5))
        elif leaf in ("scale", "hc_scale") or (leaf == "weight" and "norm" in name):
            param.add_(noise(param.shape, 0.2))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(noise(buffer.shape, 0.05))
        elif name.endswith("tid2eid"):
            experts = int(model.config.n_routed_experts)
            rows = [torch.randperm(experts, generator=gen)[: buffer.shape[1]] for _ in range(buffer.shape[0])]
            buffer.copy_(torch.stack(rows))


class DeepseekV4(OwnModelFamily):
    name = "deepseek_v4"
    model_types = ("deepseek_v4",)
    attention = "dsa"
    keys = (
        *COMMON, *MLA, *MOE, *ROUTED_EXPERTS, *MTP,
        Key("scoring_func", "--moe-router-score-function", default="softmax"),
        Key("routed_scaling_factor", "--moe-router-topk-scaling-factor"),
        Key("q_lora_rank", "--q-lora-rank"),
        Key("qk_rope_head_dim", "--qk-pos-emb-head-dim"),
        Key("index_n_heads", "--dsa-indexer-n-heads"),
        Key("index_head_dim", "--dsa-indexer-head-dim"),
        Key("index_topk", "--dsa-indexer-topk"),
        Key("sliding_window", "--window-size", window),
        Key("rope_scaling_factor", "--rotary-scaling-factor"),
    )  # fmt: skip
    # transformers' DeepseekV4Config: its sizes, the experts a token picks among the routed ones,
    # the grouped output projection's groups dividing the heads, its per-layer lists (transformers'
    # validate_layer_type: the attention and MLP kinds it ships, one per layer)
    schema = (
        *COMMON_SCHEMA,
        Int("head_dim"), Int("num_key_value_heads", required=False), Int("q_lora_rank"), Int("o_lora_rank"),
        Int("o_groups"), Int("hc_mult"), Int("hc_sinkhorn_iters", required=False),
        Int("moe_intermediate_size"), Int("n_routed_experts"), Int("num_experts_per_tok"),
        Int("n_shared_experts", 0, required=False), Int("index_n_heads"), Int("index_head_dim"), Int("index_topk"),
        Int("sliding_window", why="keys the sliding-window attention sees"),
        Int("num_nextn_predict_layers", 0, required=False),
        Real("routed_scaling_factor", None), Real("swiglu_limit"), Real("compress_rope_theta"),
        AtMost("num_experts_per_tok", "n_routed_experts", TOPK),
        Divides("num_attention_heads", "o_groups", "the grouped output projection splits the heads into o_groups"),
        PerLayer("layer_types", (SLIDING, CSA, HCA)),
        PerLayer("mlp_layer_types", ("hash_moe", "moe")),
    )  # fmt: skip
    # hash routing's table [vocab, top-k]: each token's experts, distinct (a routing map cannot send a
    # token to one expert twice); transformers holds it int64, SGLang's HashTopK int32
    id_tables = (("gate.tid2eid", "n_routed_experts", ("I64", "I32")),)
    # the hash-routed layers pick by token id (DeepseekV4HashRouter): nothing to replay there
    router_classes = ("DeepseekV4TopKRouter",)
    tiny_model_type = "deepseek_v4"
    # Flash's switches at tiny sizes: its layer pattern (4 layers: sliding, sliding, CSA, HCA; the
    # first 3 hash-routed), 4 hyper-connection streams (with 2 every doubly-stochastic mix is
    # symmetric and a transposed one would not show), YaRN on the compressed layers' rope (factor
    # 16 as published, over 256 positions so that 16x reaches max_position_embeddings). 8 indexer
    # heads: with 2, relu(q.k) ties at the top-k boundary are common and the selection is
    # ill-conditioned for a parity check.
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 4, "max_position_embeddings": 4096,
        "moe_intermediate_size": 64, "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 32, "index_n_heads": 8,
        "index_head_dim": 32, "index_topk": 16, "hc_mult": 4, "sliding_window": 32, "num_nextn_predict_layers": 1,
        "compress_ratios": list(FLASH_COMPRESS_RATIOS),
        "rope_parameters": {
            "rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32,
            "beta_slow": 1,
        },
    }  # fmt: skip
    sdpa = False
    mtp_style = "mtp"
    tiny_layers = 4
    # The MTP layer attends through the sliding window only and routes by top-k (SGLang 0.5.23
    # models/deepseek_v4_nextn.py COMPRESS_RATIO_NEXTN_LAYER = 0; deepseek_v2.py is_hash excludes nextn)
    mtp_layer_kinds = {"layer_types": "sliding_attention", "mlp_layer_types": "moe"}
    # the DSA indexer's head weights, the grouped output's first projection and every compressor
    # piece stay bf16 (SGLang loads them so)
    fp8_keep = frozenset({"weights_proj", "wo_a", "compressor"})
    config_class = "MLATransformerConfig"
    renames_on_load = True
    # The conversion's logit check runs 320 tokens: past the sliding window (32 at tiny sizes, 128
    # published), two heavily compressed entries (every 128 tokens) and more compressed entries than the
    # indexer keeps (80 > 16 at tiny sizes), so every attention path is in the comparison.
    probe_length = 320

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        def refuse(message: str) -> None:
            raise UnmappedModel(f"config.json {message}")

        if config.get("attention_bias") or config.get("mlp_bias"):
            refuse("attention_bias/mlp_bias=true is not built (DeepSeek-V4 checkpoints have no biases)")
        if config.get("hidden_act", "silu") != "silu":
            refuse(f"hidden_act {config.get('hidden_act')!r}: only silu (SwiGLU) is built")
        if config.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            refuse(f"scoring_func {config.get('scoring_func')!r}: only sqrtsoftplus (DeepSeek-V4's) is built")
        if int(config.get("num_key_value_heads", 1)) != 1:
            refuse(
                f"num_key_value_heads {config['num_key_value_heads']}: DeepSeek-V4 attends with one shared K=V head"
            )
        shared = config.get("n_shared_experts", 1)
        if shared != 1:
            refuse(
                f"n_shared_experts {shared!r}: transformers' DeepseekV4ForCausalLM builds exactly one shared expert of "
                "moe_intermediate_size whatever the key says (and SGLang's fused shared expert requires 1), so this "
                "value describes a model they compute differently; set it to 1"
            )
        if config.get("tie_word_embeddings"):
            refuse("tie_word_embeddings=true: DeepSeek-V4 unties them; not built")
        if config.get("attention_dropout"):
            refuse(f"attention_dropout {config['attention_dropout']}: the DeepSeek-V4 attention applies none")
        heads, groups = int(config["num_attention_heads"]), int(config["o_groups"])
        if heads % groups:
            refuse(f"o_groups {groups} does not divide num_attention_heads {heads}")
        rope = (config.get("rope_parameters") or {}).get("compress") or {}
        kind = rope.get("rope_type", "default")
        if kind not in ("default", "yarn"):
            refuse(f"rope_parameters.compress.rope_type {kind!r}: only default and yarn are built")
        if float(rope.get("attention_factor", 1.0)) != 1.0:
            refuse(
                f"rope_parameters.compress.attention_factor {rope['attention_factor']}: DeepSeek-V4 never scales "
                "cos/sin (transformers forces 1.0); remove it"
            )
        layers = int(config["num_hidden_layers"])
        for key, allowed in (("layer_types", (SLIDING, CSA, HCA)), ("mlp_layer_types", ("hash_moe", "moe"))):
            kinds = list(config.get(key) or [])
            if len(kinds) != layers or any(k not in allowed for k in kinds):
                refuse(
                    f"{key} {kinds}: need {layers} entries of {', '.join(allowed)} (transformers writes them)"
                )

    def transformer_fields(self, config: Mapping[str, Any]) -> dict:
        """The TransformerConfig of the model: the experts' and shared expert's sizes, top-k and scaling
        (the routing itself is miles.families.deepseek_v4.model's), the clamp, no dropout; attention sizes only as
        megatron-core's checks read them (one query group per head: the K=V head is the attention's own)."""
        import torch

        experts, topk = int(config["n_routed_experts"]), int(config["num_experts_per_tok"])
        width = int(config["moe_intermediate_size"])
        return dict(
            num_layers=int(config["num_hidden_layers"]),
            hidden_size=int(config["hidden_size"]),
            num_attention_heads=int(config["num_attention_heads"]),
            num_query_groups=int(config["num_attention_heads"]),
            kv_channels=int(config["head_dim"]),
            ffn_hidden_size=width,
            layernorm_epsilon=float(config["rms_norm_eps"]),
            normalization="RMSNorm",
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            activation_func_clamp_value=float(config["swiglu_limit"]),
            bias_activation_fusion=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            num_moe_experts=experts,
            moe_router_topk=topk,
            moe_ffn_hidden_size=width,
            moe_shared_expert_intermediate_size=width,  # one shared expert (refuse_unmapped)
            moe_router_topk_scaling_factor=float(config["routed_scaling_factor"]),
            moe_router_load_balancing_type="none",
            moe_router_dtype="fp32",  # transformers' gate logits are float32 in a float32 model, sqrt-softplus on them
            moe_router_pre_softmax=topk
            == 1,  # megatron-core requires it at top-1; the DeepSeek-V4 router ignores it
            moe_token_dispatcher_type="alltoall",
            moe_shared_expert_overlap=False,
            **_mla_fields(config),
        )

    def weights(self, config: Mapping[str, Any]) -> Weights:
        """(megatron name, pieces) for every weight of the whole model (one stage, one expert rank)."""
        d, vocab, n = int(config["hidden_size"]), int(config["vocab_size"]), int(config["hc_mult"])
        yield "embedding.word_embeddings.weight", (whole("model.embed_tokens.weight", vocab),)
        for i in range(int(config["num_hidden_layers"])):
            yield from layer_weights(config, i, f"decoder.layers.{i}.")
        yield "decoder.hc_head.hc_head_fn", (whole("model.hc_head.hc_fn", n),)
        yield "decoder.hc_head.hc_head_base", (whole("model.hc_head.hc_base", n),)
        yield "decoder.hc_head.hc_head_scale", (whole("model.hc_head.hc_scale", 1),)
        yield "decoder.final_layernorm.weight", (whole("model.norm.weight", d),)
        yield "output_layer.weight", (whole("head.weight", vocab),)
        yield from mtp_weights(config)

    def source_name(self, name: str, present) -> str:
        """The name `name` has among a checkpoint's tensors `present` (either form), or UnmappedModel."""
        if name in present:
            return name
        if published_name(name) in present:
            return published_name(name)
        raise UnmappedModel(
            f"the checkpoint has no tensor {name} (nor {published_name(name)}, as published): is it a DeepSeek-V4 "
            "checkpoint of this config.json?"
        )

    def model_name(self, name: str) -> str:
        """The transformers class's name of checkpoint tensor `name` (as `weights` names it)."""
        if name.startswith("model.layers."):
            index, _, tail = name.removeprefix("model.layers.").partition(".")
            if tail in _MODEL_NAMES:
                return f"model.layers.{index}.{_MODEL_NAMES[tail]}"
        elif name in _MODEL_TOP or name.startswith(("model.embed_tokens.", "model.norm.", "model.hc_head.")):
            return _MODEL_TOP.get(name, name)
        raise UnmappedModel(f"DeepseekV4ForCausalLM has no tensor for checkpoint tensor {name}")

    def lm_args(self, config: Mapping[str, Any]) -> dict:
        """What common.pt records beyond the shared arguments, under the Megatron-LM argument names the
        seed's DeepSeek-V4 job passes (radixark/miles scripts/models/deepseek-v4-flash.py at fe30593dd:
        --experimental-attention-variant dsv4, --dsv4-*, sqrt-softplus routing with expert bias)."""
        rates = config.get("compress_rates") or {}
        ratio = {SLIDING: 0, CSA: int(rates.get(CSA, 4)), HCA: int(rates.get(HCA, 128))}
        mtp = int(config.get("num_nextn_predict_layers") or 0)
        kinds = [*config["layer_types"], *[self.mtp_layer_kinds["layer_types"]] * mtp]
        return {
            "multi_latent_attention": True,
            "experimental_attention_variant": "dsv4",
            "position_embedding_type": "rope",
            "mtp_num_layers": mtp or None,
            "moe_router_score_function": "sqrtsoftplus",
            "moe_router_enable_expert_bias": True,
            "dsv4_hc_mult": int(config["hc_mult"]),
            "dsv4_hc_sinkhorn_iters": int(config["hc_sinkhorn_iters"]),
            "dsv4_compress_ratios": [ratio[k] for k in kinds],
            "dsv4_compress_rope_theta": float(config["compress_rope_theta"]),
            "dsv4_o_groups": int(config["o_groups"]),
            "dsv4_o_lora_rank": int(config["o_lora_rank"]),
            "dsv4_n_hash_layers": sum(k == "hash_moe" for k in config["mlp_layer_types"]),
            "dsv4_window_size": int(config["sliding_window"]),
        }

    def build_model(
        self,
        tc,
        config: Mapping[str, Any],
        vocab_size: int,
        vp_stage: int | None = None,
        *,
        impl: str = "local",
    ):
        """This rank's model chunk: model.py's DeepSeek-V4. Its layers are the same modules under
        either `impl` (its own attention and hyper-connections, megatron-core's local experts), so
        their state-dict keys do not depend on it."""
        self.refuse_unmapped(config)
        limits = self.limits(config)
        problem = limits.cp_problem(tc.context_parallel_size) or limits.tp_problem(
            tc.tensor_model_parallel_size
        )
        if problem:
            raise UnmappedModel(problem)
        from miles.families.deepseek_v4 import model

        return model.build_model(tc, config, vocab_size, vp_stage, self.mtp_layer_kinds)

    def left_padding_exact(self, config: Mapping[str, Any]) -> bool:
        # A compressed layer pools each block of `ratio` cache positions: left padding moves the
        # block edges and pools pad positions, so such a row's logits are not its own (0.1 nats
        # at tiny sizes). Sliding-window layers mask by position and are exact.
        # `config` as decoder_config gives it: layer_types per layer, as the rest of the family reads it
        return all(kind == SLIDING for kind in config["layer_types"][: int(config["num_hidden_layers"])])

    def limits(self, config: Mapping[str, Any]) -> FamilyLimits:
        """No context parallelism (sliding windows and compressed keys need a rank's whole
        sequence); tensor parallelism splits the grouped output projection by group."""
        groups = config.get("o_groups")
        split = (
            (("o_groups", int(groups), "the grouped output projection splits by group"),) if groups else ()
        )
        return FamilyLimits(
            context_parallel="DeepSeek-V4's sliding windows and compressed keys need a rank's whole sequence",
            tp_divides=split,
        )

    def mtp_extras(self, prefix: str, config: Mapping[str, Any], hidden: int):
        """Separate embedding and hidden projections, three norms, its own hyper-connection head."""
        hc = int(config["hc_mult"])
        yield prefix + "e_proj.weight", (hidden, hidden), "model"
        yield prefix + "h_proj.weight", (hidden, hidden), "model"
        for norm in ("enorm", "hnorm", "norm"):
            yield f"{prefix}{norm}.weight", (hidden,), "norm"
        for part, shape in (("fn", (hc, hc * hidden)), ("base", (hc,)), ("scale", (1,))):
            yield f"{prefix}hc_head_{part}", shape, "hc_head"

    def pipeline_rows(self, config: Mapping[str, Any]) -> int:
        return int(config["hc_mult"])  # the hyper-connection streams cross as [s, b*n, d]

    def tiny_values(self, model, gen) -> None:
        tiny_values(model, gen)


FAMILY = DeepseekV4()
