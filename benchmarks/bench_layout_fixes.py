"""How the layout fix search scales with the world size: divisors of W against every degree 1..W.

    python benchmarks/bench_layout_fixes.py [--worlds 10000 1000000 1099511627776]

Both sides run miles.parallel.validate on the same broken layout (tp=3, which divides none of
the worlds), side by side in this invocation:
  - divisors: the shipped search, whose candidates are the divisors of W (from its factors),
  - every degree: the same search with candidates 1..W, as a search without the factors would
    do; it is skipped above --linear-limit, where the list alone would not fit in memory.
It prints seconds per validate and the every-degree / divisors ratio.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.parallel import ParallelLayout, validate  # noqa: E402
from miles.parallel import fixes as search  # noqa: E402


def _timed(world: int) -> float:
    start = time.perf_counter()
    validate(ParallelLayout(tp=3), world)
    return time.perf_counter() - start


def _every_degree(world: int) -> float:
    shipped = search._candidates

    def linear(name, config, context):
        if name in search._GRID_FACTORS:
            return list(range(1, context.world + 1))
        return shipped(name, config, context)

    search._candidates = linear
    try:
        return _timed(world)
    finally:
        search._candidates = shipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[10_000, 1_000_000, 2**40])
    parser.add_argument("--linear-limit", type=int, default=1_000_000)
    args = parser.parse_args()
    print(f"{'world':>16}  {'divisors':>10}  {'every degree':>13}  ratio")
    for world in args.worlds:
        fast = _timed(world)
        if world <= args.linear_limit:
            slow = _every_degree(world)
            print(f"{world:>16}  {fast:>9.4f}s  {slow:>12.3f}s  {slow / fast:7.0f}x")
        else:
            print(f"{world:>16}  {fast:>9.4f}s  {'not run':>13}  (1..W would not fit in memory)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
