"""Context-parallel attention without Transformer Engine, and megatron's context-parallel split.

megatron-core's own DotProductAttention does not support context parallelism; TE's attention
does, with its own communication. Where TE is not installed, the layer spec
(`miles.megatron.spec`) uses the all-gather attention below. The sequence split is megatron's
load-balanced one: 2·cp chunks, rank r holding chunks r and 2cp-1-r.
"""

from __future__ import annotations

import torch


def context_parallel_positions(seq_len: int, cp: int, rank: int):
    """The global positions this context-parallel rank holds, in its local order: megatron's
    load-balanced split of the sequence into 2·cp chunks, rank r holding chunks r and 2cp-1-r."""
    chunk = seq_len // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
    return torch.cat([first, second])


def context_parallel_order(seq_len: int, cp: int):
    """Indices that put the concatenation of every rank's local sequence (rank 0's first) back in
    global order."""
    gathered = torch.cat([context_parallel_positions(seq_len, cp, r) for r in range(cp)])
    return torch.argsort(gathered)


class AllGatherContextParallelAttention(torch.nn.Module):
    """Causal attention with the sequence split over the context-parallel group.

    Each rank gathers every rank's keys and values (megatron's sequence all-gather, whose
    backward reduce-scatters their gradients back), puts them in global order, and attends
    from its own queries with the causal mask of their global positions. Simpler and heavier
    than TE's ring exchange; used where TE is not installed.
    """

    def __init__(self, config, layer_number: int = 1, attn_mask_type=None, attention_type=None,
                 attention_dropout=None, softmax_scale=None, cp_comm_type=None, pg_collection=None):  # fmt: skip
        super().__init__()
        from megatron.core import parallel_state

        self.config = config
        self.cp_group = parallel_state.get_context_parallel_group()
        self.cp = config.context_parallel_size
        self.rank = parallel_state.get_context_parallel_rank()
        self.scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "context-parallel attention without TE takes no packed sequences or bias"
            )
        local = query.shape[0]  # query: [s/cp, b, heads, dim]; key, value: [s/cp, b, groups, dim]
        total = local * self.cp
        order = context_parallel_order(total, self.cp).to(query.device)
        key = gather_from_sequence_parallel_region(key, True, self.cp_group)[order]
        value = gather_from_sequence_parallel_region(value, True, self.cp_group)[order]
        q_pos = context_parallel_positions(total, self.cp, self.rank).to(query.device)
        allowed = torch.arange(total, device=query.device).unsqueeze(0) <= q_pos.unsqueeze(1)
        repeat = query.shape[2] // key.shape[2]
        q = query.permute(1, 2, 0, 3)  # [b, heads, s_local, dim]
        k = key.permute(1, 2, 0, 3).repeat_interleave(repeat, dim=1)
        v = value.permute(1, 2, 0, 3).repeat_interleave(repeat, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.dropout if self.training else 0.0, scale=self.scale
        )
        return out.permute(2, 0, 1, 3).reshape(local, out.shape[0], -1)
