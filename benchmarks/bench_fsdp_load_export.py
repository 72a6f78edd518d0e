"""Peak host memory per rank of the FSDP backend's load and weight export: before against now, side by side.

    python benchmarks/bench_fsdp_load_export.py [--ranks 2] [--layers 8] [--hidden 1024] [--vocab 8192] [--rounds 1]

Builds one Qwen3 checkpoint (tiny family, widened by --hidden/--layers; bf16 on disk), then, in
this one invocation, runs each case in fresh processes (`torch.distributed.run`, gloo, CPU):
  before  every rank loads the whole checkpoint in fp32 and shards it (FSDP2); the export
          gathers the whole fp32 state dict on every rank (get_model_state_dict, full) and
          hands it out as it is
  now     the backend as the trainer builds it (--train-backend fsdp): rank 0 reads the
          checkpoint into host memory, every rank builds the model empty, shards it and keeps
          its shard of each broadcast tensor; the export gathers one tensor at a time and casts
          it to the engine's dtype (bf16, SGLang's for a bf16 checkpoint)
Each rank reports its peak resident memory (VmHWM) above what it held once torch, the model
code and the process group were up: during the load, what it still holds after it (`held`), and,
after resetting the peak, during the export above what it held (the consumer drops each tensor,
as a streaming engine does). The largest tensor bounds the export's peak: keep --vocab small
against the layers, or the embedding is most of the model. On CPU the host is where the
model lives; on a GPU the same code keeps the whole model on rank 0's host only and a shard
on every device (untested on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# glibc serves large blocks from its heap once the first ones are freed (its mmap threshold
# grows) and does not give that heap back, so resident memory would keep whatever a case ever
# touched; a fixed threshold returns every freed large block, and resident memory is what is held.
ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20), "OMP_NUM_THREADS": "1"}

CHILD = r"""
import json, sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
import transformers  # noqa: F401  (imported before the baseline, by both cases)

def hwm_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])

def rss_kib():
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])

def reset_peak():
    Path("/proc/self/clear_refs").write_text("5")

case, hf, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
from miles.train.args import parse_config
from miles.train.backends.torch_dp import TorchDPBackend
from miles.train.distributed import init_distributed
from miles.train.model import load_causal_lm
info = init_distributed("gloo")
config = parse_config(["--hf-checkpoint", hf, "--train-backend", "fsdp", "--actor-num-gpus-per-node",
                       str(info.world_size), "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"])
from miles.train.backends import make_backend
dist.barrier()
base = rss_kib()
reset_peak()
if case == "before":
    backend = object.__new__(TorchDPBackend)  # only its sharding, as the backend applied it before
    backend.compute_dtype = torch.float32
    model = load_causal_lm(hf, dtype=torch.float32)
    backend._shard(model)
else:
    backend = make_backend(config, info)
    model = backend.model
dist.barrier()
load_peak = hwm_kib() - base
held = rss_kib() - base
reset_peak()
seen = 0
if case == "before":
    for name, tensor in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items():
        seen += tensor.numel()  # handed out in fp32, as the trainer held it
else:
    for name, tensor in backend.full_weights(names="model", dtype=torch.bfloat16):
        seen += tensor.numel()
        del tensor
dist.barrier()
(out / f"rank-{info.rank}.json").write_text(json.dumps(
    {"rank": info.rank, "load": load_peak, "held": held, "export": hwm_kib() - base - held, "numel": seen}))
dist.destroy_process_group()
"""


def run_case(case: str, hf: Path, ranks: int) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix=f"miles-bench-fsdp-{case}-"))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "--no-python", sys.executable, "-c", CHILD, case, str(hf), str(out)],
        capture_output=True, text=True, env={**os.environ, **ENV, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    rows = [json.loads(path.read_text()) for path in out.glob("rank-*.json")]
    shutil.rmtree(out, ignore_errors=True)
    if done.returncode or len(rows) != ranks:
        raise SystemExit(f"{case}: exit {done.returncode}\n{(done.stdout + done.stderr)[-3000:]}")
    return sorted(rows, key=lambda row: row["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--dir", default=None, help="where to build the checkpoint (default: a temporary dir)"
    )
    args = parser.parse_args()
    from miles.ckpt.tiny import make_tiny_checkpoint

    root = Path(args.dir or tempfile.mkdtemp(prefix="miles-bench-fsdp-"))
    dims = {"hidden_size": args.hidden, "intermediate_size": 3 * args.hidden, "vocab_size": args.vocab}
    hf = make_tiny_checkpoint("qwen3", args.layers, root / "qwen3", progress=False, **dims)
    results: dict[str, list[list[dict]]] = {"before": [], "now": []}
    for _ in range(args.rounds):
        for case in results:
            results[case].append(run_case(case, hf, args.ranks))
    numel = results["now"][0][0]["numel"]
    if results["before"][0][0]["numel"] != numel:
        raise SystemExit("the two exports handed out different tensors")
    fp32_mib = numel * 4 / (1 << 20)
    print(
        f"qwen3 {args.layers} layers, hidden {args.hidden}: {numel / 1e6:.1f}M parameters "
        f"({fp32_mib:.0f} MiB in fp32), {args.ranks} gloo ranks, {args.rounds} round(s); "
        "median peak MiB above each rank's baseline, ratio now/before"
    )
    for phase in ("load", "held", "export"):
        for rank in range(args.ranks):
            before, now = (
                statistics.median(r[rank][phase] for r in results[case]) / 1024 for case in results
            )
            print(
                f"  {phase:<6} rank {rank}: before {before:8.0f} MiB ({before / fp32_mib:4.2f}x model)  "
                f"now {now:8.0f} MiB ({now / fp32_mib:4.2f}x model)  now/before {now / before:6.3f}"
            )
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"({time.perf_counter() - start:.0f} s in all)")
