"""How the megatron-core layout proof scales: one helper for all layouts against one per layout.

    python benchmarks/bench_megatron_proof.py [--layouts 4] [--world-size 2]

Both sides run the same code (miles.megatron.proof.prove) on the same layouts, side by
side in this invocation:
  - batched: one helper process imports megatron-core once and forks one gloo group that
    tries every layout in turn (what the agreement test and `check --megatron` do),
  - per layout: one prove() call per layout, so every layout pays the interpreter start,
    the megatron-core import and a fresh gloo group, as a script per layout would.
It prints wall and CPU seconds (children included; this machine is shared, so CPU seconds
are the steadier figure) and the per-layout / batched ratio.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from miles.megatron.proof import Case, prove  # noqa: E402
from miles.parallel import ModelShape, ParallelLayout  # noqa: E402

MODEL = ModelShape("moe", 4, 8, 8, 8)


def _layouts(count: int, world: int) -> list[Case]:
    configs = [ParallelLayout(), ParallelLayout(tp=world), ParallelLayout(pp=world), ParallelLayout(ep=world)]
    configs += [ParallelLayout(cp=world), ParallelLayout(tp=world, sp=True)]
    return [Case(configs[i % len(configs)], world, MODEL) for i in range(count)]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _measure(run) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), _children_cpu()
    run()
    return time.perf_counter() - wall, _children_cpu() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    cases = _layouts(args.layouts, args.world_size)
    batched = _measure(lambda: prove(cases))
    single = _measure(lambda: [prove([c]) for c in cases])
    print(f"{args.layouts} layouts on {args.world_size} gloo ranks")
    print(f"  batched     wall {batched[0]:6.1f} s   cpu {batched[1]:6.1f} s")
    print(f"  per layout  wall {single[0]:6.1f} s   cpu {single[1]:6.1f} s")
    print(
        f"  ratio (per layout / batched): wall {single[0] / batched[0]:.1f}x, cpu {single[1] / batched[1]:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
