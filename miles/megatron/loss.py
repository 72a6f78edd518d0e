"""Token logprobs and entropy from vocabulary-parallel logits, and the step's micro-batches.

With tensor parallelism each rank holds the logits of its slice of the vocabulary. The
softmax needs only three numbers per token from the other ranks (the max, the sum of
exponentials, the target's logit) and the entropy one more (sum p*z), so those are summed
across the tensor-parallel group and the full vocabulary is never gathered.

`vocab_parallel_logprobs` is fused: one autograd function that reads the logits a block of
tokens at a time, in float32, and keeps four numbers per token for the backward (the max, the
log of the partition function, the entropy, nothing of the vocabulary), which recomputes each
block's softmax and writes the gradient in the logits' own dtype. Its peak beyond the logits
and their gradient is one block's float32 temporaries, where the unfused form
(`unfused_vocab_parallel_logprobs`, the reference it is tested and benchmarked against) holds
several float32 copies of the whole [rows, seq, vocab/tp] slice for its backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# float32 bytes of one block of tokens' logits the fused form works on at a time
BLOCK_BYTES = 1 << 27
_PAD = -1e30  # a padding column's scaled logit: exp() of it is exactly 0, and 0 * it is 0


def _scaled(block: torch.Tensor, temperature: float, pad_from: int) -> torch.Tensor:
    """float32 logits / T of a block of tokens, padding columns (>= pad_from) at _PAD."""
    z = block.float() / temperature
    if pad_from < z.shape[-1]:
        z[:, max(pad_from, 0) :] = _PAD
    return z


class _FusedVocabParallel(torch.autograd.Function):
    """(logprob, entropy) per token from this rank's vocabulary slice, block by block."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, start, pad_from, group, with_entropy, block_rows):
        part = logits.shape[-1]
        flat, target = logits.reshape(-1, part), targets.reshape(-1)
        n = flat.shape[0]
        local = target - start
        mine = (local >= 0) & (local < part)
        index = local.clamp(0, part - 1)
        # per token, on this rank: the max m, sum e (e = exp(z - m)), sum e (z - m), the target's z
        stats = torch.zeros(4, n, dtype=torch.float32, device=logits.device)
        for r in range(0, n, block_rows):
            rows = slice(r, r + block_rows)
            z = _scaled(flat[rows], temperature, pad_from)
            top = z.max(dim=-1, keepdim=True).values
            stats[0, rows] = top.squeeze(1)
            z.sub_(top)
            stats[3, rows] = z.gather(1, index[rows, None]).squeeze(1)
            e = z.exp()
            stats[1, rows] = e.sum(dim=-1)
            if with_entropy:  # sum e (z - m); z is not needed after it
                stats[2, rows] = z.mul_(e).sum(dim=-1)
        # onto the group's max M: e scales by exp(m - M), and (z - M) = (z - m) + (m - M); every
        # sum stays relative to M (no cancellation against a large max)
        local_max = stats[0].clone()
        torch.distributed.all_reduce(stats[0], op=torch.distributed.ReduceOp.MAX, group=group)
        offset = local_max - stats[0]
        stats[3] = (stats[3] + offset) * mine
        stats[2] += offset * stats[1]
        stats[1:3] *= offset.exp()
        torch.distributed.all_reduce(stats[1:], group=group)
        log_s = stats[1].log()  # log Z - M
        logp = stats[3] - log_s
        entropy = log_s - stats[2] / stats[1] if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(logits, index, mine, stats[0], log_s, entropy)
        ctx.settings = (temperature, pad_from, block_rows)
        return logp.view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, index, mine, top, log_s, entropy = ctx.saved_tensors
        temperature, pad_from, block_rows = ctx.settings
        part = logits.shape[-1]
        flat = logits.reshape(-1, part)
        g_logp = grad_logp.reshape(-1).float() if grad_logp is not None else torch.zeros_like(log_s)
        g_ent = grad_entropy.reshape(-1).float() if grad_entropy is not None else torch.zeros_like(log_s)
        grad = torch.empty_like(flat)
        for r in range(0, flat.shape[0], block_rows):
            rows = slice(r, r + block_rows)
            shifted = _scaled(flat[rows], temperature, pad_from)
            shifted.sub_(top[rows, None]).sub_(log_s[rows, None])  # log p = (z - M) - log S
            p = shifted.exp()
            # d logp / dz = onehot - p;  d H / dz = -p (log p + H)
            shifted.add_(entropy[rows, None]).mul_(g_ent[rows, None]).add_(g_logp[rows, None]).mul_(p).neg_()
            if pad_from < part:  # p is 0 there; the product with a huge log p must not overflow
                shifted[:, max(pad_from, 0) :] = 0.0
            hit = mine[rows]
            shifted[hit.nonzero().squeeze(1), index[rows][hit]] += g_logp[rows][hit]
            grad[rows] = shifted.div_(temperature)
        return grad.view_as(logits), None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """logprob of each target under softmax(logits / T) over the whole vocabulary, and its entropy
    (zeros without `with_entropy`), fused (see the module docstring).

    `logits` is [..., V/tp] (this rank's slice); `vocab_size` the model's real vocabulary, so
    rows megatron padded the vocabulary with never take probability mass. Every rank of the
    tensor-parallel group gets the same values and back-propagates into its own slice.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    block_rows = max(1, BLOCK_BYTES // (4 * part))
    return _FusedVocabParallel.apply(
        logits, targets, temperature, start, vocab_size - start, group, with_entropy, block_rows
    )


def unfused_vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, vocab_size: int, *, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `vocab_parallel_logprobs` computes, in plain autograd over the whole slice (float32
    copies of it for the scaled logits, their shifted form, their exponentials and the entropy's
    product): the reference the fused form is tested and benchmarked against."""
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
