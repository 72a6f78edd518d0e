"""Peak memory of the Megatron backend's logprob and entropy: the fused form against the unfused one.

One training micro-batch's loss head: the vocabulary-parallel logprob and entropy of every
token (miles.megatron.loss), then the backward into the logits, on the same [1, tokens, vocab]
logits. `unfused` is the plain-autograd form (several float32 copies of the logits held for the
backward); `fused` the one the backend runs (blocks of tokens in float32, four numbers per token
kept). Each runs in a fresh child process; the peak is what the step adds above the logits
themselves (peak RSS on CPU, from /proc/self/status with the high-water mark reset; peak
allocated CUDA memory on a GPU). The gradient of the logits is part of both. Values are
compared between the two: logprob, entropy and gradient, float32.

    python benchmarks/bench_logprob_memory.py [--tokens 1024] [--vocab 151936] [--dtype float32] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("unfused", "fused")


def _rss_peak_kib() -> int:
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def _rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def child(
    variant: str, tokens: int, vocab: int, dtype_name: str, device: str, repeats: int, out: str
) -> None:
    import warnings

    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist

    from miles.megatron import loss
    from miles.megatron.checkpoint import single_process_group

    torch.set_num_threads(1)
    fn = loss.vocab_parallel_logprobs if variant == "fused" else loss.unfused_vocab_parallel_logprobs
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    with single_process_group():
        if not dist.is_initialized():
            raise SystemExit("no process group")
        logits = (torch.randn(1, tokens, vocab, generator=gen) * 3).to(device=device, dtype=dtype)
        targets = torch.randint(0, vocab, (1, tokens), generator=gen).to(device)
        w_logp, w_ent = (
            torch.randn(1, tokens, generator=gen).to(device),
            torch.randn(1, tokens, generator=gen).to(device),
        )
        times, peak = [], None
        for i in range(repeats):
            x = logits.clone().requires_grad_(True)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            else:
                Path("/proc/self/clear_refs").write_text("5")
                base = _rss_kib() * 1024
            started = time.perf_counter()
            logp, ent = fn(x, targets, 1.0, vocab, with_entropy=True)
            ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
            if device == "cuda":
                torch.cuda.synchronize()
                added = torch.cuda.max_memory_allocated() - base
            else:
                added = _rss_peak_kib() * 1024 - base
            times.append(time.perf_counter() - started)
            peak = added if peak is None else min(peak, added)
            if i + 1 < repeats:
                del x, logp, ent
        torch.save(
            {
                "logp": logp.detach().float().cpu(),
                "entropy": ent.detach().float().cpu(),
                "grad": x.grad.float().cpu(),
            },
            out,
        )
    print(json.dumps({"peak_bytes": peak, "seconds": statistics.median(times)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        child(opts.child, opts.tokens, opts.vocab, opts.dtype, opts.device, opts.repeats, opts.out)
        return
    import torch

    results, outputs = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in VARIANTS:
            out = f"{tmp}/{variant}.pt"
            cmd = [sys.executable, __file__, "--child", variant, "--out", out, "--tokens", str(opts.tokens),
                   "--vocab", str(opts.vocab), "--dtype", opts.dtype, "--device", opts.device,
                   "--repeats", str(opts.repeats)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"{variant}: exited {proc.returncode}:\n{proc.stderr[-3000:]}")
            results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
            outputs[variant] = torch.load(out)
    logits_mb = (
        opts.tokens * opts.vocab * torch.tensor([], dtype=getattr(torch, opts.dtype)).element_size() / 2**20
    )
    print(
        f"logprob + entropy, forward and backward: [1 x {opts.tokens} tokens x {opts.vocab} vocab] {opts.dtype} "
        f"logits ({logits_mb:.0f} MiB), tp 1, {opts.device}; peak above the logits, best of {opts.repeats}"
    )
    print(f"{'variant':<10} {'peak MiB':>9} {'x logits':>9} {'time s':>8}")
    for variant, r in results.items():
        mib = r["peak_bytes"] / 2**20
        print(f"{variant:<10} {mib:>9.0f} {mib / logits_mb:>9.2f} {r['seconds']:>8.3f}")
    ratio = results["fused"]["peak_bytes"] / results["unfused"]["peak_bytes"]
    print(f"peak ratio fused / unfused: {ratio:.3f}")
    diffs = {
        k: float((outputs["fused"][k] - outputs["unfused"][k]).abs().max())
        for k in ("logp", "entropy", "grad")
    }
    print("max |fused - unfused| (float32): " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))


if __name__ == "__main__":
    main()
