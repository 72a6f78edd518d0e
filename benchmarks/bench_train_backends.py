"""Training throughput of one GRPO step: the Megatron backend against the FSDP backend.

Same tiny Qwen3 (random weights, float32), same command, same two gloo ranks, same samples
(both start from the same weights and seeds, so rollout 0 is identical): only the training
backend and its layout differ. Each configuration is one `python -m miles.train` run of a
few rollouts; the first is a warm-up, and the step time is the median of the others'
`perf/train_time` (old and reference logprobs plus the optimizer steps). Tokens/s counts the
prompt and response tokens trained on per rollout.

Configurations: FSDP2 (data parallel over 2 ranks, its default settings), Megatron with the
same data-parallel layout (DDP + distributed optimizer), Megatron TP=2 with sequence
parallelism. The ratio against FSDP is printed for each.

    python benchmarks/bench_train_backends.py [--rollouts 6] [--hidden 256] [--layers 4]
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

PROMPT_TOKENS = 10  # "code 1234:" in the tiny checkpoints' byte-level tokenizer


def prepare(workdir: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    hf = make_tiny_checkpoint(
        "qwen3", layers, workdir / "hf", hidden_size=hidden, intermediate_size=hidden * 3
    )
    dist = workdir / "torch_dist"
    if not dist.exists():
        dist.mkdir()
        convert_to_torch_dist(hf, dist, "qwen3")
    return hf, dist


def run(workdir: Path, hf: Path, rollouts: int, samples: int, response: int, *backend: str) -> dict:
    record = workdir / "record"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "miles.train",
        "--hf-checkpoint", str(hf), "--prompt-data", "synthetic:fixed", "--num-rollout", str(rollouts),
        "--rollout-batch-size", "8", "--n-samples-per-prompt", str(samples // 8),
        "--global-batch-size", str(samples // 2), "--micro-batch-size", "8",
        "--rollout-max-response-len", str(response), "--lr", "1e-4", "--use-kl-loss",
        "--actor-num-gpus-per-node", "2", "--num-threads", "1", *backend,
    ]  # fmt: skip
    env = {**os.environ, "MILES_CI_GATE_RECORD_DIR": str(record), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(backend)}: miles.train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    series: dict[str, dict[int, float]] = {}
    for path in record.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            series.setdefault(row["metric"], {}).update({int(s): float(v) for s, v in row["series"]})
    steps = sorted(series["perf/train_time"])[1:]  # rollout 0 warms up
    train_time = statistics.median(series["perf/train_time"][s] for s in steps)
    length = statistics.median(series["rollout/response_len"][s] for s in steps)
    tokens = samples * (PROMPT_TOKENS + length)
    return {"train_s": train_time, "tokens_per_s": tokens / train_time}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=64, help="samples per rollout (2 optimizer steps)")
    parser.add_argument("--response", type=int, default=32, help="max response tokens")
    opts = parser.parse_args()
    configs = {
        "fsdp (dp2)": ("--train-backend", "fsdp"),
        "megatron (dp2)": ("--train-backend", "megatron"),
        "megatron (tp2+sp)": (
            "--train-backend",
            "megatron",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf, dist = prepare(root, opts.hidden, opts.layers)
        results = {}
        for name, flags in configs.items():
            extra = ("--ref-load", str(dist)) if "megatron" in flags else ()
            work = root / name.replace(" ", "_")
            work.mkdir()
            results[name] = run(work, hf, opts.rollouts, opts.samples, opts.response, *flags, *extra)
    base = results["fsdp (dp2)"]["tokens_per_s"]
    print(
        f"tiny qwen3 hidden {opts.hidden} x {opts.layers} layers, float32, 2 gloo ranks, {opts.samples} samples "
        f"per rollout, median of {opts.rollouts - 1} rollouts after a warm-up"
    )
    print(f"{'backend':<20} {'train step s':>12} {'tokens/s':>10} {'vs fsdp':>8}")
    for name, r in results.items():
        print(
            f"{name:<20} {r['train_s']:>12.3f} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / base:>7.2f}x"
        )


if __name__ == "__main__":
    main()
