"""Process-group setup, seeding and the few collectives the trainer uses.

Under torchrun the rank, world size and rendezvous come from the environment; run directly
(`python -m miles.train ...`) the trainer is a world of one, with the same code path.
"""

from __future__ import annotations

import atexit
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda:<local rank>" (ROCm builds also say cuda)
    backend: str  # gloo | nccl

    @property
    def is_main(self) -> bool:
        return self.rank == 0


# Where collective tensors live: NCCL/RCCL only reduce GPU tensors, gloo takes CPU ones.
_collective_device = "cpu"


def init_distributed(requested_backend: str | None = None, *, deterministic: bool = False) -> DistInfo:
    """Join (or create) the default process group; NCCL/RCCL on GPU, gloo on CPU. With
    `deterministic`, wrapped so that its sums have a fixed order (miles.train.deterministic)."""
    gpu = torch.cuda.is_available()
    backend = requested_backend or ("nccl" if gpu else "gloo")
    if backend == "nccl" and not gpu:
        from miles.train.args import ArgsError

        build = f"torch {torch.__version__}, " + (
            "a CUDA/ROCm build that sees no GPU"
            if torch.version.cuda or torch.version.hip
            else "a CPU-only build"
        )
        raise ArgsError(
            f"--distributed-backend nccl needs a CUDA or ROCm GPU and this process sees none ({build}); "
            "use --distributed-backend gloo, or drop the flag (gloo on CPU, NCCL/RCCL on GPUs)"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local_rank}" if gpu else "cpu"
    if gpu:
        torch.cuda.set_device(local_rank)
    global _collective_device
    _collective_device = device if backend == "nccl" else "cpu"
    group_backend = backend
    if deterministic:
        from miles.train.deterministic import DET_BACKENDS, register_backends

        register_backends()
        group_backend = DET_BACKENDS[backend]
    if not dist.is_initialized():
        from miles import phases

        with phases.phase(phases.INIT):
            if "WORLD_SIZE" in os.environ:
                dist.init_process_group(group_backend)
            else:
                dist.init_process_group(group_backend, rank=0, world_size=1, store=dist.HashStore())
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def seed_everything(seed: int) -> None:
    """Same seed on every rank: model init and data order agree; sampling seeds are per rank."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def sampling_seed(seed: int, rollout_id: int, rank: int) -> int:
    """A distinct, reproducible stream per (run seed, rollout, rank): resume re-draws the same."""
    return (seed * 1_000_003 + rollout_id * 7_919 + rank) % (2**63 - 1)


def current_rank() -> int:
    """This process's rank: the process group's, or the launcher's before there is one."""
    if dist.is_initialized():
        return dist.get_rank()
    from miles.train.args import launched_rank

    return launched_rank()


def all_gather_objects(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float], group=None) -> list[float]:
    """Sum a list of floats over the ranks of `group` (default: all), in float64 so token counts
    stay exact; without a process group this process is the whole world."""
    if not dist.is_initialized():
        return [float(v) for v in values]
    t = torch.tensor(values, dtype=torch.float64, device=_collective_device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a finished trainer process with `code`: Python's exit work, then no C++ teardown.

    Python's exit handlers run as usual, so multiprocessing shuts down the helper processes it
    started (megatron's checkpoint writer keeps a Manager server alive; left running, it holds
    the caller's stdout/stderr pipes open and a parent reading them waits forever). C++ static
    destructors are skipped: torch's gloo process groups occasionally leave a joinable thread
    behind that aborts the process at exit (std::terminate, about one run in 16 on two CPU
    ranks), turning a finished run into a failed one. Call it only once everything the run
    writes is complete and closed.
    """
    from miles import phases

    with phases.phase(phases.TEARDOWN):
        atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
