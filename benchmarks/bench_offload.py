"""Peak resident memory of the training process during the rollout phase, without and with disk offload.

Each case is a fresh `python -m miles.train` process, a world of one on the CPU, training a
random Qwen3 (by default 6 layers of width 1024, about 94M parameters: float32 master weights,
their gradients and AdamW's two moments, 16 bytes a parameter, beside the built-in rollout
engine's own float32 copy) on the synthetic task. The trainer records the rollout phase's peak
resident memory every rollout (`perf/rollout_peak_rss_mb`: the peak is reset through
/proc/self/clear_refs before generation and read from VmHWM after scoring). The first rollout
has no optimizer state yet, so each case reports the largest peak of the later ones; `plain`
keeps the trainer's state resident, `disk` runs with `--offload-train --offload-train-target
disk` (the state written to disk and its memory handed back to the system while the engine
generates). The gradient norms and losses of the two are compared too: they must be equal.

    python benchmarks/bench_offload.py [--layers 6] [--hidden 1024] [--rollouts 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {"plain": (), "disk": ("--offload-train", "--offload-train-target", "disk")}


def model(root: Path, layers: int, hidden: int) -> Path:
    from miles.ckpt.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(
        "qwen3", layers, root / "model", hidden_size=hidden, intermediate_size=4 * hidden,
        num_attention_heads=16, num_key_value_heads=8, head_dim=hidden // 16, progress=False,
    )  # fmt: skip


def run_case(name: str, hf: Path, root: Path, rollouts: int) -> dict[str, dict[int, float]]:
    """One fresh trainer process; its recorded series of the rollout peak and the loss."""
    from miles.metrics.capture import RECORD_DIR_ENV

    record = root / f"record-{name}"
    extra = CASES[name]
    if name == "disk":
        extra = (*extra, "--offload-train-disk-dir", str(root / "offload"))
    cmd = [
        sys.executable, "-m", "miles.train", "--hf-checkpoint", str(hf), "--prompt-data", "synthetic:fixed",
        "--num-rollout", str(rollouts), "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
        "--rollout-max-response-len", "8", "--lr", "1e-4", "--num-threads", "2", *extra,
    ]  # fmt: skip
    env = {**os.environ, RECORD_DIR_ENV: str(record), "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(
            f"{name}: the trainer exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}"
        )
    out: dict[str, dict[int, float]] = {}
    for path in record.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row["metric"] in ("perf/rollout_peak_rss_mb", "train/loss", "train/grad_norm"):
                out.setdefault(row["metric"], {}).update({int(s): float(v) for s, v in row["series"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--rollouts", type=int, default=3)
    args = parser.parse_args()
    if args.rollouts < 2:
        raise SystemExit("--rollouts must be >= 2: the first rollout has no optimizer state to offload")
    with tempfile.TemporaryDirectory(prefix="bench-offload-") as tmp:
        root = Path(tmp)
        hf = model(root, args.layers, args.hidden)
        results = {name: run_case(name, hf, root, args.rollouts) for name in CASES}
    peaks = {
        name: max(v for s, v in r["perf/rollout_peak_rss_mb"].items() if s >= 1)
        for name, r in results.items()
    }
    print(f"{'case':<6} {'rollout-phase peak RSS (MiB), per rollout':<48} {'peak after rollout 0':>20}")
    for name, r in results.items():
        series = ", ".join(f"{v:.0f}" for _, v in sorted(r["perf/rollout_peak_rss_mb"].items()))
        print(f"{name:<6} {series:<48} {peaks[name]:>17.0f} MiB")
    print(f"disk / plain: {peaks['disk'] / peaks['plain']:.2f}x (target <= 0.5x)")
    for key in ("train/grad_norm", "train/loss"):
        same = results["plain"][key] == results["disk"][key]
        print(
            f"{key} equal: {same} ({', '.join(f'{v:.6g}' for _, v in sorted(results['disk'][key].items()))})"
        )


if __name__ == "__main__":
    main()
