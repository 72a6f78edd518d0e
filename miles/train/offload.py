"""--offload-train: the trainer's state off the device while the rollout engine generates.

Between training phases the parameters (the policy's and the frozen reference's), the gradients
and the optimizer state are moved off the device and brought back before the next step:

- `--offload-train-target cpu` (the default): a host copy (pinned, on a GPU); the device memory
  is released.
- `--offload-train-target disk`: written to `--offload-train-disk-dir`/rank<R>/offload/ in
  chunk files of `--offload-train-disk-chunk-mb` (each with a CRC-32, checked when it is read
  back; a damaged chunk stops the run), and deleted once read back. On the CPU this is what
  "off the device" means: the host memory the state held is released (and handed back to the
  operating system), so the process's resident memory drops while the engine generates.

What moves is each tensor's storage, whole: a backend names its tensors (`offload_tensors`), and
every view of a storage (megatron-core's parameters and gradients are views of its DDP buffers,
FSDP2's shards of their padded buffers) comes back with it. Gradients are not written anywhere:
every step starts by zeroing them, so between steps their values are dead; they are released
and come back as zeros.

`--stream-optimizer-state-to-disk` keeps the optimizer's own state (Adam's moments) on disk
*during* the step as well (megatron-core's fp32 main parameters stay resident: on the CPU they
are the model's own parameters, and its step copies them into the model after the whole
update, unlike the seed's, which streams them too): the step walks
the parameters bucket by bucket (consecutive parameters, in model order, up to the chunk size),
reads a bucket's state, runs the optimizer's own step on that bucket alone, writes the state
back and releases it (miles.train.optimizer_stream). The update is the optimizer's own code, so
it is bit-identical to keeping the state resident.

Each rank owns `<dir>/rank<R>`: it is wiped when the run starts (a killed run leaves stale files
behind, and a rerun resumes from its last checkpoint with `--load`) and removed when the run
ends. Every rank logs what it moved (`miles.train: rank R offloaded ...`).
"""

from __future__ import annotations

import atexit
import ctypes
import shutil
import time
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

MB = 1 << 20


class OffloadError(RuntimeError):
    """The trainer's offloaded state cannot be brought back; the message names the file and the fix."""


@dataclass(frozen=True)
class OffloadSettings:
    """What --offload-train and its companions ask for."""

    target: str  # cpu | disk
    disk_dir: Path | None  # the run's directory; each rank uses <disk_dir>/rank<R>
    chunk_bytes: int
    stream_optimizer: bool

    @classmethod
    def from_job(cls, job) -> OffloadSettings:
        disk = job.offload_train_disk_dir
        return cls(
            target=job.offload_train_target,
            disk_dir=Path(disk) if disk else None,
            chunk_bytes=job.offload_train_disk_chunk_mb * MB,
            stream_optimizer=job.stream_optimizer_state_to_disk,
        )


def rank_dir(settings: OffloadSettings, rank: int) -> Path:
    return settings.disk_dir / f"rank{rank}"


def arm(settings: OffloadSettings, rank: int) -> Path:
    """This rank's directory, emptied (a killed run's files go) and removed again when the process
    exits; returns it."""
    path = rank_dir(settings, rank)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    atexit.register(shutil.rmtree, path, True)
    return path


def setup(job, backend, rank: int, optimizers: Sequence = ()) -> list:
    """The offloading the job's flags ask of `backend` (a backend calls it once its model and
    optimizer exist): its `offloader` for --offload-train, and a StreamedOptimizer over each of
    `optimizers` (torch optimizers) for --stream-optimizer-state-to-disk
    (miles.train.optimizer_stream), returned."""
    settings = OffloadSettings.from_job(job)
    train = job.offload_train or job.offload
    if settings.target == "disk" or settings.stream_optimizer:
        directory = arm(settings, rank)
        print(
            f"miles.train: rank {rank}: train offload to disk armed for {directory} (emptied now, removed at exit)",
            flush=True,
        )
    streamed = []
    if settings.stream_optimizer:
        from miles.train.optimizer_stream import StreamedOptimizer

        root = rank_dir(settings, rank) / "optimizer_state"
        streamed = [
            StreamedOptimizer(opt, root / f"opt{i}", settings.chunk_bytes, rank)
            for i, opt in enumerate(optimizers)
        ]
    if train:
        state, _ = backend.offload_tensors()
        own_storage(state)
        backend.offloader = Offloader(settings, backend, rank)
    return streamed


