"""Training throughput of one GRPO step: the Megatron backend against the FSDP backend.

CPU mode (the default). Same tiny Qwen3 (random weights, float32), same command, same two gloo
ranks, same samples (both start from the same weights and seeds, so rollout 0 is identical):
only the training backend and its layout differ. Each configuration is one `python -m
miles.train` run of a few rollouts; the first is a warm-up, and the step time is the median of
the others' `perf/train_time` (old and reference logprobs plus the optimizer steps). Tokens/s
counts the prompt and response tokens trained on per rollout. Configurations: FSDP2 (data
parallel over 2 ranks, its default settings), Megatron with the same data-parallel layout
(DDP + distributed optimizer), Megatron TP=2 with sequence parallelism. The ratio against
FSDP is printed for each.

    python benchmarks/bench_train_backends.py [--rollouts 6] [--hidden 256] [--layers 4]

GPU mode (`--gpu`, one GPU): the Megatron backend with Transformer Engine's layer spec (fused
attention, grouped-GEMM experts for the MoE shape, overlapped gradient reduction) and with the
stand-in spec, against HF with SDPA under FSDP, on one model shape in bf16 and the same fixed
rollouts (written once by this script and loaded with --load-debug-rollout-data, so no engine
samples and every configuration trains on identical tokens). It prints tokens/s, TFLOP/s and
MFU (from the shape: the formula is printed; peak from the GPU's datasheet) and each ratio
against HF+SDPA, and each Megatron run's first line (the modules it built). A configuration
that cannot run (no Transformer Engine in the image) prints its one-line reason.

    python benchmarks/bench_train_backends.py --gpu [--shape dense-1b|moe] [--rollouts 4]
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

from miles.metrics.records import MAX_RECORD_FILES, read_record

PROMPT_TOKENS = 10  # "code 1234:" in the tiny checkpoints' byte-level tokenizer
# The GPU mode's models, bf16. dense-1b: a 16-layer Qwen3 of 1.12B parameters (tied embeddings);
# moe: a 4-layer Qwen3-MoE slice with Qwen3-30B-A3B's expert shape (128 experts, top 8).
SHAPES = {
    "dense-1b": ("qwen3", 16, dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                   num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=1)),
    "moe": ("qwen3_moe", 4, dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                 num_experts=128, num_experts_per_tok=8, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, vocab_size=151936)),
}  # fmt: skip
# Dense bf16 tensor throughput per GPU, from each vendor's datasheet (no sparsity).
PEAK_BF16 = (
    ("H200", 989e12),  # NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16
    ("H100", 989e12),  # NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 TFLOPS BF16
    ("MI355X", 2516.6e12),  # AMD Instinct MI355X datasheet: 2.5 PFLOPS FP16/BF16
    ("MI300X", 1307.4e12),  # AMD Instinct MI300X datasheet: 1307.4 TFLOPS FP16/BF16
)


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
    for path in sorted(record.glob("*.jsonl"))[:MAX_RECORD_FILES]:  # read bounded, as the gate reads them
        for metric, points in read_record(path).items():
            series.setdefault(metric, {}).update(points)
    steps = sorted(series["perf/train_time"])[1:]  # rollout 0 warms up
    train_time = statistics.median(series["perf/train_time"][s] for s in steps)
    length = statistics.median(series["rollout/response_len"][s] for s in steps)
    tokens = samples * (PROMPT_TOKENS + length)
    return {"train_s": train_time, "tokens_per_s": tokens / train_time}


# --- GPU mode ----------------------------------------------------------------------------------

GPU_CONFIGS = {  # name -> (training backend, its flags); the TE spec adds --moe-grouped-gemm for a MoE
    "megatron, TE spec": ("megatron", ("--transformer-impl", "transformer_engine", "--attention-backend", "flash",
                                       "--overlap-grad-reduce")),
    "megatron, stand-in spec": ("megatron", ("--transformer-impl", "local")),
    "hf+sdpa, fsdp": ("fsdp", ()),
}  # fmt: skip
FLOPS_FORMULA = (
    "per token, forward: 2 x (q, k, v, o projections + MLP (dense 3 x hidden x ffn; MoE top-k x 3 x hidden x "
    "expert ffn + the router) per layer + the LM head) + causal attention 2 x seq x heads x head_dim per layer; "
    "a step counts 3 x forward (forward + backward) plus 1 x forward for the old logprobs"
)


def forward_flops_per_token(config: dict, seq: int) -> float:
    """Matmul FLOPs of one token's forward (FLOPS_FORMULA), from a config.json."""
    h, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    kv = config.get("num_key_value_heads", heads)
    projections = h * head_dim * (2 * heads + 2 * kv)
    if config.get("num_experts"):
        mlp = (
            config["num_experts_per_tok"] * 3 * h * config["moe_intermediate_size"]
            + h * config["num_experts"]
        )
    else:
        mlp = 3 * h * config["intermediate_size"]
    attention = seq * heads * head_dim  # QK^T and AV over seq/2 keys on average: 2 x (seq/2) MACs each
    layers = config["num_hidden_layers"]
    return 2 * (layers * (projections + mlp + attention) + h * config["vocab_size"])


