"""Sample every GPU of this machine and hand the samples, in batches, to a callback.

    sampler = GpuSampler(on_batch=store.append)
    if not sampler.available:
        print(sampler.unavailable_reason)   # "NVML: NVML Shared Library Not Found; AMD SMI: ..."
    sampler.start()   # a daemon thread: every `interval` s one sample per device,
    ...               # every `flush_every` s one TelemetryBatch to on_batch
    sampler.stop()    # the last partial batch is delivered before this returns

NVML is tried first, then AMD SMI: on an NVIDIA machine the first opens, on a ROCm machine
libnvidia-ml is absent and the second does. Devices are numbered in the library's order (the
physical order, whatever CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES say). A device whose
read fails is skipped for that tick and named once in the log; the others keep reporting.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from miles.telemetry.backends import AmdSmi, Backend, Nvml

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    """One reading of one device: utilisation 0-100 %, memory used in MiB, power in W."""

    ts: float
    node: str
    gpu: int
    util_percent: int
    mem_mib: int
    power_w: float


@dataclass(frozen=True)
class GpuProcess:
    """One process holding memory on one device."""

    ts: float
    node: str
    gpu: int
    pid: int
    name: str
    mem_mib: int


@dataclass(frozen=True)
class TelemetryBatch:
    """What the callback receives: the samples and process rows gathered since the last flush."""

    node: str
    samples: tuple[GpuSample, ...]
    processes: tuple[GpuProcess, ...] = ()


@dataclass
class _Buffer:
    samples: list[GpuSample] = field(default_factory=list)
    processes: list[GpuProcess] = field(default_factory=list)


def default_backends() -> tuple[Backend, ...]:
    return (Nvml(), AmdSmi())


class GpuSampler:
    """Samples the devices the first backend that opens can see.

    `available` is False, with `unavailable_reason` saying why in one line (each backend's
    failure), when none opens; the sampler is then inert: sampling returns 0 and `start()`
    returns False.
    """

    def __init__(
        self,
        on_batch: Callable[[TelemetryBatch], None],
        *,
        node: str | None = None,
        interval: float = 1.0,
        flush_every: float = 5.0,
        process_every: float = 5.0,
        backends: Sequence[Backend] | None = None,
    ):
        for name, value in (
            ("interval", interval),
            ("flush_every", flush_every),
            ("process_every", process_every),
        ):
            if not value > 0:
                raise ValueError(f"GpuSampler {name}={value!r}: must be a positive number of seconds")
        self.on_batch = on_batch
        self.node = node or socket.gethostname()
        self.interval = interval
        self.flush_every = flush_every
        self.process_every = process_every
        self.backend: Backend | None = None
        self.unavailable_reason = ""
        self._handles: list[Any] = []
        self._buffer = _Buffer()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned: set[tuple[str, int]] = set()
        self._open(default_backends() if backends is None else backends)

    @property
    def available(self) -> bool:
        return self.backend is not None

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def _open(self, backends: Sequence[Backend]) -> None:
        failures = []
        for backend in backends:
            try:
                self._handles = backend.open()
            except Exception as error:  # each library fails its own way; all mean "not here"
                failures.append(f"{backend.name}: {_one_line(error)}")
                continue
            self.backend = backend
            return
        self.unavailable_reason = "; ".join(failures) or "no GPU telemetry backend was given"
        logger.info("GPU telemetry unavailable on %s (%s)", self.node, self.unavailable_reason)

    def gpu_uuids(self) -> list[str]:
        """Each device's UUID, in device order (empty when unavailable)."""
        return [self.backend.uuid(handle) for handle in self._handles] if self.backend else []

    def sample_once(self, ts: float) -> int:
        """Read every device once into the buffer; the number of devices read."""
        read = 0
        for gpu, handle in enumerate(self._handles):
            try:
                reading = self.backend.read_device(handle)
            except Exception as error:
                self._warn_once("read", gpu, error)
                continue
            sample = GpuSample(ts, self.node, gpu, reading.util_percent, reading.mem_mib, reading.power_w)
            with self._lock:
                self._buffer.samples.append(sample)
            read += 1
        return read

    def sample_processes_once(self, ts: float) -> int:
        """List the processes holding memory on every device into the buffer; the row count."""
        rows = []
        for gpu, handle in enumerate(self._handles):
            try:
                readings = self.backend.read_processes(handle)
            except Exception as error:
                self._warn_once("process listing", gpu, error)
                continue
            rows += [GpuProcess(ts, self.node, gpu, r.pid, r.name, r.mem_mib) for r in readings]
        with self._lock:
            self._buffer.processes += rows
        return len(rows)

    def flush(self) -> TelemetryBatch | None:
        """Hand what was gathered since the last flush to `on_batch` (nothing when empty)."""
        with self._lock:
            taken, self._buffer = self._buffer, _Buffer()
        if not (taken.samples or taken.processes):
            return None
        batch = TelemetryBatch(self.node, tuple(taken.samples), tuple(taken.processes))
        self.on_batch(batch)
        return batch

    def start(self) -> bool:
        """Sample on a daemon thread; False (and nothing started) when unavailable."""
        if not self.available:
            return False
        if self._thread is not None:
            raise RuntimeError("GpuSampler.start(): already started; stop() it first")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="miles-gpu-sampler", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the thread, deliver the last batch and release the library."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()
        if self.backend is not None:
            self.backend.close()
            self.backend, self._handles = None, []
            self.unavailable_reason = "stopped"

    def _run(self) -> None:
        next_flush = time.monotonic() + self.flush_every
        next_processes = time.monotonic()
        while not self._stop.is_set():
            self.sample_once(time.time())
            if time.monotonic() >= next_processes:
                self.sample_processes_once(time.time())
                next_processes = time.monotonic() + self.process_every
            if time.monotonic() >= next_flush:
                self.flush()
                next_flush = time.monotonic() + self.flush_every
            self._stop.wait(self.interval)

    def _warn_once(self, what: str, gpu: int, error: Exception) -> None:
        if (what, gpu) not in self._warned:
            self._warned.add((what, gpu))
            logger.warning(
                "%s %s failed for gpu %d on %s: %s", self.backend.name, what, gpu, self.node, error
            )


def _one_line(error: Exception) -> str:
    text = " ".join(str(error).split())
    return text or type(error).__name__
