"""Checkpoint conversion speed and memory against a plain safetensors copy, side by side.

    python benchmarks/bench_ckpt.py [--dir /tmp/miles-bench-ckpt] [--rounds 3] [--keep]

Builds a multi-GB checkpoint with make_tiny_checkpoint (Qwen3 architecture, larger dims),
then alternates, round after round, within this one invocation:
  copy        safetensors load_file + save_file of every shard, fsynced (the baseline)
  fp8         miles.ckpt.fp8.convert_to_fp8 (block-wise e4m3, fsynced)
  torch_dist  miles.ckpt.torch_dist.convert_to_torch_dist (Megatron layout, loaded back)
Each measurement runs in a fresh child process (imports done before the clock starts), so
its peak RSS is its own. Throughput is the source's tensor bytes per wall-clock second;
each ratio divides the copy's median time by the step's. CPU seconds are printed beside
wall time: on a shared machine a CPU-bound step loses more to other load than a copy does.
Outputs are deleted after each measurement, the checkpoint at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from miles.ckpt.shards import read_header, read_weight_map  # noqa: E402

DIMS = {  # ~1.1 B parameters: 2.2 GB in bf16
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32768,
}
LAYERS = 20
SHARD_BYTES = 1_000_000_000
STEPS = ("copy", "fp8", "torch_dist", "torch_dist-noverify")


def copy_baseline(src: Path, dst: Path) -> None:
    from safetensors.torch import load_file, save_file

    for shard in read_weight_map(src).shards:
        tensors = load_file(src / shard)
        save_file(tensors, dst / shard, metadata={"format": "pt"})
        del tensors
        with open(dst / shard, "rb+") as f:
            os.fsync(f.fileno())


def measure(step: str, src: Path, dst: Path) -> dict:
    """Run one step in this (fresh) process and return wall, CPU and peak RSS."""
    import warnings

    import torch  # noqa: F401 - imports happen before the clock: they are paid once per process

    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing
    import megatron.core.models.gpt  # noqa: F401

    from miles.ckpt.fp8 import convert_to_fp8
    from miles.ckpt.torch_dist import convert_to_torch_dist

    run = {
        "copy": lambda: copy_baseline(src, dst),
        "fp8": lambda: convert_to_fp8(src, dst),
        "torch_dist": lambda: convert_to_torch_dist(src, dst, "qwen3"),
        "torch_dist-noverify": lambda: convert_to_torch_dist(src, dst, "qwen3", verify=False),
    }[step]
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return {
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_start": rss_start,
    }


def tensor_bytes(path: Path) -> tuple[int, int]:
    """(sum of tensor bytes, largest shard file size) of a checkpoint."""
    files = read_weight_map(path)
    total = sum(t.nbytes for s in files.shards for t in read_header(path / s).tensors.values())
    return total, max((path / s).stat().st_size for s in files.shards)


def child(step: str, src: Path, dst: Path) -> dict:
    argv = [sys.executable, __file__, "--child", step, "--src", str(src), "--dst", str(dst)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{step} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/miles-bench-ckpt"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the source checkpoint")
    parser.add_argument("--child", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--src", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--dst", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.src, args.dst)))
        return 0

    from miles.ckpt.tiny import make_tiny_checkpoint

    args.dir.mkdir(parents=True, exist_ok=True)
    src = args.dir / "qwen3-bench"
    start = time.monotonic()
    make_tiny_checkpoint("qwen3", LAYERS, src, shard_bytes=SHARD_BYTES, **DIMS)
    total, largest = tensor_bytes(src)
    shards = len(read_weight_map(src).shards)
    print(f"checkpoint: {total / 1e9:.2f} GB of tensors in {shards} shards, largest shard {largest / 1e9:.2f} GB "
          f"(ready in {time.monotonic() - start:.0f} s); {len(os.sched_getaffinity(0))} CPUs")  # fmt: skip
    results: dict[str, list[dict]] = {step: [] for step in STEPS}
    for r in range(args.rounds):
        for step in STEPS:
            out = args.dir / f"out-{step}"
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            load = os.getloadavg()[0]
            m = child(step, src, out)
            shutil.rmtree(out)
            results[step].append(m)
            print(f"  round {r + 1} {step:<20} wall {m['wall']:6.1f} s  cpu {m['cpu']:6.1f} s  "
                  f"peak RSS {m['peak_rss'] / 1e9:.2f} GB  (load avg {load:.1f})", flush=True)  # fmt: skip
    copy = statistics.median(m["wall"] for m in results["copy"])
    print(f"\nmedian of {args.rounds} rounds; ratios against the copy measured alongside")
    for step in STEPS:
        wall = statistics.median(m["wall"] for m in results[step])
        cpu = statistics.median(m["cpu"] for m in results[step])
        peak = max(m["peak_rss"] for m in results[step])
        base = min(m["rss_start"] for m in results[step])
        print(f"{step:<20} {total / wall / 1e6:7.1f} MB/s  {copy / wall:5.2f}x copy speed  cpu {cpu:5.1f} s  "
              f"peak RSS {peak / 1e9:.2f} GB = {peak / largest:.2f}x largest shard "
              f"(process before the step: {base / 1e9:.2f} GB)")  # fmt: skip
    if not args.keep:
        shutil.rmtree(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
