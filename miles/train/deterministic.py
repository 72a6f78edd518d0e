"""Deterministic runs: the same seed and layout give bit-identical losses on every rerun.

`--deterministic-mode` asks torch for deterministic kernels (`torch.use_deterministic_algorithms`,
cuDNN without autotuning, cuBLAS with a fixed workspace), as Megatron-LM's flag of that name does
in the seed framework (radixark/miles 31f1ca961, miles/backends/megatron_utils/initialize.py).
Sampling is already a function of (--rollout-seed, rollout, rank) and the data order of
(--seed, rollout), in both engines (SGLang: with --sglang-enable-deterministic-inference).

`--debug-deterministic-collective` runs the training world on a process group whose SUM and AVG
reductions do not depend on the communication library's reduction order (NCCL picks rings or
trees by topology and message size): all-reduce and reduce-scatter become an all-gather (data
movement only) and a fixed local fold, a pairwise tree when the group's size is a power of two
and an ascending fold over the ranks otherwise, so reduce-scatter's shard is bitwise the slice of
all-reduce's result, whatever the layout of the buffers. Every other collective goes to the
inner group unchanged. The seed framework's `det_nccl` backend
(miles/utils/test_utils/det_process_group.py) is the same construction; here it wraps gloo on the
CPU (`det_gloo`) and NCCL/RCCL on GPUs (`det_nccl`). It is slow (world_size x the traffic): a
debugging and testing tool.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import AllgatherOptions, AllToAllOptions, BarrierOptions

DET_BACKENDS = {"gloo": "det_gloo", "nccl": "det_nccl"}
# A gather buffer larger than this is split into chunks: each output element is still folded
# over the same operands in the same order, so chunking changes no bit.
GATHER_CAP_BYTES = 1 << 28
CUBLAS_WORKSPACE = ":4096:8"  # what cuBLAS needs for reproducible results (CUDA's docs)


def enable_deterministic_algorithms() -> None:
    """Deterministic kernels for the rest of the process (an op that has none raises)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


# --- the fold -------------------------------------------------------------------------------


