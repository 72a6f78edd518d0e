"""What checking a prepared checkpoint's digests costs, against reading the same bytes, side by side.

    python benchmarks/bench_ckpt_verify.py [--dir /tmp/miles-bench-verify] [--gb 2] [--rounds 3] [--keep]

Writes --gb GB of random bytes twice: as one file, and as four shards of a quarter each, each
directory with a manifest listing its files (miles.ckpt.manifest), then alternates, round after
round, within this one invocation, each measurement in a fresh child process:
  read          reading the files once in 16 MiB chunks: the floor any check of the content pays
  verify-first  miles.ckpt.verify.file_problems with an empty digest cache: what the trainer and
                prepare-ckpt pay the first time they use a checkpoint (every byte hashed; shards
                on up to four threads)
  verify-again  the same with the digest cache the first left: every later use (one stat per
                file, while the file is unchanged)
The files stay in the page cache across rounds (they are read once before the first), so `read`
measures memory bandwidth and the hash its CPU cost; a cold disk adds the same read time to the
first verification and to loading the checkpoint alike. Ratios divide each case's median by
read's on the same layout (above 1: slower than reading).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CHUNK = 16 << 20

CHILD = r"""
import json, os, sys, time
from pathlib import Path
case, directory, cache = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
os.environ["MILES_CACHE_DIR"] = cache
from miles.ckpt.manifest import read_manifest
from miles.ckpt.verify import file_problems
manifest = read_manifest(directory)
start = time.perf_counter()
if case == "read":
    for rel in manifest.files:
        with open(directory / rel, "rb") as f:
            while f.read(16 << 20):
                pass
    problems = []
else:
    problems = file_problems(directory, manifest)
print(json.dumps({"seconds": time.perf_counter() - start, "problems": problems}))
"""


def write_layout(root: Path, total: int, shards: int) -> Path:
    from miles.ckpt.manifest import write_manifest

    out = root / f"{shards}-file"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for i in range(shards):
        with open(out / f"part-{i}.bin", "wb") as f:
            left = total // shards
            while left:
                n = min(CHUNK, left)
                f.write(os.urandom(n))
                left -= n
    write_manifest(out, "bench", "inputs", {})  # hashes every file (not timed)
    return out


def measure(case: str, directory: Path, cache: Path) -> float:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, case, str(directory), str(cache)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["problems"]:
        raise SystemExit(f"{case} on {directory}: {result['problems']}")
    return result["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/miles-bench-verify")
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    root = Path(args.dir)
    total = int(args.gb * (1 << 30))
    layouts = [write_layout(root, total, 1), write_layout(root, total, 4)]
    times: dict[tuple[str, str], list[float]] = {}
    for directory in layouts:
        measure("read", directory, root / "cache-unused")  # into the page cache
    for _ in range(args.rounds):
        for directory in layouts:
            cache = root / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            for case in ("read", "verify-first", "verify-again"):
                seconds = measure(case, directory, cache)
                times.setdefault((directory.name, case), []).append(seconds)
    print(f"{args.gb:g} GB, {args.rounds} rounds, {os.cpu_count()} CPUs; median seconds, GB/s, ratio to read")
    for directory in layouts:
        base = statistics.median(times[(directory.name, "read")])
        for case in ("read", "verify-first", "verify-again"):
            median = statistics.median(times[(directory.name, case)])
            rate = args.gb / median if median else float("inf")
            print(
                f"  {directory.name:<7} {case:<13} {median:9.4f} s  {rate:8.2f} GB/s  {median / base:8.3f}x read"
            )
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s in all)")
