"""A Hugging Face config.json as megatron-core's TransformerConfig.

`transformer_config(config, parallel)` is the model's math: the fields its facts table
(`miles.models`) implies through the Megatron flags, and the switches its family's mapping
adds (`miles.megatron.families`: what megatron-core cannot express is refused by name), the
layout's parallel fields (`ParallelLayout.transformer_config_kwargs`, the one translation of
a layout) and any TransformerConfig field the caller overrides (router dtype, aux-loss
coefficient, recomputation, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.megatron.families import UnmappedModel, mapping_of
from miles.megatron.fusions import FUSIONS
from miles.models import keys_of
from miles.models.facts import flag_values, rope_parameters
from miles.parallel import ParallelLayout

__all__ = ["TRANSFORMER_FIELDS", "checkpoint_dtype", "model_fields", "rope_parameters", "transformer_config"]


# Megatron flag -> TransformerConfig field, as Megatron-LM's core_transformer_config_from_args
# carries them (NVIDIA/Megatron-LM megatron/training/arguments.py@000c4ac2): most keep their
# name; --norm-epsilon is layernorm_epsilon, --num-experts num_moe_experts, --swiglu
# gated_linear_unit, and --disable-bias-linear (dest add_bias_linear, store_false) the negation.
TRANSFORMER_FIELDS: dict[str, tuple[str, bool]] = {  # flag: (field, negated)
    "--num-layers": ("num_layers", False),
    "--hidden-size": ("hidden_size", False),
    "--ffn-hidden-size": ("ffn_hidden_size", False),
    "--num-attention-heads": ("num_attention_heads", False),
    "--num-query-groups": ("num_query_groups", False),
    "--kv-channels": ("kv_channels", False),
    "--norm-epsilon": ("layernorm_epsilon", False),
    "--swiglu": ("gated_linear_unit", False),
    "--disable-bias-linear": ("add_bias_linear", True),
    "--num-experts": ("num_moe_experts", False),
    "--moe-router-topk": ("moe_router_topk", False),
    "--moe-ffn-hidden-size": ("moe_ffn_hidden_size", False),
    "--moe-router-pre-softmax": ("moe_router_pre_softmax", False),
    "--moe-shared-expert-intermediate-size": ("moe_shared_expert_intermediate_size", False),
    "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", False),
    "--q-lora-rank": ("q_lora_rank", False),
    "--kv-lora-rank": ("kv_lora_rank", False),
    "--qk-head-dim": ("qk_head_dim", False),  # MLA's q/k head part without rope
    "--qk-pos-emb-head-dim": ("qk_pos_emb_head_dim", False),
    "--v-head-dim": ("v_head_dim", False),
    "--dsa-indexer-n-heads": ("dsa_indexer_n_heads", False),
    "--dsa-indexer-head-dim": ("dsa_indexer_head_dim", False),
    "--dsa-indexer-topk": ("dsa_indexer_topk", False),
}


def model_fields(config: Mapping[str, Any]) -> dict:
    """The TransformerConfig fields a config.json sets through its family's facts table."""
    out = {}
    for flag, found in flag_values(keys_of(config), config).items():
        if flag in TRANSFORMER_FIELDS:
            name, negate = TRANSFORMER_FIELDS[flag]
            out[name] = (not found) if negate else found
    return out


def checkpoint_dtype(config: Mapping[str, Any]):
    """The dtype the HF checkpoint stores its weights in (bf16 when the config does not say)."""
    import torch

    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UnmappedModel(f"config.json dtype {name!r} is not a floating-point torch dtype")
    return dtype


FUSION_FIELDS = tuple(f.field for f in FUSIONS)


def transformer_config(
    config: Mapping[str, Any],
    parallel: ParallelLayout | None = None,
    *,
    dtype=None,
    on_cpu: bool = True,
    initialize: bool = False,
    **overrides: Any,
):
    """megatron-core's TransformerConfig for a config.json of a mapped family.

    `dtype` is the parameter dtype (default: the checkpoint's). `initialize` runs megatron's
    weight initialisation, which is also where it marks which parameters are tensor-parallel
    (and along which dimension): a model that trains with TP needs it even though its weights
    are then loaded from a checkpoint. Raises `UnmappedModel` for a config it cannot map.
    """
    import torch
    from megatron.core import transformer

    from miles.megatron.compat import bind_missing_te_names

    bind_missing_te_names()  # megatron-core's own message, not an ImportError, for a TE-only switch
    mapping = mapping_of(config)
    mapping.refuse_unmapped(config)
    dtype = dtype or checkpoint_dtype(config)
    fields = mapping.transformer_fields(config)
    fields.update((parallel or ParallelLayout()).transformer_config_kwargs())
    for name in FUSION_FIELDS:  # a fusion the family's model cannot run (GLM-5.2's DSA rope) stays off
        if fields.get(name) is False and name in overrides:
            overrides = {**overrides, name: False}
    fields.update(overrides)
    if isinstance(fields.get("attention_backend"), str):  # a flag's value: megatron-core's enum member
        from megatron.core.transformer.enums import AttnBackend

        fields["attention_backend"] = AttnBackend[fields["attention_backend"]]
    return getattr(transformer, mapping.config_class)(
        params_dtype=dtype,
        pipeline_dtype=dtype,  # what pipeline stages exchange
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=initialize,
        **fields,
    )
