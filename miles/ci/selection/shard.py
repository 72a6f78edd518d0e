"""Split a suite into shards of nearly equal predicted time, the same way on every runner.

Every shard job of a suite computes the whole partition from the same registrations and
runs only its own part, so the partition must be a pure function of (test, est_time) pairs
and the shard count: no randomness, no clock, ties broken by name.

`balanced_partition` starts from several classic constructions (LPT, MULTIFIT, the
largest-differencing method), improves each with a local search that moves or swaps tests
out of the longest shard, and finishes with a bounded exact branch-and-bound that either
proves the best result optimal or improves it. Every stage is bounded by counts (nodes,
rounds, tests x shards), never by time, so it stays deterministic, and none recurses per
test: 10,000 tests on 64 shards plan in a fraction of a second (benchmarks/bench_shard.py).
Plain LPT is kept for comparison (benchmarks).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

EPS = 1e-9
EXACT_NODE_LIMIT = 20_000  # nodes of the branch-and-bound; well under a tenth of a second
SEARCH_ROUND_LIMIT = 10_000  # local-search improvements; far more than real suites need
# Bounds that keep a suite of thousands of tests on dozens of shards well under a second:
SEARCH_PARTNERS = 8  # the local search pairs the longest shard with this many of the shortest
DIFFERENCING_LIMIT = 200_000  # tests x shards above which the differencing start is skipped
EXACT_DEPTH_SHARE = 10  # the exact search runs when one descent (a node per test) is at most
# this share of its node limit; deeper, it could not try a single alternative


@dataclass(frozen=True)
class Job:
    """A test file and its predicted seconds."""

    key: str
    weight: float


@dataclass(frozen=True)
class Partition:
    shards: tuple[tuple[Job, ...], ...]
    method: str  # how the winning partition was found
    optimal: bool = False  # proven: no partition into this many shards has a shorter makespan

    @property
    def loads(self) -> tuple[float, ...]:
        return tuple(sum(j.weight for j in shard) for shard in self.shards)

    @property
    def makespan(self) -> float:
        return max(self.loads, default=0.0)

    @property
    def lower_bound(self) -> float:
        return lower_bound([j.weight for shard in self.shards for j in shard], len(self.shards))

    @property
    def ratio(self) -> float:
        """Predicted makespan over the lower bound: 1.0 is provably the best possible."""
        bound = self.lower_bound
        return self.makespan / bound if bound > 0 else 1.0


def lower_bound(weights: Sequence[float], n: int) -> float:
    """No partition into `n` shards can finish sooner than this."""
    if not weights:
        return 0.0
    return max(sum(weights) / n, max(weights))


def _provable_bound(weights: Sequence[float], n: int) -> float:
    """The lower bound, rounded up when every weight is a whole number of seconds (then so
    is every shard's total), which lets the exact search prove more results optimal."""
    bound = lower_bound(weights, n)
    if all(float(w).is_integer() for w in weights):
        return float(math.ceil(bound - EPS))
    return bound


def _sorted_jobs(jobs: Iterable[Job]) -> list[Job]:
    return sorted(jobs, key=lambda j: (-j.weight, j.key))


def _check(jobs: list[Job], n: int) -> None:
    if n < 1:
        raise ValueError(f"shard count must be >= 1, got {n}")
    keys = [j.key for j in jobs]
    if len(set(keys)) != len(keys):
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"job keys must be unique; repeated: {', '.join(repeated)}")
    bad = [j for j in jobs if not (math.isfinite(j.weight) and j.weight >= 0)]
    if bad:
        raise ValueError(f"job {bad[0].key} has weight {bad[0].weight!r}; weights must be finite and >= 0")


def _finish(jobs: list[Job], bins: list[list[int]], method: str, optimal: bool = False) -> Partition:
    shards = [tuple(sorted((jobs[i] for i in b), key=lambda j: (-j.weight, j.key))) for b in bins]
    # Heaviest shard first so "1/N" is the long pole; ties by the first test's name.
    shards.sort(key=lambda s: (-sum(j.weight for j in s), s[0].key if s else "\uffff"))
    return Partition(tuple(shards), method, optimal)