# --- storages ---------------------------------------------------------------------------------


def storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct storages under `tensors` (a DTensor's local shard), non-empty, in first-seen order."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _memory(data: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU uint8 tensor's bytes. Not through `.numpy()`: torch
    marks a storage it has exported to numpy as never resizable again, and offloading frees
    storages by resizing them."""
    return memoryview((ctypes.c_ubyte * data.numel()).from_address(data.data_ptr())).cast("B")


def own_storage(tensors: Iterable[torch.Tensor]) -> None:
    """Give each tensor whose storage cannot be freed in place (transformers maps a checkpoint
    loaded in its own dtype from the file) a copy of its own."""
    for tensor in tensors:
        if hasattr(tensor, "to_local"):
            continue  # an FSDP2 shard: FSDP allocated its storage itself
        if not tensor.untyped_storage().resizable():
            tensor.data = tensor.data.clone()


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the operating system (glibc keeps freed blocks below its
    mmap threshold for reuse, so resident memory would not drop); nothing elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# --- where the bytes go -------------------------------------------------------------------------


class HostCopy:
    """Each storage's bytes in a host buffer (pinned when the storage is on a GPU)."""

    where = "host memory"

    def __init__(self) -> None:
        self.copies: list[torch.Tensor] = []

    def write(self, storage: torch.UntypedStorage) -> None:
        data = _bytes_of(storage)
        host = torch.empty(data.numel(), dtype=torch.uint8, pin_memory=data.is_cuda)
        host.copy_(data)
        self.copies.append(host)

    def finish(self) -> None:
        pass

    def read_all(self, held: Sequence[torch.UntypedStorage]) -> None:
        for storage, copy in zip(held, self.copies, strict=True):
            _bytes_of(storage).copy_(copy)

    def clear(self) -> None:
        self.copies.clear()


class DiskChunks:
    """Storages as one byte stream cut into chunk files of `chunk_bytes`, each with its CRC-32."""

    where = "disk"

    def __init__(self, directory: Path, chunk_bytes: int) -> None:
        self.directory = directory
        self.chunk_bytes = chunk_bytes
        self.extents: list[tuple[int, int]] = []  # (start, length) of each storage in the stream
        self.crcs: list[int] = []
        self._staging: torch.Tensor | None = None  # pinned host bytes for a GPU storage
        self._file = None
        self._written = 0

    def _chunk_path(self, index: int) -> Path:
        return self.directory / f"chunk_{index:05d}.bin"

    def write(self, storage: torch.UntypedStorage) -> None:
        if not self.extents:
            self.directory.mkdir(parents=True, exist_ok=True)
        start = self.extents[-1][0] + self.extents[-1][1] if self.extents else 0
        self.extents.append((start, storage.nbytes()))
        data = _bytes_of(storage)
        for offset in range(0, data.numel(), self.chunk_bytes):
            piece = data[offset : offset + self.chunk_bytes]
            self._append(_memory(self._host(piece)))

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, view: memoryview) -> None:
        """Bytes onto the stream, a new chunk file (and CRC) every chunk_bytes."""
        while view.nbytes:
            index, used = divmod(self._written, self.chunk_bytes)
            if used == 0:
                self.finish()
                self._file = open(self._chunk_path(index), "wb")
                self.crcs.append(0)
            n = min(view.nbytes, self.chunk_bytes - used)
            self._file.write(view[:n])
            self.crcs[index] = zlib.crc32(view[:n], self.crcs[index])
            self._written += n
            view = view[n:]

    def _host(self, piece: torch.Tensor) -> torch.Tensor:
        if not piece.is_cuda:
            return piece
        if self._staging is None or self._staging.numel() < piece.numel():
            self._staging = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        host = self._staging[: piece.numel()]
        host.copy_(piece)
        return host

    def read_all(self, held: Sequence[torch.UntypedStorage]) -> None:
        """The stream back into `held` (the storages written, in order, already resized), each chunk's
        CRC-32 checked as it is read; a short or damaged chunk is an OffloadError naming it."""
        pieces = (
            _bytes_of(storage)[offset : offset + self.chunk_bytes]
            for storage in held
            for offset in range(0, storage.nbytes(), self.chunk_bytes)
        )
        chunk, used, crc, f = 0, 0, 0, None
        try:
            for piece in pieces:
                while piece.numel():
                    if f is None:
                        f = open(self._chunk_path(chunk), "rb")
                    n = min(piece.numel(), self.chunk_bytes - used)
                    host = piece[:n] if not piece.is_cuda else self._staging_for(n)
                    view = _memory(host)
                    got = f.readinto(view)
                    if got != n:
                        raise OffloadError(
                            f"{self._chunk_path(chunk)}: {got} of {n} bytes at offset {used}: the offloaded trainer "
                            "state was truncated (the disk filled, or something else wrote there); resume from the "
                            "last checkpoint (--load)"
                        )
                    crc = zlib.crc32(view, crc)
                    if piece.is_cuda:
                        piece[:n].copy_(host)
                    piece, used = piece[n:], used + n
                    if used == self.chunk_bytes:
                        self._check(chunk, crc)
                        f.close()
                        chunk, used, crc, f = chunk + 1, 0, 0, None
            if used:
                self._check(chunk, crc)
        finally:
            if f is not None:
                f.close()

    def _check(self, chunk: int, crc: int) -> None:
        if crc != self.crcs[chunk]:
            raise OffloadError(
                f"{self._chunk_path(chunk)}: CRC-32 {crc:08x}, written as {self.crcs[chunk]:08x}: the offloaded "
                "trainer state is damaged on disk; resume from the last checkpoint (--load)"
            )

    def _staging_for(self, n: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.chunk_bytes, dtype=torch.uint8, pin_memory=True)
        return self._staging[:n]

    def clear(self) -> None:
        self.finish()
        for index in range(len(self.crcs)):
            self._chunk_path(index).unlink(missing_ok=True)
        self.extents.clear()
        self.crcs.clear()
        self._written = 0


