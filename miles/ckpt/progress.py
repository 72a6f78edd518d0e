"""A progress line for long steps: bytes, tensors, rate and ETA, on stderr.

On a terminal the line is redrawn in place a few times a second; in a CI log a full line
is printed every few seconds so the log stays short. Workers call `advance` from threads.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_seconds(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    def __init__(
        self,
        label: str,
        total_bytes: int,
        total_tensors: int = 0,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float | None = None,
    ):
        self.label = label
        self.total_bytes = total_bytes
        self.total_tensors = total_tensors
        self.bytes = 0
        self.tensors = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.interval = interval if interval is not None else (0.2 if self.tty else 5.0)
        self._start = time.monotonic()
        self._last = self._start  # the first line comes after one interval, not on the first tensor
        self._lock = threading.Lock()

    def advance(self, nbytes: int = 0, tensors: int = 0) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tensors += tensors
            now = time.monotonic()
            if self.enabled and now - self._last >= self.interval:
                self._last = now
                self._draw(now, final=False)

    def line(self, now: float | None = None) -> str:
        elapsed = max((now or time.monotonic()) - self._start, 1e-9)
        rate = self.bytes / elapsed
        parts = [f"{self.label}: {human_bytes(self.bytes)}/{human_bytes(self.total_bytes)}"]
        if self.total_tensors:
            parts.append(f"{self.tensors}/{self.total_tensors} tensors")
        parts.append(f"{human_bytes(rate)}/s")
        left = self.total_bytes - self.bytes
        parts.append(
            f"ETA {human_seconds(left / rate)}" if rate > 0 and left > 0 else f"{human_seconds(elapsed)}"
        )
        return "  ".join(parts)

    def _draw(self, now: float, final: bool) -> None:
        text = self.line(now)
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            with self._lock:
                self._draw(time.monotonic(), final=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()


def say(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)
