"""--stream-optimizer-state-to-disk: an optimizer whose state stays on disk, also during its step.

The step walks the parameters bucket by bucket (consecutive parameters in model order, so
roughly layer by layer, whose Adam moments fit one chunk of --offload-train-disk-chunk-mb),
reading a bucket's state, running the optimizer's own step on that bucket alone and writing
the state back (chunk files with CRC-32s, miles.train.offload.DiskChunks). The setup is
miles.train.offload.setup.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from miles.train.offload import MB, DiskChunks, return_freed_memory, storages


class StreamedOptimizer:
    """An optimizer whose state lives on disk, bucket by bucket, also during its step.

    `optimizer` is a torch optimizer (torch's AdamW, or the inner optimizer of megatron-core's
    distributed optimizer); its `step` is replaced by one that, for each bucket of parameters,
    brings that bucket's state back, runs the optimizer's own step over those parameters alone
    (the param groups narrowed to them, every hyperparameter as it is), writes the state back
    and releases it. Per-parameter state is elementwise, so each parameter is updated exactly as
    in one step over all of them. `resident()` brings everything back for a checkpoint."""

    def __init__(self, optimizer, directory: Path, chunk_bytes: int, rank: int) -> None:
        self.optimizer, self.directory, self.rank = optimizer, directory, rank
        self.chunk_bytes = chunk_bytes
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.buckets = _buckets(params, chunk_bytes)
        self.files = [
            DiskChunks(directory / f"bucket_{i:05d}", chunk_bytes) for i in range(len(self.buckets))
        ]
        self.saved: list[list[tuple[torch.UntypedStorage, int]]] = [[] for _ in self.buckets]
        self._step = optimizer.step
        optimizer.step = self.step
        self.steps = 0
        self._holding = False  # inside resident(): the state stays in memory

    def _state(self, bucket: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for p in bucket:
            out += [
                v for v in self.optimizer.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.dim()
            ]
        return out

    def _bring(self, i: int) -> int:
        moved = 0
        if self.saved[i]:
            for storage, size in self.saved[i]:
                storage.resize_(size)
                moved += size
            self.files[i].read_all([storage for storage, _ in self.saved[i]])
            self.files[i].clear()
            self.saved[i] = []
        return moved

    def _release(self, i: int) -> int:
        held = storages(self._state(self.buckets[i]))
        for storage in held:
            self.files[i].write(storage)
        self.files[i].finish()
        self.saved[i] = [(s, s.nbytes()) for s in held]
        for storage in held:
            storage.resize_(0)
        return sum(size for _, size in self.saved[i])

    def step(self, closure=None):
        if self._holding:
            # a step inside resident(): torch.distributed.checkpoint's get_state_dict runs one (at
            # lr 0) to create a fresh optimizer's state, which must stay for the load to fill it
            return self._step(closure)
        started = time.perf_counter()
        read = written = 0
        groups = [group["params"] for group in self.optimizer.param_groups]
        loss = None
        try:
            for i, bucket in enumerate(self.buckets):
                read += self._bring(i)
                members = {id(p) for p in bucket}
                for group, params in zip(self.optimizer.param_groups, groups, strict=True):
                    group["params"] = [p for p in params if id(p) in members]
                loss = self._step(closure)
                for group, params in zip(self.optimizer.param_groups, groups, strict=True):
                    group["params"] = params
                written += self._release(i)
        finally:
            for group, params in zip(self.optimizer.param_groups, groups, strict=True):
                group["params"] = params
        return_freed_memory()
        self.steps += 1
        print(
            f"miles.train: rank {self.rank} streamed the optimizer state through disk: {len(self.buckets)} buckets, "
            f"read {read / MB:.1f} MiB, wrote {written / MB:.1f} MiB in {time.perf_counter() - started:.2f}s",
            flush=True,
        )
        return loss

    def resident(self):
        """A context in which every bucket's state is in memory (a checkpoint save or load), written
        back and released after it."""

        @contextlib.contextmanager
        def held():
            for i in range(len(self.buckets)):
                self._bring(i)
            self._holding = True
            try:
                yield
            finally:
                self._holding = False
                for i in range(len(self.buckets)):
                    self._release(i)
                return_freed_memory()

        return held()


def _buckets(params: Sequence[torch.Tensor], chunk_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive parameters (model order, so roughly layer by layer) whose Adam moments fit one
    chunk; a larger parameter is a bucket of its own."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        state_bytes = 2 * local.numel() * 4
        if not out or size + state_bytes > chunk_bytes:
            out.append([])
            size = 0
        out[-1].append(p)
        size += state_bytes
    return out