# --- the whole state between phases ----------------------------------------------------------


class Offloader:
    """Moves a backend's state off the device (`away`) and back (`back`), logging one line per rank.

    The backend's `offload_tensors()` names (state, scratch): state is written out and comes back
    bit for bit; scratch (gradient buffers, whose values every step overwrites) is released and
    comes back as zeros."""

    def __init__(self, settings: OffloadSettings, backend, rank: int) -> None:
        self.settings, self.backend, self.rank = settings, backend, rank
        self.directory = None
        if settings.target == "disk":
            self.directory = rank_dir(settings, rank) / "offload"
            self.sink: HostCopy | DiskChunks = DiskChunks(self.directory, settings.chunk_bytes)
        else:
            self.sink = HostCopy()
        self.held: list[tuple[torch.UntypedStorage, int]] = []
        self.scratch: list[tuple[torch.UntypedStorage, int]] = []

    def away(self) -> None:
        """The state off the device: each storage written out, then every storage released."""
        if self.held or self.scratch:
            return
        started = time.perf_counter()
        state, scratch = self.backend.offload_tensors()
        held = storages(state)
        for storage in held:
            self.sink.write(storage)
        self.sink.finish()
        scratch_storages = [s for s in storages(scratch) if s.data_ptr() not in {h.data_ptr() for h in held}]
        self.held = [(s, s.nbytes()) for s in held]
        self.scratch = [(s, s.nbytes()) for s in scratch_storages]
        for storage, _ in (*self.held, *self.scratch):
            storage.resize_(0)
        device = (held or scratch_storages or [None])[0]
        if device is not None and device.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            return_freed_memory()
        where = "host memory" if self.directory is None else f"disk {self.directory}"
        chunks = f" in {len(self.sink.crcs)} chunk file(s)" if isinstance(self.sink, DiskChunks) else ""
        moved = sum(size for _, size in self.held) / MB
        freed = sum(size for _, size in self.scratch) / MB
        print(
            f"miles.train: rank {self.rank} offloaded the trainer state to {where}: {len(self.held)} storages, "
            f"{moved:.1f} MiB{chunks}, {freed:.1f} MiB of gradients released, "
            f"in {time.perf_counter() - started:.2f}s",
            flush=True,
        )

    def back(self) -> None:
        """The state on the device again, bit for bit (a disk copy's CRCs checked as it is read), the
        gradients zeros; the disk copy deleted."""
        if not (self.held or self.scratch):
            return
        for storage, size in self.held:
            storage.resize_(size)
        self.sink.read_all([storage for storage, _ in self.held])
        self.sink.clear()
        for storage, size in self.scratch:
            storage.resize_(size)
            _bytes_of(storage).zero_()
        self.held, self.scratch = [], []
