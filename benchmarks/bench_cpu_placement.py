"""Seconds per Megatron training step on CPU with and without compat's lifts, side by side.

miles.megatron.compat runs megatron-core's CUDA-assuming functions under a torch function mode
that moves their CUDA placements to the CPU. A redirected schedule would hold that mode over the
whole microbatch forward, so every torch call of the model went through Python; compat.LIFTS
take it off for megatron-core's forward_step and backward_step. This script measures what that
buys: the Megatron backend the trainer builds from the tiny checkpoint's flags (one gloo rank,
float32) computes logprobs and takes a training step on the same batch `--steps` times, in a
fresh process per configuration (lifts as installed, and `compat.LIFTS = ()` before install),
alternating `--repeats` times; it prints the median seconds per step of each and their ratio.
Wall time is measured here only, never asserted by a test.

    python benchmarks/bench_cpu_placement.py [--family glm_moe_dsa] [--steps 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORKER = r"""
import json, os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from miles.megatron import compat
if sys.argv[3] == "unlifted":
    compat.LIFTS = ()
from miles.train.args import parse_config, validate_world
from miles.train.backends import make_backend
from miles.train.batch import TokenBatch
from miles.train.distributed import init_distributed

dist_info = init_distributed("gloo")
config = parse_config([
    "--hf-checkpoint", sys.argv[1], "--ref-load", sys.argv[2], "--train-backend", "megatron",
    "--actor-num-gpus-per-node", "1", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
    "--global-batch-size", "32", "--micro-batch-size", "16", "--lr", "1e-4",
])
validate_world(config, dist_info.world_size)
backend = make_backend(config, dist_info)
gen = torch.Generator().manual_seed(0)
ids = torch.randint(3, backend.config["vocab_size"], (32, 24), generator=gen)
mask = torch.zeros(32, 23)
mask[:, 12:] = 1.0
adv = torch.randn(32, generator=gen)
batch = TokenBatch(ids, torch.ones_like(ids), mask, adv, torch.zeros(32, 23))
times = []
for step in range(int(sys.argv[4]) + 1):
    start = time.perf_counter()
    micro = [batch.rows(slice(s, s + 16)) for s in (0, 16)]
    olds = backend.batch_logprobs(micro)
    micro = [mb.with_(old_logp=old) for mb, old in zip(micro, olds)]
    backend.train_step(micro, normalizer=32.0)
    if step:  # the first step is a warm-up
        times.append(time.perf_counter() - start)
print("RESULT " + json.dumps(times), flush=True)
torch.distributed.destroy_process_group()
"""


def run(case: str, hf: Path, torch_dist: Path, steps: int) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(WORKER)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", f.name,
             str(hf), str(torch_dist), case, str(steps)],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=1800,
        )  # fmt: skip
    finally:
        os.unlink(f.name)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{case}: the worker exited {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="glm_moe_dsa", help="a tiny family with a torch_dist form")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from miles.ckpt.tiny_cache import tiny_checkpoint

    with tempfile.TemporaryDirectory() as root:
        entry = tiny_checkpoint(args.family, args.layers, torch_dist=True, root=Path(root))
        seconds: dict[str, list[float]] = {"lifted": [], "unlifted": []}
        for _ in range(args.repeats):
            for case in seconds:  # alternating, so drift on a shared machine hits both alike
                seconds[case] += run(case, entry.hf, entry.torch_dist, args.steps)
    median = {case: statistics.median(values) for case, values in seconds.items()}
    print(
        f"tiny {args.family} ({args.layers} layers), 1 gloo rank, {args.steps} steps x {args.repeats} runs each:"
    )
    for case, value in median.items():
        print(f"  {case:9s} {value:.3f} s per step (logprobs + train step)")
    print(f"  unlifted / lifted = {median['unlifted'] / median['lifted']:.2f}x")


if __name__ == "__main__":
    main()
