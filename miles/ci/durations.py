"""How long each test file took, per backend and suite: the input of `calibrate`.

Stored as JSON in `.miles/durations.json` under the project root, or at
`$MILES_DURATIONS_PATH`. The two public functions are the contract; the store behind them
may change (the metric-gates history store will hold these rows) without their callers
noticing. Writers take an exclusive lock and replace the file atomically, so two runners
finishing at once lose nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from miles.ci.record import FAILED, PASSED, TIMEOUT, Attempt

PATH_ENV = "MILES_DURATIONS_PATH"
DEFAULT_PATH = Path(".miles") / "durations.json"
KEEP_PER_KEY = 50  # newest rows kept per (backend, suite, file)
SCHEMA = 1


def durations_path(root: Path | str = ".") -> Path:
    env = os.environ.get(PATH_ENV)
    return Path(env) if env else Path(root) / DEFAULT_PATH


def _ran_to_an_end(a: Attempt) -> bool:
    """Only attempts whose elapsed time says something about the test: it ran and ended by
    itself (passed or failed) or hit its timeout. Cancelled, never-started and missing-file
    attempts are left out."""
    if a.status == TIMEOUT:
        return True
    return a.status in (PASSED, FAILED) and (a.exit_code is not None or a.signal is not None)


def record_durations(attempts: Iterable[Attempt], path: Path | str | None = None) -> int:
    """Append the elapsed time of every attempt that ran; returns how many rows were added."""
    rows = [
        {
            "file": a.file,
            "backend": a.backend,
            "suite": a.suite,
            "elapsed": round(a.elapsed, 3),
            "passed": a.status == PASSED,
            "commit": a.commit,
            "at": round(a.started_at, 3),
        }
        for a in attempts
        if _ran_to_an_end(a)
    ]
    if not rows:
        return 0
    target = Path(path) if path is not None else durations_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        data = _read(target)
        data["rows"].extend(rows)
        data["rows"] = _trim(data["rows"])
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, target)
    return len(rows)


def load_durations(
    backend: str, suite: str | None = None, path: Path | str | None = None
) -> dict[str, list[tuple[float, bool]]]:
    """file -> [(elapsed seconds, passed)], oldest first, for one backend (and suite)."""
    target = Path(path) if path is not None else durations_path()
    out: dict[str, list[tuple[float, bool]]] = {}
    for row in _read(target)["rows"]:
        if row["backend"] == backend and (suite is None or row["suite"] == suite):
            out.setdefault(row["file"], []).append((float(row["elapsed"]), bool(row["passed"])))
    return out


def _read(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {"schema": SCHEMA, "rows": []}
    try:
        data = json.loads(text)
        rows = data["rows"]
        if not isinstance(rows, list):
            raise TypeError("rows is not a list")
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path}: the durations store is unreadable ({exc}); move it aside and rerun to start afresh"
        ) from None
    return data


def _trim(rows: list[dict]) -> list[dict]:
    kept: dict[tuple, list[dict]] = {}
    for row in rows:
        kept.setdefault((row["backend"], row["suite"], row["file"]), []).append(row)
    return [r for group in kept.values() for r in group[-KEEP_PER_KEY:]]


@contextmanager
def _locked(path: Path):
    lock = path.with_name(f".{path.name}.lock")
    with open(lock, "a") as fh:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - start > 60:
                    raise TimeoutError(f"{lock}: another runner has held the lock for a minute") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
