"""Where a CI attempt's wall time goes: named phases, recorded by every process of the attempt.

The CI runner gives each attempt a folder in `$MILES_CI_PHASE_DIR`; every process started under it
(the pytest process, the trainer's ranks, a test's workers) that imports miles (whose __init__
imports this module) appends what it spent to `<folder>/<pid>.jsonl`, one JSON line per interval:
`{"phase": "rollout", "start": <unix s>, "end": <unix s>}`. The runner merges them
(miles.ci.reports.phases). Without the variable nothing is recorded and every call costs one dict
lookup, so the markers stay in the code a user runs.

The phases, as a person reads a slow file:
  start       interpreter start-up and imports (from the process's start to its first work, and
              every outermost import after that)
  checkpoint  tiny checkpoints built or taken from the cache, conversions, prepare-ckpt steps
  init        process groups, megatron-core's parallel state, building and loading the model
  rollout     generating and scoring samples
  train       optimizer steps, the weight sync, saving
  teardown    process groups destroyed, the process winding down
Standard library only: this module is imported first, before anything it measures.
"""

from __future__ import annotations

import builtins
import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

DIR_ENV = "MILES_CI_PHASE_DIR"
START, CHECKPOINT, INIT, ROLLOUT, TRAIN, TEARDOWN = (
    "start",
    "checkpoint",
    "init",
    "rollout",
    "train",
    "teardown",
)
PHASES = (START, CHECKPOINT, INIT, ROLLOUT, TRAIN, TEARDOWN)
OPEN_END = None  # an interval that lasts until the attempt ends (the runner closes it)
MIN_IMPORT_S = 0.005  # shorter imports (a module already loaded) are not worth a line
FLUSH_EVERY = 64  # buffered lines

_lock = threading.Lock()
_buffer: list[str] = []
_state = {"folder": None, "pid": None, "import_depth": 0, "started": False}


def folder() -> str | None:
    """Where this process records, or None when no runner asked for phases."""
    return os.environ.get(DIR_ENV) or None


def record(phase: str, start: float, end: float | None) -> None:
    """One interval of `phase` (unix seconds; end None: until the attempt ends)."""
    if _state["folder"] is None and not _activate():
        return
    line = json.dumps(
        {"phase": phase, "start": round(start, 4), "end": None if end is None else round(end, 4)}
    )
    with _lock:
        _buffer.append(line)
        full = len(_buffer) >= FLUSH_EVERY
    if full or phase != START:
        flush()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Record the time spent inside the block as `name` (nothing without a runner)."""
    if folder() is None:
        yield
        return
    start = time.time()
    try:
        yield
    finally:
        record(name, start, time.time())


def process_started_at() -> float:
    """When this process began, as unix time (Linux /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        ticks = int(fields[19])  # field 22 of stat(5), counted after the command name
        since_boot = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - since_boot
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def started() -> None:
    """This process's start-up ends now: from its start to now is `start`. Only the first call of
    a process (or of a forked child, from its fork) counts: a trainer run inside a test process
    (`miles.train.main` called by a test) begins long after that process started, and the
    test's work before it is not start-up."""
    if folder() is not None and not _state["started"] and _activate():
        _state["started"] = True
        record(START, process_started_at(), time.time())


def teardown_until_the_end() -> None:
    """From now until the attempt ends is `teardown` (the pytest process, after its last test)."""
    if folder() is not None:
        record(TEARDOWN, time.time(), OPEN_END)


def flush() -> None:
    with _lock:
        lines, _buffer[:] = list(_buffer), []
    target = _state["folder"]
    if not lines or target is None:
        return
    try:  # O_APPEND: each write lands whole at the end, whoever else writes the file
        fd = os.open(
            os.path.join(target, f"{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644
        )
        try:
            os.write(fd, ("\n".join(lines) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a folder that went away costs the measurement, never the test


def _activate() -> bool:
    """Start recording in this process if a runner asked for it; True when recording."""
    target = folder()
    pid = os.getpid()
    if target is None or not os.path.isdir(target):
        return False
    if _state["pid"] != pid:  # first use, or a forked child: its own file, its own buffer
        with _lock:
            _buffer.clear()
        _state.update(folder=target, pid=pid, started=False)
    return True


def _forked() -> None:
    """A forked child (a checkpoint writer) records into a file of its own."""
    _state["import_depth"] = 0
    _activate()


_real_import = builtins.__import__


def _timed_import(name, globals=None, locals=None, fromlist=(), level=0):
    """builtins.__import__, with every outermost import that takes a while recorded as `start`."""
    if _state["import_depth"] or threading.current_thread() is not threading.main_thread():
        return _real_import(name, globals, locals, fromlist, level)
    _state["import_depth"] = 1
    begin = time.time()
    try:
        return _real_import(name, globals, locals, fromlist, level)
    finally:
        _state["import_depth"] = 0
        end = time.time()
        if end - begin >= MIN_IMPORT_S:
            record(START, begin, end)


def _install() -> None:
    """On import (miles/__init__ imports this module, so any process that uses miles): in a
    process a runner measures, its start-up so far is `start`, its imports from now on are
    timed, and what it buffered is written at exit."""
    if folder() is None or not _activate():
        return
    import atexit

    record(START, process_started_at(), time.time())  # so far; started() says where it ends
    builtins.__import__ = _timed_import
    atexit.register(flush)
    os.register_at_fork(after_in_child=_forked)


_install()
