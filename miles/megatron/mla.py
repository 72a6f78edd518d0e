"""Multi-latent attention as transformers' GLM classes compute it, from megatron-core's modules.

transformers builds MLA's q and kv latent norms (GlmMoeDsaRMSNorm, Glm4MoeLiteRMSNorm) without
the config's eps: 1e-6, where megatron-core's norm fused into the up-projection reads the
model's (`with_latent_eps`). MLA's down projections are whole on every tensor-parallel rank
(`down_projection`), and the MoE routers' gate weights stay float32 as transformers keeps them
(`keep_router_weights_fp32`). `mla_attention_spec` puts the attention together; GLM-5's DSA
(miles.families.glm_moe_dsa.dsa) hands it its own module and core attention.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec

# The eps transformers' GLM latent norms are built with (their RMSNorm's default)
LATENT_NORM_EPS = 1e-6


def with_latent_eps(linear: type) -> type:
    """`linear` (a norm fused into a column-parallel linear) with GLM's latent-norm eps, 1e-6: its
    config is a copy with that layernorm_epsilon (TE reads it when built, the CPU stand-in when run)."""

    class LatentNormLinear(linear):
        def __init__(self, *args, config, **kwargs):
            config = copy.copy(config)
            config.layernorm_epsilon = LATENT_NORM_EPS
            super().__init__(*args, config=config, **kwargs)

    LatentNormLinear.__name__ = LatentNormLinear.__qualname__ = f"LatentEps{linear.__name__}"
    return LatentNormLinear


def keep_router_weights_fp32(model) -> None:
    """MoE gate weights in float32 whatever the model's dtype (the router computes its logits in
    float32 either way: `moe_router_dtype`); megatron's DDP and optimizer keep float32 parameters
    of a bf16 model as they are."""
    from megatron.core.transformer.moe.router import Router

    for module in model.modules():
        if isinstance(module, Router) and module.weight.dtype != torch.float32:
            module.weight.data = module.weight.data.float()


def down_projection(provider) -> type:
    """MLA's down projections, whole on every tensor-parallel rank as the Transformer Engine spec
    builds them (TELinear, parallel_mode "duplicated"), or without TE megatron-core's own linear
    that does the same (post_training.modelopt.layers.Linear: both mark the weight for the
    gradient all-reduce sequence parallelism needs, and MLA accepts both). A column-parallel one
    would compute the same forward, but MLA then gathers the rope key from the tensor-parallel
    split and its backward keeps one rank's heads' share of that key's gradient."""
    from miles.megatron import spec

    if not isinstance(provider, spec.TEShapedSpecProvider):
        return provider.linear()
    from megatron.core.post_training.modelopt.layers import Linear

    return Linear


class LatentDotProductAttention(DotProductAttention):
    """megatron-core's DotProductAttention with MLA's head sizes: MLA hands its core attention
    the query-key and value head sizes (k_channels, v_channels), as TEDotProductAttention takes
    them; the value heads size the output. Without context parallelism, as DotProductAttention."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
        super().__init__(
            config, layer_number, attn_mask_type, attention_type, attention_dropout, softmax_scale,
            cp_comm_type, pg_collection,
        )  # fmt: skip
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition


def _core_attention(provider):
    from miles.megatron import spec

    return (
        LatentDotProductAttention
        if isinstance(provider, spec.TEShapedSpecProvider)
        else provider.core_attention()
    )


def mla_attention_spec(provider, module: type = MLASelfAttention, core_attention=None) -> ModuleSpec:
    """The self-attention spec of an MLA layer: the Transformer Engine spec's modules (from
    `provider`) with the latent norms fused at GLM's eps, and `core_attention` (the provider's
    dot-product attention unless given)."""
    return ModuleSpec(
        module=module,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=provider.column_parallel_linear(),
            linear_q_down_proj=down_projection(provider),
            linear_q_up_proj=with_latent_eps(provider.column_parallel_layer_norm_linear()),
            linear_kv_down_proj=down_projection(provider),
            linear_kv_up_proj=with_latent_eps(provider.column_parallel_layer_norm_linear()),
            core_attention=core_attention or _core_attention(provider),
            linear_proj=provider.row_parallel_linear(),
            q_layernorm=IdentityOp,
            kv_layernorm=IdentityOp,
        ),
    )
