"""A Hugging Face config.json as megatron-core's TransformerConfig.

`transformer_config(config, parallel)` is the model's math as its family maps it
(`miles.megatron.families`: what megatron-core cannot express is refused by name), the
layout's parallel fields (`ParallelLayout.transformer_config_kwargs`, the one translation of
a layout) and any TransformerConfig field the caller overrides (router dtype, aux-loss
coefficient, recomputation, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from miles.megatron.families import UnmappedModel, mapping_of
from miles.parallel import ParallelLayout


def num_experts(config: Mapping[str, Any]) -> int:
    # Hub configs say num_experts; transformers 5 writes num_local_experts.
    return int(config.get("num_experts") or config["num_local_experts"])


def head_dim(config: Mapping[str, Any]) -> int:
    return int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])


def rope_parameters(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers 5 writes rope_parameters; older configs write rope_theta / rope_scaling."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    return rope


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
    """megatron-core's TransformerConfig for a config.json of a mapped family.

    `dtype` is the parameter dtype (default: the checkpoint's). `initialize` runs megatron's
    weight initialisation, which is also where it marks which parameters are tensor-parallel
    (and along which dimension): a model that trains with TP needs it even though its weights
    are then loaded from a checkpoint. Raises `UnmappedModel` for a config it cannot map.
    """
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    mapping = mapping_of(config)
    mapping.refuse_unmapped(config)
    dtype = dtype or checkpoint_dtype(config)
    fields = mapping.transformer_fields(config)
    fields.update((parallel or ParallelLayout()).transformer_config_kwargs())
    fields.update(overrides)
    return TransformerConfig(
        params_dtype=dtype,
        pipeline_dtype=dtype,  # what pipeline stages exchange
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu,
        perform_initialization=initialize,
        **fields,
    )