def fold(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of `parts` in a fixed order: ((p0+p1)+(p2+p3))+... for a power-of-two count, else
    ((p0+p1)+p2)+... ."""
    parts = list(parts)
    if len(parts) & (len(parts) - 1) == 0:
        while len(parts) > 1:
            parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
        return parts[0]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _is_sum(op) -> bool:
    return op == dist.ReduceOp.SUM


def _is_avg(op) -> bool:
    return op == dist.ReduceOp.AVG


def _op_of(opts) -> object:
    """The ReduceOp of an options object (or a bare ReduceOp). Compared with ==: an options
    object's op equals ReduceOp.SUM but is not `in` a tuple holding it."""
    return getattr(opts, "reduceOp", opts)


def _gathered_fold(flat: torch.Tensor, inner: ProcessGroup, world: int, op) -> torch.Tensor:
    """Every rank's `flat`, gathered in chunks and folded; divided by the world for AVG."""
    out = torch.empty_like(flat)
    step = max(1, GATHER_CAP_BYTES // max(1, world * flat.element_size()))
    for start in range(0, flat.numel(), step):
        chunk = flat[start : start + step].contiguous()
        gathered = torch.empty((world, chunk.numel()), dtype=chunk.dtype, device=chunk.device)
        inner._allgather_base(gathered.view(-1), chunk, AllgatherOptions()).wait()
        out[start : start + chunk.numel()] = fold(list(gathered))
    if _is_avg(op):
        out = out / world if out.is_floating_point() else out // world
    return out


def det_all_reduce(tensor: torch.Tensor, inner: ProcessGroup, op=dist.ReduceOp.SUM) -> None:
    """`tensor` (any layout) replaced, in place, by the fixed-order fold over the group."""
    result = _gathered_fold(tensor.detach().reshape(-1).clone(), inner, inner.size(), op)
    tensor.copy_(result.view(tensor.shape))


def det_reduce_scatter(output: torch.Tensor, input: torch.Tensor, inner: ProcessGroup, op) -> None:
    """This rank's equal shard of the fixed-order fold of every rank's `input`."""
    world, rank = inner.size(), inner.rank()
    if input.numel() != output.numel() * world:
        raise ValueError(
            f"reduce_scatter: input of {input.numel()} elements is not {world} shards of {output.numel()}"
        )
    result = _gathered_fold(input.detach().reshape(-1).contiguous(), inner, world, op)
    output.copy_(result[rank * output.numel() : (rank + 1) * output.numel()].view(output.shape))


# --- the process group ----------------------------------------------------------------------


class _Done(dist.Work):
    """The Work of a collective that finished before its call returned."""

    def __init__(self, result: Sequence[torch.Tensor] = ()):
        super().__init__()
        self._future = torch.futures.Future()
        self._future.set_result(list(result))

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class DetProcessGroup(ProcessGroup):
    """A process group whose SUM/AVG all-reduce and reduce-scatter are fixed-order folds over an
    inner group (gloo or NCCL); every other collective is the inner group's."""

    def __init__(self, inner, device: str):
        super().__init__(inner.rank(), inner.size())
        self._inner = inner
        # What device and backend lookups read (object collectives pick their tensors' device by
        # it); the collectives themselves still come to the methods below.
        self._set_default_backend(ProcessGroup.BackendType.CUSTOM)
        self._register_backend(torch.device(device), ProcessGroup.BackendType.CUSTOM, inner)

    # reductions: folded (the names are torch 2.13's ProcessGroup methods, which
    # torch.distributed's functions and its coalescing manager call)
    def allreduce(self, tensors, opts=None):
        op = _op_of(opts) if opts is not None else dist.ReduceOp.SUM
        if not (_is_sum(op) or _is_avg(op)):
            return self._inner.allreduce(tensors, opts)
        for tensor in tensors:
            det_all_reduce(tensor, self._inner, op)
        return _Done(tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts):
        op = _op_of(opts)
        if not (_is_sum(op) or _is_avg(op)):
            return self._inner.reduce(tensors, opts)
        for tensor in tensors:  # every rank folds; only the destination needs the result
            det_all_reduce(tensor, self._inner, op)
        return _Done(tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op_of(opts) if opts is not None else dist.ReduceOp.SUM
        if not (_is_sum(op) or _is_avg(op)):
            return self._inner._reduce_scatter_base(output, input, opts)
        det_reduce_scatter(output, input, self._inner, op)
        return _Done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self.reduce_scatter_single(output, input, opts)
        return _Done(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = _op_of(opts) if opts is not None else dist.ReduceOp.SUM
        if not (_is_sum(op) or _is_avg(op)):
            return self._inner.reduce_scatter(outputs, inputs, opts)
        rank = self._inner.rank()
        for output, slots in zip(outputs, inputs, strict=True):
            # slot j may have its own size; every rank folds every slot, rank j keeps slot j
            for j, slot in enumerate(slots):
                folded = _gathered_fold(slot.detach().reshape(-1).contiguous(), self._inner, self.size(), op)
                if j == rank:
                    output.copy_(folded.view(output.shape))
        return _Done(outputs)

    # data movement: the inner group's
    def allgather(self, outputs, inputs, opts=None):
        return self._inner.allgather(outputs, inputs, opts or AllgatherOptions())

    def all_gather_single(self, output, input, opts=None):
        return self._inner._allgather_base(output, input, opts or AllgatherOptions())

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        for output, input in zip(outputs, inputs, strict=True):
            self._inner._allgather_base(output, input, opts or AllgatherOptions()).wait()
        return _Done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, outputs, inputs, opts=None):
        return self._inner.allgather_coalesced(outputs, inputs, opts or AllgatherOptions())

    def broadcast(self, tensors, opts):
        return self._inner.broadcast(tensors, opts)

    def barrier(self, opts=None):
        return self._inner.barrier(opts or BarrierOptions())

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self._inner.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts or AllToAllOptions()
        )

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None):
        return self._inner.alltoall(outputs, inputs, opts or AllToAllOptions())

    def gather(self, outputs, inputs, opts):
        return self._inner.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        return self._inner.scatter(outputs, inputs, opts)

    def send(self, tensors, dst, tag):
        return self._inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        return self._inner.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        return self._inner.recv_anysource(tensors, tag)

    def _start_coalescing(self, device) -> None:
        """Each collective inside a coalescing block runs as it is called (they are synchronous)."""

    def _end_coalescing(self, device):
        return _Done()


def _creator(inner_backend: str):
    def create(opts, backend_options) -> DetProcessGroup:
        if inner_backend == "gloo":
            inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
            return DetProcessGroup(inner, "cpu")
        nccl_options = dist.ProcessGroupNCCL.Options()
        inner = dist.ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, nccl_options)
        return DetProcessGroup(inner, "cuda")

    return create


def register_backends() -> None:
    """Make `det_gloo` (CPU) and `det_nccl` (GPU) torch.distributed backends; idempotent."""
    for inner, name in DET_BACKENDS.items():
        if name.upper() in dist.Backend._plugins:
            continue
        devices = ["cpu"] if inner == "gloo" else ["cuda"]
        dist.Backend.register_backend(name, _creator(inner), extended_api=True, devices=devices)
