"""Context-parallel relayout of a packed token stream: megatron's zigzag shards <-> contiguous shards.

Under context parallelism megatron splits each sequence of a packed batch into 2·cp chunks and
gives rank r chunks r and 2cp-1-r (the load-balanced "zigzag" layout, miles.megatron.attention),
so that causal attention costs every rank the same. A layer that carries state along the
sequence instead (a linear-attention or convolution layer run through Hugging Face code, whose
context-parallel form passes its state from one rank to the next) needs each rank to hold one
contiguous piece of the packed stream: rank r the tokens [r·T/cp, (r+1)·T/cp) of the T tokens of
all sequences, in order ("packed shards"). These functions move a tensor between the two
layouts, exactly (a permutation of its rows across the group, no arithmetic), in both
directions, with autograd: the gradient of one relayout is the other applied to the gradient.

A sequence whose length is a multiple of 2·cp is zigzagged; one whose length is only a multiple
of cp (the padding the seed framework appends at the end of a packed batch) is split in cp
contiguous pieces instead, as the seed's data pipeline lays it out (radixark/miles 31f1ca961,
miles_plugins/models/hf_attention.py: "Final local padding is appended contiguously on each
rank, not in zigzag order"). Any other length is a ValueError naming it.

Rows are the first dimension (megatron's [tokens, batch, hidden] for a packed batch).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def sequence_lengths(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """The global length of each sequence from its cumulative offsets [0, L0, L0+L1, ...]."""
    cu = [int(v) for v in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:], strict=False)):
        raise ValueError(f"cu_seqlens must start at 0 and never decrease, got {cu}")
    return [b - a for a, b in zip(cu, cu[1:], strict=False)]


def zigzag_positions(lengths: Sequence[int], cp: int, rank: int) -> torch.Tensor:
    """The global stream positions rank `rank` holds under the zigzag layout, in its local order."""
    out, start = [], 0
    for i, length in enumerate(lengths):
        if length % (2 * cp) == 0:
            chunk = length // (2 * cp)
            out += [
                torch.arange(start + rank * chunk, start + (rank + 1) * chunk),
                torch.arange(start + (2 * cp - 1 - rank) * chunk, start + (2 * cp - rank) * chunk),
            ]
        elif length % cp == 0:
            piece = length // cp
            out.append(torch.arange(start + rank * piece, start + (rank + 1) * piece))
        else:
            raise ValueError(
                f"sequence {i} has {length} tokens, which the {cp} context-parallel ranks cannot split: pad each "
                f"sequence to a multiple of 2·cp = {2 * cp} (or, the last one, of cp = {cp})"
            )
        start += length
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's rows, rank 0's first (all ranks hold the same number)."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _zigzag_to_packed(x: torch.Tensor, lengths: Sequence[int], group, rank: int, cp: int) -> torch.Tensor:
    local = x.shape[0]
    if sum(lengths) != local * cp:
        raise ValueError(
            f"this rank holds {local} rows, but the sequences have {sum(lengths)} tokens over {cp} ranks"
        )
    held = torch.cat([zigzag_positions(lengths, cp, r) for r in range(cp)]).to(x.device)
    stream = torch.empty((local * cp, *x.shape[1:]), dtype=x.dtype, device=x.device)
    stream[held] = _gather(x, group)
    return stream[rank * local : (rank + 1) * local]


def _packed_to_zigzag(x: torch.Tensor, lengths: Sequence[int], group, rank: int, cp: int) -> torch.Tensor:
    if sum(lengths) != x.shape[0] * cp:
        raise ValueError(
            f"this rank holds {x.shape[0]} rows, but the sequences have {sum(lengths)} tokens over {cp} ranks"
        )
    return _gather(x, group)[zigzag_positions(lengths, cp, rank).to(x.device)]


class _ZigzagToPacked(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lengths, group, rank, cp):
        ctx.args = (lengths, group, rank, cp)
        return _zigzag_to_packed(x, lengths, group, rank, cp)

    @staticmethod
    def backward(ctx, grad):
        return _packed_to_zigzag(grad, *ctx.args), None, None, None, None


class _PackedToZigzag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lengths, group, rank, cp):
        ctx.args = (lengths, group, rank, cp)
        return _packed_to_zigzag(x, lengths, group, rank, cp)

    @staticmethod
    def backward(ctx, grad):
        return _zigzag_to_packed(grad, *ctx.args), None, None, None, None


def zigzag_to_packed_shard(x: torch.Tensor, cu_seqlens, group=None) -> torch.Tensor:
    """This rank's zigzag rows of the packed stream `cu_seqlens` describes -> its contiguous shard
    (rank r: rows [r·T/cp, (r+1)·T/cp) of the stream); `group` is the context-parallel group."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    return _ZigzagToPacked.apply(x, sequence_lengths(cu_seqlens), group, rank, cp)


def packed_shard_to_zigzag(x: torch.Tensor, cu_seqlens, group=None) -> torch.Tensor:
    """The inverse of `zigzag_to_packed_shard`."""
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    return _PackedToZigzag.apply(x, sequence_lengths(cu_seqlens), group, rank, cp)
