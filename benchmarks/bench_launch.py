"""What a short CPU training run costs to start, measured in CPU seconds, side by side.

    python benchmarks/bench_launch.py [--repeats 3] [--backend megatron|fsdp] [--rollouts 1]

Two comparisons, each case in a fresh process (the CPU seconds of it and all its children,
`RUSAGE_CHILDREN`, so a shared machine's load slows a case but does not change its cost):

- imports: `import torch, megatron.core.models.gpt` as megatron-core 0.16.1 ships it (its fusions
  decorated with torch.compile, which imports TorchInductor) against the same import after
  `import miles` (miles.megatron.compat: eager fusions in a process without CUDA);
- launches: the tiny Qwen3-4B recipe's CPU run of `--rollouts` rollouts on two gloo ranks under
  `python -m torch.distributed.run --standalone` (torchrun's own best settings for one node)
  against `python -m miles.train.forked_ranks` (the ranks forked after the imports they share),
  the same trainer arguments and checkpoint.

Cases alternate (A B A B ...) so that a change in the machine's load falls on both; prints each
case's median and the ratio after/before.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MEGATRON_IMPORT = "import torch; import megatron.core.models.gpt"
COMPILED = ("megatron-core as shipped", [sys.executable, "-c", MEGATRON_IMPORT])
EAGER = ("after import miles", [sys.executable, "-c", "import miles; " + MEGATRON_IMPORT])


def cpu_seconds(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> float:
    """CPU seconds (user + system) of `cmd` and every process it started; it must exit 0."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:6])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def launch_cases(workdir: Path, backend: str, rollouts: int) -> list[tuple[str, list[str], dict]]:
    """The tiny recipe's forked command and its torchrun twin, with the plan's environment."""
    from miles.metrics.capture import RECORD_DIR_ENV
    from tests.support import recipes as runs
    from tests.support.learning import DENSE, learning_args

    plan = runs.tiny_plan(
        DENSE["recipe"], workdir, *learning_args({**DENSE, "rollouts": rollouts}), train_backend=backend
    )
    for _, path in plan.workdirs:
        os.makedirs(path, exist_ok=True)
    forked = list(plan.command)
    assert forked[1:3] == ["-m", "miles.train.forked_ranks"], forked[:4]
    nproc = forked[forked.index("--nproc-per-node") + 1]
    trainer = forked[forked.index("miles.train") - 1 :]
    torchrun = [forked[0], "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", nproc, *trainer]  # fmt: skip
    env = {**os.environ, **dict(plan.env), "PYTHONPATH": str(ROOT), RECORD_DIR_ENV: str(workdir / "records")}
    return [("torchrun", torchrun, env), ("forked_ranks", forked, env)]


def compare(label: str, cases: list[tuple[str, list[str], dict | None]], repeats: int) -> None:
    seen: dict[str, list[float]] = {name: [] for name, _, _ in cases}
    for _ in range(repeats):
        for name, cmd, env in cases:
            seen[name].append(cpu_seconds(cmd, env=env, cwd=ROOT))
    (a, xs), (b, ys) = seen.items()
    ma, mb = statistics.median(xs), statistics.median(ys)
    print(f"{label}: {a} {ma:.1f} s CPU (median of {len(xs)}: {', '.join(f'{x:.1f}' for x in xs)})")
    print(f"{label}: {b} {mb:.1f} s CPU (median of {len(ys)}: {', '.join(f'{y:.1f}' for y in ys)})")
    print(f"{label}: ratio {b}/{a} = {mb / ma:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backend", choices=("megatron", "fsdp"), default="megatron")
    parser.add_argument("--rollouts", type=int, default=1)
    args = parser.parse_args()
    compare(
        "megatron-core import", [(COMPILED[0], COMPILED[1], None), (EAGER[0], EAGER[1], None)], args.repeats
    )
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        cases = launch_cases(Path(tmp), args.backend, args.rollouts)
        compare(f"{args.backend} run of {args.rollouts} rollout(s) on 2 ranks", cases, args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
