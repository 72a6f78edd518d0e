"""Qwen3.5's linear attention: megatron-core's GatedDeltaNet, with its output norm and context parallelism.

megatron-core 0.16.1 builds the gated delta net (megatron/core/ssm/gated_delta_net.py): one
input projection [q; k; v; z; b; a] with the layer's input norm fused, the causal depthwise conv,
the chunked gated delta rule (fla's kernel, or its own torch form where fla is absent:
miles.megatron.compat.gdn_without_fla), the gated RMS norm and the output projection. Two things
it leaves to the model are here:

- `HeadNorm`, the norm before the output gate: transformers' Qwen3_5MoeRMSNormGated scales by its
  weight as it is (it starts at 1), while every other norm of the model is zero-centred (1 + w), so
  the backend's norm (which follows `layernorm_zero_centered_gamma`) would add 1. It normalises each
  value head of the rank's heads; its one weight is shared by all heads, so its gradient is summed
  over the tensor-parallel ranks (which hold different heads) in its own backward.
- context parallelism ("TODO: support CP" in megatron-core): the recurrence runs over the whole
  sequence, so each context-parallel rank gathers the sequence (megatron's load-balanced order put
  back in global order), runs the layer on all of it, and keeps its own positions; the gathers'
  backward reduce-scatters the gradients, so every rank's inputs get the sum over the ranks' uses.
"""

from __future__ import annotations

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet


class HeadNorm(torch.nn.Module):
    """RMS norm over each value head with a plain (not zero-centred) weight, summed over TP in backward."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        weight = self.weight
        if self.config.tensor_model_parallel_size > 1:  # identity forward, all-reduce of the gradient
            weight = copy_to_tensor_model_parallel_region(weight)
        x = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (weight * x.to(weight.dtype)).to(x.dtype)


class ContextParallelGatedDeltaNet(GatedDeltaNet):
    """megatron-core's GatedDeltaNet, run over the whole sequence under context parallelism."""

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        cp = self.config.context_parallel_size
        if cp == 1:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        from miles.megatron.attention import context_parallel_order, context_parallel_positions

        tp_group = parallel_state.get_tensor_model_parallel_group()
        cp_group = parallel_state.get_context_parallel_group()
        sp = self.config.sequence_parallel and self.tp_size > 1
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        # [s/(cp*tp), b, h] -> this CP rank's [s/cp, b, h]; the backward sums the TP ranks' partial grads
        local = gather_from_sequence_parallel_region(hidden_states, True, tp_group) if sp else hidden_states
        total = local.shape[0] * cp
        order = context_parallel_order(total, cp).to(local.device)
        whole = gather_from_sequence_parallel_region(local, True, cp_group)[order]
        if sp:  # the layer's own input under SP: this TP rank's rows of the whole sequence
            rows = total // self.tp_size
            whole = whole[tp_rank * rows : (tp_rank + 1) * rows]
        out, bias = super().forward(whole, attention_mask, *args, **kwargs)
        if sp:
            out = gather_from_sequence_parallel_region(out, True, tp_group)
        mine = context_parallel_positions(total, cp, parallel_state.get_context_parallel_rank())
        out = out[mine.to(out.device)]
        if sp:
            rows = out.shape[0] // self.tp_size
            out = out[tp_rank * rows : (tp_rank + 1) * rows]
        return out, bias


def gdn_spec(provider):
    """The ModuleSpec of a linear-attention layer's mixer, with `provider`'s linears (TE's or the stand-ins)."""
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from miles.megatron.compat import gdn_without_fla

    gdn_without_fla()
    return ModuleSpec(
        module=ContextParallelGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(
            in_proj=provider.column_parallel_layer_norm_linear(),
            out_norm=HeadNorm,
            out_proj=provider.row_parallel_linear(),
        ),
        metainfo={"fuse_input_layernorm": True},
    )