def write_rollouts(path: Path, rollouts: int, samples: int, prompt: int, response: int, vocab: int) -> None:
    """Fixed samples for every rollout (GRPO groups of 4 with distinct rewards), for --load-debug-rollout-data."""
    import random

    from miles.train.batch import Sample, save_samples
    from miles.train.rollout import Generation

    rng = random.Random(0)
    for r in range(rollouts):
        rows = []
        for i in range(samples):
            ids = tuple(rng.randrange(300, vocab) for _ in range(prompt + response))
            generation = Generation(ids[:prompt], ids[prompt:], (-1.0,) * response, "length")
            rows.append(Sample(i // 4, i // 4, generation, "", "", float(i % 4)))
        save_samples(str(path).format(rollout_id=r), rows)


def gpu_run(work: Path, hf: Path, dist: Path, rollouts: int, samples: int, response: int, backend: str,
            flags: tuple[str, ...]) -> dict:  # fmt: skip
    record = work / "record"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "miles.train",
        "--hf-checkpoint", str(hf), "--load-debug-rollout-data", str(work.parent / "rollout_{rollout_id}.json"),
        "--num-rollout", str(rollouts), "--rollout-batch-size", str(samples // 4), "--n-samples-per-prompt", "4",
        "--global-batch-size", str(samples), "--micro-batch-size", "1", "--rollout-max-response-len", str(response),
        "--rollout-engine", "torch", "--bf16", "--lr", "1e-6", "--train-backend", backend, *flags,
    ]  # fmt: skip
    if backend == "megatron":
        cmd += ["--ref-load", str(dist)]
    env = {**os.environ, "MILES_CI_GATE_RECORD_DIR": str(record)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    first = next((line for line in proc.stdout.splitlines() if "layer spec" in line), "")
    if proc.returncode:
        said = [line for line in proc.stderr.splitlines() if line.startswith("miles.train: ")]
        tail = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
        return {"error": (said or tail or [f"exit {proc.returncode}"])[-1], "first_line": first}
    times = {}
    for path in sorted(record.glob("*.jsonl"))[:MAX_RECORD_FILES]:
        times.update(read_record(path).get("perf/train_time", {}))
    return {"train_s": statistics.median(times[s] for s in sorted(times)[1:]), "first_line": first}


def gpu_main(shape: str, rollouts: int, samples: int, prompt: int, response: int) -> None:
    import importlib.metadata

    import torch

    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    if not torch.cuda.is_available():
        sys.exit("--gpu: no GPU is visible to torch")
    family, layers, dims = SHAPES[shape]
    seq = prompt + response
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        hf = make_tiny_checkpoint(family, layers, root / "hf", dtype="bfloat16", **dims)
        dist = root / "torch_dist"
        dist.mkdir()
        convert_to_torch_dist(hf, dist, family)
        config = json.loads((hf / "config.json").read_text())
        write_rollouts(
            root / "rollout_{rollout_id}.json", rollouts, samples, prompt, response, config["vocab_size"]
        )
        results = {}
        for name, (backend, flags) in GPU_CONFIGS.items():
            if backend == "megatron" and "transformer_engine" in flags and config.get("num_experts"):
                flags = (*flags, "--moe-grouped-gemm")
            work = root / name.replace(" ", "_").replace(",", "")
            work.mkdir()
            results[name] = gpu_run(work, hf, dist, rollouts, samples, response, backend, flags)
    device = torch.cuda.get_device_name(0)
    peak = next((value for key, value in PEAK_BF16 if key in device), None)
    step_flops = samples * seq * 4 * forward_flops_per_token(config, seq)
    versions = {}
    for dist_name in ("transformer-engine", "flash-attn-4", "flash-attn", "megatron-core", "torch"):
        try:
            versions[dist_name] = importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            pass
    print(
        f"{shape}: {family} {layers} layers {json.dumps(dims)}, bf16; {samples} samples x {seq} tokens per rollout "
        f"(one optimizer step), micro-batch 1; median of {rollouts - 1} rollouts after a warm-up; {device}; "
        + ", ".join(f"{k} {v}" for k, v in versions.items())
    )
    print(f"FLOPs: {FLOPS_FORMULA}; {step_flops / 1e12:.1f} TFLOP per rollout")
    base = results["hf+sdpa, fsdp"].get("train_s")
    print(f"{'configuration':<26} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'vs hf+sdpa':>10}")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<26} cannot run: {r['error']}")
            continue
        tflops = step_flops / r["train_s"] / 1e12
        mfu = f"{tflops * 1e12 / peak:6.1%}" if peak else "     -"
        ratio = f"{base / r['train_s']:9.2f}x" if base else "        -"
        print(f"{name:<26} {samples * seq / r['train_s']:>9.0f} {tflops:>8.1f} {mfu} {ratio}")
    for name, r in results.items():
        if r.get("first_line"):
            print(f"{name}: {r['first_line']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=None, help="default: 6 on CPU, 4 with --gpu")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--samples", type=int, default=None, help="samples per rollout (CPU 64, GPU 8)")
    parser.add_argument(
        "--response", type=int, default=None, help="response tokens (CPU at most 32, GPU 3840)"
    )
    parser.add_argument("--gpu", action="store_true", help="the GPU mode (see above)")
    parser.add_argument("--shape", default="dense-1b", choices=tuple(SHAPES), help="GPU mode's model")
    parser.add_argument("--prompt", type=int, default=256, help="GPU mode: prompt tokens")
    opts = parser.parse_args()
    if opts.gpu:
        gpu_main(opts.shape, opts.rollouts or 4, opts.samples or 8, opts.prompt, opts.response or 3840)
        return
    opts.rollouts, opts.samples, opts.response = opts.rollouts or 6, opts.samples or 64, opts.response or 32
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
