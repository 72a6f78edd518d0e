"""A Hugging Face config.json as megatron-core's TransformerConfig and Megatron-LM's arguments.

`transformer_config(config, parallel)` is the model's math: the fields its family's facts
table implies through the Megatron flags, and the switches the family adds (what megatron-core
cannot express is refused by name), the layout's parallel fields
(`ParallelLayout.transformer_config_kwargs`, the one translation of a layout) and any
TransformerConfig field the caller overrides (router dtype, aux-loss coefficient,
recomputation, ...). `megatron_lm_args` is what a torch_dist checkpoint's common.pt records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from miles.families.facts import Key, flag_values, rope_parameters
from miles.families.family import UnmappedModel
from miles.parallel import ParallelLayout

__all__ = [
    "TRANSFORMER_FIELDS", "checkpoint_dtype", "megatron_lm_args", "model_fields", "rope_parameters",
    "transformer_config",
]  # fmt: skip


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


def model_fields(keys: Iterable[Key], config: Mapping[str, Any]) -> dict:
    """The TransformerConfig fields a config.json sets through a facts table's `keys`."""
    out = {}
    for flag, found in flag_values(keys, config).items():
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


def transformer_config(
    config: Mapping[str, Any],
    parallel: ParallelLayout | None = None,
    *,
    dtype=None,
    on_cpu: bool = True,
    initialize: bool = False,
    **overrides: Any,
):
    """megatron-core's TransformerConfig for a config.json of a family megatron-core builds.

    `dtype` is the parameter dtype (default: the checkpoint's). `initialize` runs megatron's
    weight initialisation, which is also where it marks which parameters are tensor-parallel
    (and along which dimension): a model that trains with TP needs it even though its weights
    are then loaded from a checkpoint. Raises `UnmappedModel` for a config it cannot map.
    """
    import torch
    from megatron.core import transformer

    from miles.families import megatron_family
    from miles.megatron.compat import bind_missing_te_names

    bind_missing_te_names()  # megatron-core's own message, not an ImportError, for a TE-only switch
    family = megatron_family(config)
    family.refuse_unmapped(config)
    dtype = dtype or checkpoint_dtype(config)
    fields = family.transformer_fields(config)
    fields.update((parallel or ParallelLayout()).transformer_config_kwargs())
    fields.update(overrides)
    if isinstance(fields.get("attention_backend"), str):  # a flag's value: megatron-core's enum member
        from megatron.core.transformer.enums import AttnBackend

        fields["attention_backend"] = AttnBackend[fields["attention_backend"]]
    return getattr(transformer, family.config_class)(
        params_dtype=dtype,
        pipeline_dtype=dtype,  # what pipeline stages exchange
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=initialize,
        **fields,
    )


# The Megatron-LM arguments common.pt records that the HF config determines, as flags: every
# one a Megatron-LM argument of the flag's name with underscores.
_LM_ARG_FLAGS = (
    "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--num-query-groups",
    "--kv-channels", "--max-position-embeddings", "--rotary-base", "--norm-epsilon",
    "--untie-embeddings-and-output-weights", "--num-experts", "--moe-ffn-hidden-size", "--moe-router-topk",
    "--moe-shared-expert-intermediate-size", "--moe-router-topk-scaling-factor", "--q-lora-rank", "--kv-lora-rank",
    "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim", "--dsa-indexer-n-heads", "--dsa-indexer-head-dim",
    "--dsa-indexer-topk",
)  # fmt: skip


def megatron_lm_args(config: Mapping[str, Any], vocab: int, vocab_multiple: int = 1):
    """The `args` Megatron-LM's loader finds in common.pt, from the HF config (through its
    family's facts table).

    load_checkpoint reads the TP/PP sizes the checkpoint was written with (here 1 and 1)
    and, unless --finetune, check_checkpoint_args compares num_layers, hidden_size and
    num_attention_heads with the run's without a default; --use-checkpoint-args takes the
    model shape from the rest. Nothing here is a guess: each value is the HF config's.
    """
    import argparse

    from miles.families import megatron_family

    family = megatron_family(config)
    flags = flag_values(family.keys, config)
    values: dict[str, Any] = {f.lstrip("-").replace("-", "_"): flags[f] for f in _LM_ARG_FLAGS if f in flags}
    heads = values["num_attention_heads"]
    values.setdefault("num_query_groups", heads)
    values.update(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        group_query_attention=values["num_query_groups"] != heads,
        padded_vocab_size=vocab,
        make_vocab_size_divisible_by=vocab_multiple,
        ckpt_format="torch_dist",
        consumed_train_samples=0,
        consumed_valid_samples=0,
    )
    values.update(family.lm_args(config))
    return argparse.Namespace(**values)
