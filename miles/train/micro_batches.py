"""How one optimizer step's samples are dealt to the data-parallel ranks and cut into micro-batches.

Every rank holds the whole rollout (the samples are gathered after scoring), so each rank
derives every rank's split from the samples' lengths alone, the same way: model-parallel
peers (tensor, context and pipeline stages) agree on the rows and shape of every micro-batch,
and all data-parallel ranks agree on how many micro-batches a step has (FSDP gathers the
parameters, and an expert-parallel all-to-all exchanges tokens, once per micro-batch on every
rank), without a collective.

Dealing: rank r of D takes samples r, r+D, r+2D, ... of the minibatch (a group's samples
spread over the ranks). With `balance` (--balance-data) each rank still takes gbs/D samples,
chosen so that the ranks' token totals are close: longest first, each to the rank with the
fewest tokens that has room left (the seed framework also balances the ranks' token totals
at equal sample counts, by Karmarkar-Karp: radixark/miles@31f1ca961a94cb860cec3b2dea34ec332bfa8f76
miles/ray/rollout/train_data_conversion.py, split_train_data_by_dp_raw).

Cutting: --micro-batch-size rows at a time in order, or, with `dynamic`
(--use-dynamic-batch-size), as few micro-batches as fit a token budget. A micro-batch is padded
to its own widest row (rounded up to the backend's sequence multiple), so what it costs is
rows x padded width; --max-tokens-per-gpu bounds that per GPU, and a context-parallel rank
holds 1/cp of every row, so a micro-batch may pad to budget x cp tokens (the seed framework's
budget is also per context-parallel rank: miles/backends/training_utils/data.py,
get_data_iterator). A row longer than the budget alone still runs, as a micro-batch of its own.
With fixed-size micro-batches the budget, when given, is a ceiling: a micro-batch over it is
cut further. Finally every rank's count is raised to the largest one by splitting its most
expensive micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """What a micro-batch costs on a backend: its padded width is a multiple of `seq_multiple`
    (sequence and context parallelism split it), `context_parallel` ranks share each row, and
    with `shared_shape` all micro-batches of a step are padded to one shape (the widest row, the
    most rows), so each costs that much."""

    seq_multiple: int = 1
    context_parallel: int = 1
    shared_shape: bool = False

    def padded_width(self, longest: int) -> int:
        return -(-longest // self.seq_multiple) * self.seq_multiple


@dataclass(frozen=True)
class Batching:
    """How micro-batches are cut (the batch flags, as numbers)."""

    micro_batch_size: int
    dynamic: bool = False  # --use-dynamic-batch-size
    max_tokens: int | None = None  # --max-tokens-per-gpu
    balance: bool = False  # --balance-data

    def budget(self, geometry: Geometry) -> int | None:
        """Padded tokens one micro-batch may hold over its context-parallel ranks."""
        return None if self.max_tokens is None else self.max_tokens * geometry.context_parallel


def padded_tokens(lengths: Sequence[int], rows: Sequence[int], geometry: Geometry) -> int:
    """rows x padded width of the micro-batch made of `rows` (indices into `lengths`)."""
    return len(rows) * geometry.padded_width(max(lengths[i] for i in rows)) if rows else 0


def deal(lengths: Sequence[int], ranks: int, *, balance: bool) -> list[list[int]]:
    """The minibatch's sample indices each data-parallel rank trains on (equal counts)."""
    if not balance:
        return [list(range(r, len(lengths), ranks)) for r in range(ranks)]
    room = len(lengths) // ranks
    totals, dealt = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min((r for r in range(ranks) if len(dealt[r]) < room), key=lambda r: (totals[r], r))
        dealt[rank].append(i)
        totals[rank] += lengths[i]
    return [sorted(d) for d in dealt]


def cut(lengths: Sequence[int], batching: Batching, geometry: Geometry) -> list[list[int]]:
    """One rank's rows (indices into `lengths`) as micro-batches, before the ranks agree on a count."""
    budget = batching.budget(geometry)
    if geometry.shared_shape:
        # every micro-batch is as wide as the widest row: the budget is a number of rows
        rows = budget // geometry.padded_width(max(lengths)) if budget is not None and lengths else None
        size = batching.micro_batch_size if not batching.dynamic else rows or 1
        size = max(1, min(size, rows)) if rows is not None else size
        return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]
    if batching.dynamic:
        return _fill(sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)), lengths, budget, geometry)
    size = batching.micro_batch_size
    fixed = [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)]
    if budget is None:
        return fixed
    out = []
    for rows in fixed:
        if padded_tokens(lengths, rows, geometry) <= budget:
            out.append(rows)
        else:
            out += _fill(sorted(rows, key=lambda i: (-lengths[i], i)), lengths, budget, geometry)
    return out


def _fill(
    longest_first: Sequence[int], lengths: Sequence[int], budget: int | None, geometry
) -> list[list[int]]:
    """Consecutive runs of rows sorted longest first, each as long as the budget allows: a run's
    width is its first row's, so this is the fewest micro-batches that fit."""
    out: list[list[int]] = []
    for i in longest_first:
        if out and (
            budget is None or (len(out[-1]) + 1) * geometry.padded_width(lengths[out[-1][0]]) <= budget
        ):
            out[-1].append(i)
        else:
            out.append([i])
    return [sorted(rows) for rows in out]


def split_to(
    micro: list[list[int]], lengths: Sequence[int], count: int, geometry: Geometry
) -> list[list[int]]:
    """`micro` grown to `count` micro-batches by halving the most expensive one (of two rows or
    more) each time: the longer half stays in its place, the shorter half follows it."""
    micro = [list(m) for m in micro]
    while len(micro) < count:
        splittable = [k for k, rows in enumerate(micro) if len(rows) > 1]
        if not splittable:
            raise ValueError(f"{sum(map(len, micro))} row(s) cannot make {count} micro-batches")
        k = max(splittable, key=lambda k: (padded_tokens(lengths, micro[k], geometry), -k))
        rows = sorted(micro[k], key=lambda i: (-lengths[i], i))
        half = (len(rows) + 1) // 2
        micro[k : k + 1] = [sorted(rows[:half]), sorted(rows[half:])]
    return micro


def split_minibatch(
    lengths: Sequence[int], rank: int, ranks: int, batching: Batching, geometry: Geometry
) -> tuple[list[int], list[list[int]]]:
    """This rank's samples of one minibatch (indices into `lengths`, the token count of every
    sample of the minibatch) and its micro-batches (each a list of positions in those samples),
    as many as the rank that needs the most."""
    dealt = deal(lengths, ranks, balance=batching.balance)
    own_lengths = [[lengths[i] for i in rows] for rows in dealt]
    counts = [len(cut(ls, batching, geometry)) for ls in own_lengths]
    mine = own_lengths[rank]
    return dealt[rank], split_to(cut(mine, batching, geometry), mine, max(counts), geometry)
