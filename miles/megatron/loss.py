"""Token logprobs and entropy from vocabulary-parallel logits, and the step's micro-batches.

With tensor parallelism each rank holds the logits of its slice of the vocabulary. The
softmax needs only three numbers per token from the other ranks (the max, the sum of
exponentials, the target's logit) and the entropy one more (sum p*z), so those are summed
across the tensor-parallel group and the full vocabulary is never gathered. The sums use
megatron's reduce-from-tensor-parallel region (all-reduce forward, identity backward): every
rank computes the same loss and back-propagates into its own slice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of each target under softmax(logits / T) over the whole vocabulary, and its entropy.

    `logits` is [..., V/tp] (this rank's slice); `vocab_size` the model's real vocabulary, so
    rows megatron padded the vocabulary with never take probability mass.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    part = logits.shape[-1]
    start = tp_rank * part
    z = logits.float() / temperature
    if start + part > vocab_size:
        padded = torch.arange(start, start + part, device=z.device) >= vocab_size
        # exp() of it is exactly 0; a finite value keeps exp*z (and its gradient) free of NaN
        z = z.masked_fill(padded, -1e30)
    with torch.no_grad():
        shift = z.max(dim=-1, keepdim=True).values
        torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX, group=group)
    z = z - shift
    exp = z.exp()
    total = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    local = targets - start
    mine = (local >= 0) & (local < part)
    picked = z.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * mine
    target_logit = reduce_from_tensor_model_parallel_region(picked)
    log_total = total.log()
    logp = target_logit - log_total
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    # H = log S - sum_j p_j z_j
    pz = (exp * z).sum(dim=-1)
    entropy = log_total - reduce_from_tensor_model_parallel_region(pz) / total
    return logp, entropy


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as megatron's schedule feeds it: fixed [rows, seq] tensors and the loss inputs."""

    tokens: torch.Tensor  # [rows, S], right-padded to its own widest row (a multiple the layout splits)
    position_ids: torch.Tensor  # [rows, S]
    width: int  # real columns of the source TokenBatch (targets are width - 1 wide)
    batch: object  # the miles.train.batch.TokenBatch rows, for the loss
    positions: torch.Tensor  # [S/cp] the global positions this context-parallel rank holds

    @property
    def model_tokens(self) -> torch.Tensor:
        """What this rank's model reads: its context-parallel share of the sequence."""
        return self.tokens[:, self.positions]

    @property
    def model_position_ids(self) -> torch.Tensor:
        return self.position_ids[:, self.positions]

    def local_targets(self) -> torch.Tensor:
        """The next token after each position this rank holds (0 past the end: never in the loss)."""
        nxt = torch.cat([self.tokens[:, 1:], torch.zeros_like(self.tokens[:, :1])], dim=1)
        return nxt[:, self.positions]


def gather_context_parallel(x: torch.Tensor, cp: int) -> torch.Tensor:
    """[rows, S/cp] per-token values of this rank -> [rows, S] in global order, on every rank of
    the context-parallel group; the backward hands each rank the gradient of its own tokens."""
    if cp == 1:
        return x
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    from miles.megatron.attention import context_parallel_order

    gathered = gather_from_sequence_parallel_region(
        x.transpose(0, 1).contiguous(), False, parallel_state.get_context_parallel_group()
    )
    order = context_parallel_order(gathered.shape[0], cp).to(x.device)
    return gathered[order].transpose(0, 1)


def micro_batches(
    parts, seq_multiple: int, device: str, cp: int = 1, cp_rank: int = 0, shape: tuple[int, int] | None = None
) -> list[MicroBatch]:
    """Each micro-batch padded to its own widest row, rounded up to a length sequence and context
    parallelism can split (an empty one, which only fills a schedule, to one row), or every one
    to `shape` (rows, length) where a pipeline needs one shape. Padding rows and columns are
    never read back (the loss takes each part's own rows and width)."""
    from miles.megatron.attention import context_parallel_positions

    out = []
    for part in parts:
        n, cols = part.input_ids.shape
        rows, seq = shape or (max(n, 1), max(1, -(-int(cols) // seq_multiple)) * seq_multiple)
        positions = context_parallel_positions(seq, cp, cp_rank) if cp > 1 else torch.arange(seq)
        tokens = torch.zeros((rows, seq), dtype=torch.long)
        tokens[:n, :cols] = part.input_ids
        row_positions = torch.arange(seq).unsqueeze(0).expand(tokens.shape[0], -1).contiguous()
        out.append(
            MicroBatch(tokens.to(device), row_positions.to(device), int(cols), part, positions.to(device))
        )
    return out