def lpt_partition(jobs: Iterable[Job], n: int) -> Partition:
    """Longest processing time first: each test, longest first, to the least loaded shard."""
    ordered = _sorted_jobs(jobs)
    _check(ordered, n)
    weights = [j.weight for j in ordered]
    return _finish(ordered, _lpt(weights, n), "lpt")


def _lpt(weights: Sequence[float], n: int) -> list[list[int]]:
    bins: list[list[int]] = [[] for _ in range(n)]
    heap = [(0.0, b) for b in range(n)]
    for i, w in enumerate(weights):
        load, b = heapq.heappop(heap)
        bins[b].append(i)
        heapq.heappush(heap, (load + w, b))
    return bins


def _multifit(weights: Sequence[float], n: int, upper: float, rounds: int = 12) -> list[list[int]] | None:
    """First-fit decreasing into `n` bins of a capacity found by bisection (MULTIFIT)."""
    lo, hi = lower_bound(weights, n), upper
    best = None
    for _ in range(rounds):
        if hi - lo <= EPS:
            break
        cap = (lo + hi) / 2
        packed = _first_fit(weights, n, cap)
        if packed is None:
            lo = cap
        else:
            best, hi = packed, cap
    return best


def _first_fit(weights: Sequence[float], n: int, cap: float) -> list[list[int]] | None:
    bins: list[list[int]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for i, w in enumerate(weights):
        for b in range(n):
            if loads[b] + w <= cap + EPS:
                bins[b].append(i)
                loads[b] += w
                break
        else:
            return None
    return bins


def _differencing(weights: Sequence[float], n: int) -> list[list[int]]:
    """Largest differencing (Karmarkar-Karp) for n shards: merge the two most uneven
    partial partitions, pairing the heaviest part of one with the lightest of the other."""
    # Each entry: (-spread, tiebreak, parts) with parts = list of (load, [indices]) sorted desc.
    heap = []
    for i, w in enumerate(weights):
        parts = [(w, [i])] + [(0.0, []) for _ in range(n - 1)]
        heapq.heappush(heap, (-w, i, parts))
    counter = len(weights)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(la + lb, ia + ib) for (la, ia), (lb, ib) in zip(a, reversed(b), strict=True)]
        merged.sort(key=lambda p: -p[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    if not heap:
        return [[] for _ in range(n)]
    return [idx for _, idx in heap[0][2]]


def _local_search(weights: Sequence[float], bins: list[list[int]]) -> list[list[int]]:
    """Move one test, or swap two, between the longest shard and one of the shortest while
    that makes the pair's longer side shorter than the longest shard was. Each step lowers the sorted
    load vector, so the search ends; it stops in a local optimum."""
    bins = [sorted(b, key=lambda i: (weights[i], i)) for b in bins]
    loads = [sum(weights[i] for i in b) for b in bins]
    n = len(bins)
    for _ in range(SEARCH_ROUND_LIMIT):
        hi = max(range(n), key=lambda b: (loads[b], -b))
        best = None  # (new pair maximum, lo, x index or None, y index or None)
        partners = sorted(range(n), key=lambda b: (loads[b], b))[:SEARCH_PARTNERS]
        for lo in sorted(partners):
            gap = loads[hi] - loads[lo]
            if lo == hi or gap <= EPS:
                continue
            lo_weights = [weights[i] for i in bins[lo]]
            for x in bins[hi]:
                wx = weights[x]
                if EPS < wx < gap - EPS:  # move x alone
                    cand = max(loads[hi] - wx, loads[lo] + wx)
                    if best is None or cand < best[0] - EPS:
                        best = (cand, lo, x, None)
                # swap x with the y in lo whose weight brings the difference nearest gap/2
                target = wx - gap / 2
                pos = bisect.bisect_left(lo_weights, target)
                for k in (pos - 1, pos):
                    if 0 <= k < len(lo_weights):
                        d = wx - lo_weights[k]
                        if EPS < d < gap - EPS:
                            cand = max(loads[hi] - d, loads[lo] + d)
                            if best is None or cand < best[0] - EPS:
                                best = (cand, lo, x, bins[lo][k])
        if best is None or best[0] >= loads[hi] - EPS:
            break
        _, lo, x, y = best
        bins[hi].remove(x)
        bisect.insort(bins[lo], x, key=lambda i: (weights[i], i))
        loads[hi] -= weights[x]
        loads[lo] += weights[x]
        if y is not None:
            bins[lo].remove(y)
            bisect.insort(bins[hi], y, key=lambda i: (weights[i], i))
            loads[lo] -= weights[y]
            loads[hi] += weights[y]
    return bins


def _best_split(weights: Sequence[float], items: list[int], unit: float) -> tuple[list[int], list[int]]:
    """Split `items` into two groups as evenly as possible (exact up to `unit` seconds):
    subset sums as bits of one integer, one bitset kept per item to walk back the choice."""
    sizes = [max(0, round(weights[i] / unit)) for i in items]
    half = sum(sizes) // 2
    mask = (1 << (half + 1)) - 1
    reach = [1]
    for size in sizes:
        reach.append((reach[-1] | (reach[-1] << size)) & mask)
    total = reach[-1]
    target = total.bit_length() - 1  # the largest reachable sum <= half
    first: list[int] = []
    for k in range(len(items) - 1, -1, -1):
        if not (reach[k] >> target) & 1:  # not reachable without item k: take it
            first.append(items[k])
            target -= sizes[k]
    chosen = set(first)
    return first, [i for i in items if i not in chosen]


def _pair_rebalance(weights: Sequence[float], bins: list[list[int]]) -> list[list[int]]:
    """Re-split the longest shard together with another shard as evenly as possible, as long
    as that shortens the longest shard; catches what single moves and swaps cannot."""
    bins = [list(b) for b in bins]
    loads = [sum(weights[i] for i in b) for b in bins]
    n = len(bins)
    unit = max(1e-3, sum(weights) / 200_000)  # keeps the bitsets small for any suite size
    for _ in range(SEARCH_ROUND_LIMIT):
        hi = max(range(n), key=lambda b: (loads[b], -b))
        for lo in sorted(range(n), key=lambda b: (loads[b], b)):
            if lo == hi or loads[hi] - loads[lo] <= EPS:
                continue
            a, b = _best_split(weights, bins[hi] + bins[lo], unit)
            la, lb = sum(weights[i] for i in a), sum(weights[i] for i in b)
            if max(la, lb) < loads[hi] - EPS:
                bins[hi], bins[lo], loads[hi], loads[lo] = a, b, la, lb
                break
        else:
            break
    return bins


def _exact(
    weights: Sequence[float], n: int, incumbent: float, node_limit: int
) -> tuple[list[int] | None, bool]:
    """Branch and bound over assignments (tests longest first) looking for a makespan below
    `incumbent`. Returns (shard of each test, or None when nothing better was found; whether
    the search finished, which proves the result optimal). The node limit bounds the cost.

    The depth-first search keeps its own stack (one frame per test placed), so its depth is
    not limited by Python's recursion limit: suites of thousands of tests plan like small ones.
    """
    m = len(weights)
    bound = _provable_bound(weights, n)
    loads = [0.0] * n
    assign = [0] * m
    best_assign: list[int] | None = None
    best = incumbent
    nodes = 0
    exhausted = False
    # (next test, shard loads as a multiset) already explored; a state that failed once fails
    # again, and suites of many equal est_times reach the same states over and over.
    visited: set[tuple[int, tuple[float, ...]]] = set()
    # A frame: [test index, makespan so far, shards in the order to try, next position in that
    # order, loads already tried (equal loads are interchangeable), shard holding the test or -1].
    stack: list[list] = []

    def enter(i: int, current_max: float) -> bool:
        """Open the node that places test `i`; True when the search can stop (the lower bound
        is reached or the node limit hit)."""
        nonlocal best, best_assign, nodes, exhausted
        if i == m:
            if current_max < best - EPS:
                best, best_assign = current_max, list(assign)
            return best <= bound + EPS
        state = (i, tuple(sorted(loads)))
        if state in visited:
            return False
        visited.add(state)
        nodes += 1
        if nodes > node_limit:
            exhausted = True
            return True
        stack.append([i, current_max, sorted(range(n), key=lambda b: (loads[b], b)), 0, set(), -1])
        return False

    stop = enter(0, 0.0)
    while stack and not stop:
        frame = stack[-1]
        i, current_max, order, pos, seen, placed = frame
        w = weights[i]
        if placed >= 0:  # back from the child: take the test out again
            loads[placed] -= w
            frame[5] = -1
        while pos < n:
            b = order[pos]
            pos += 1
            load = loads[b]
            if load in seen:
                continue
            seen.add(load)
            if max(current_max, load + w) >= best - EPS:
                pos = n  # shards are tried lightest first: every later one is at least as long
                break
            loads[b] += w
            assign[i] = b
            frame[3], frame[5] = pos, b
            stop = enter(i + 1, max(current_max, load + w))
            break
        else:
            stack.pop()
            continue
        if pos == n and frame[5] < 0:
            stack.pop()
    return best_assign, not exhausted


def _key(weights: Sequence[float], bins: list[list[int]]) -> tuple:
    loads = sorted((sum(weights[i] for i in b) for b in bins), reverse=True)
    return tuple(round(x, 6) for x in loads)


def balanced_partition(jobs: Iterable[Job], n: int, *, node_limit: int = EXACT_NODE_LIMIT) -> Partition:
    """The most even partition of `jobs` into `n` shards this module can find (never worse
    than plain LPT); deterministic for the same jobs and `n`."""
    ordered = _sorted_jobs(jobs)
    _check(ordered, n)
    weights = [j.weight for j in ordered]
    if len(ordered) <= n:
        singles = [[i] for i in range(len(ordered))] + [[] for _ in range(n - len(ordered))]
        return _finish(ordered, singles, "one test per shard", optimal=True)
    lpt = _lpt(weights, n)
    candidates = [("lpt", lpt)]
    mf = _multifit(weights, n, upper=max(_key(weights, lpt)))
    if mf is not None:
        candidates.append(("multifit", mf))
    if len(weights) * n <= DIFFERENCING_LIMIT:
        candidates.append(("differencing", _differencing(weights, n)))
    improved = [
        (f"{name}+search", _pair_rebalance(weights, _local_search(weights, bins)))
        for name, bins in candidates
    ]
    method, bins = min(candidates + improved, key=lambda c: _key(weights, c[1]))
    optimal = max(_key(weights, bins)) <= _provable_bound(weights, n) + EPS
    if not optimal and 0 < len(weights) * EXACT_DEPTH_SHARE <= node_limit:
        assign, optimal = _exact(weights, n, max(_key(weights, bins)), node_limit)
        if assign is not None:
            bins = [[i for i in range(len(weights)) if assign[i] == b] for b in range(n)]
            bins = _local_search(weights, bins)  # evens out the shards below the longest
            method = "exact" if optimal else "branch-and-bound"
    return _finish(ordered, bins, method, optimal)


def shards_for_budget(jobs: Sequence[Job], budget_s: float, *, max_shards: int = 64) -> int:
    """The fewest shards whose balanced partition finishes within `budget_s` seconds each,
    or, when one test alone is longer than the budget, within that test's time."""
    if budget_s <= 0:
        raise ValueError(f"budget must be > 0 seconds, got {budget_s}")
    if not jobs:
        return 1
    target = max(budget_s, max(j.weight for j in jobs))
    limit = max(1, min(max_shards, len(jobs)))
    n = min(limit, max(1, math.ceil(sum(j.weight for j in jobs) / target - EPS)))
    while n < limit and balanced_partition(jobs, n).makespan > target + EPS:
        n += 1
    return n
