"""Checkpoint conversion speed and memory against plain copies of the same bytes, side by side.

    python benchmarks/bench_ckpt.py [--dir /tmp/miles-bench-ckpt] [--rounds 3] [--keep]

Builds a multi-GB checkpoint with make_tiny_checkpoint (Qwen3 architecture, larger dims,
untied embeddings), then alternates, round after round, within this one invocation:
  cp              `cp -r --reflink=never` of the directory, then `sync` on every file (fsync):
                  the floor, a copy that decodes nothing
  safetensors-mt  safetensors load_file + save_file + fsync of every shard, one thread per
                  shard (as many as the CPUs allow): the peer's fastest way to rewrite shards
  validate        miles.ckpt.validate.validate_checkpoint, every value scanned for NaN/Inf
  fp8             miles.ckpt.fp8.convert_to_fp8 (block-wise e4m3, fsynced; all CPUs)
  torch_dist      miles.ckpt.torch_dist.convert_to_torch_dist (Megatron layout, loaded back)
  torch_dist-noverify  the same without the load-back check
Each measurement runs in a fresh child process started from a small launcher (imports done
before the clock starts). Its memory is read from the child's own /proc/self/status: VmHWM,
the peak resident size of that process alone (a child's ru_maxrss would inherit the
parent's), and the peak during the step alone (VmHWM reset through /proc/self/clear_refs
after the imports). cp's own peak comes from getrusage(RUSAGE_CHILDREN) of a launcher
that imports nothing heavy. Throughput is the source's tensor bytes per wall-clock second;
each ratio divides the baseline's median time by the step's (above 1: faster than it).
Outputs are deleted after each measurement, the checkpoint at the end unless --keep. The
source stays in the page cache across rounds, so every case reads it from memory alike.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DIMS = {  # ~1.1 B parameters: 2.2 GB in bf16
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 32768,
    "tie_word_embeddings": 0,
}
LAYERS = 20
SHARD_BYTES = 1_000_000_000
BASELINES = ("cp", "safetensors-mt")
STEPS = (*BASELINES, "validate", "fp8", "torch_dist", "torch_dist-noverify")


def _status_kb(field: str) -> int:
    """A field of /proc/self/status in kB (VmHWM: peak resident, VmRSS: resident now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)


def cp_baseline(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-r", "--reflink=never", f"{src}/.", str(dst)], check=True)
    files = [str(p) for p in dst.rglob("*") if p.is_file()]
    subprocess.run(["sync", *files], check=True)  # fsync of each file, as the steps do


def safetensors_baseline(src: Path, dst: Path) -> int:
    from safetensors.torch import load_file, save_file

    from miles.ckpt.shards import read_weight_map

    shards = read_weight_map(src).shards
    threads = min(len(shards), len(os.sched_getaffinity(0)))

    def rewrite(shard: str) -> None:
        save_file(load_file(src / shard), dst / shard, metadata={"format": "pt"})
        with open(dst / shard, "rb+") as f:
            os.fsync(f.fileno())

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(rewrite, shards))
    return threads


def measure(step: str, src: Path, dst: Path) -> dict:
    """Run one step in this (fresh) process: wall and CPU seconds, peak RSS (process, step)."""
    extra: dict = {}
    if step == "cp":
        before = _status_kb("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        cp_baseline(src, dst)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return {
            "wall": time.perf_counter() - wall,
            "cpu": children.ru_utime + children.ru_stime,
            "peak_rss": max(children.ru_maxrss, _status_kb("VmHWM")) * 1024,
            "step_peak": max(children.ru_maxrss - before, 0) * 1024,
        }
    import warnings

    import torch  # noqa: F401 - imports happen before the clock: they are paid once per process

    warnings.simplefilter("ignore")
    import megatron.core.dist_checkpointing
    import megatron.core.models.gpt  # noqa: F401

    from miles.ckpt.fp8 import convert_to_fp8
    from miles.ckpt.torch_dist import convert_to_torch_dist
    from miles.ckpt.validate import validate_checkpoint

    run = {
        "safetensors-mt": lambda: extra.update(threads=safetensors_baseline(src, dst)),
        "validate": lambda: validate_checkpoint(src, "qwen3", expect_layers=LAYERS),
        "fp8": lambda: convert_to_fp8(src, dst),
        "torch_dist": lambda: convert_to_torch_dist(src, dst, "qwen3"),
        "torch_dist-noverify": lambda: convert_to_torch_dist(src, dst, "qwen3", verify=False),
    }[step]
    start_rss = _status_kb("VmRSS")
    _reset_peak()
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return {
        "wall": time.perf_counter() - wall,
        "cpu": time.process_time() - cpu,
        "step_peak": (_status_kb("VmHWM") - start_rss) * 1024,  # reset above: the step's own peak
        "peak_rss": _status_kb("VmHWM") * 1024,
        "start_rss": start_rss * 1024,
        **extra,
    }


def tensor_bytes(path: Path) -> tuple[int, int]:
    """(sum of tensor bytes, largest shard file size) of a checkpoint."""
    from miles.ckpt.shards import read_header, read_weight_map

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
    files = sorted(p for p in src.glob("*.safetensors"))
    cpus = len(os.sched_getaffinity(0))
    print(f"checkpoint: {total / 1e9:.2f} GB of tensors in {len(files)} shards, largest shard {largest / 1e9:.2f} GB "
          f"(ready in {time.monotonic() - start:.0f} s); {cpus} CPUs")  # fmt: skip
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
                  f"peak RSS {m['peak_rss'] / 1e9:.2f} GB (step {m['step_peak'] / 1e9:.2f} GB)  "
                  f"(load avg {load:.1f})", flush=True)  # fmt: skip
    median = {step: statistics.median(m["wall"] for m in results[step]) for step in STEPS}
    threads = results["safetensors-mt"][0].get("threads")
    print(f"\nmedian of {args.rounds} rounds; each ratio is the baseline's time / the step's time "
          f"(cp: coreutils cp + sync; safetensors-mt: {threads} threads, one per shard)")  # fmt: skip
    print(
        f"{'step':<20} {'MB/s':>7}  {'vs cp':>6}  {'vs st-mt':>8}  {'cpu s':>6}  peak RSS (process / step alone)"
    )
    for step in STEPS:
        wall = median[step]
        cpu = statistics.median(m["cpu"] for m in results[step])
        peak = max(m["peak_rss"] for m in results[step])
        step_peak = max(m["step_peak"] for m in results[step])
        print(f"{step:<20} {total / wall / 1e6:7.1f}  {median['cp'] / wall:5.2f}x  {median['safetensors-mt'] / wall:7.2f}x  "
              f"{cpu:6.1f}  {peak / 1e9:.2f} GB / {step_peak / 1e9:.2f} GB = {step_peak / largest:.2f}x largest shard")  # fmt: skip
    if not args.keep:
        shutil.rmtree(src)
    return 0


if __name__ == "__main__":
    sys.exit(main())
