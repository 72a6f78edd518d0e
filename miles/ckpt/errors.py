"""The exception types the checkpoint chores raise, and one-line messages for failed reads/writes."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from miles.ckpt.progress import human_bytes


class CheckpointError(Exception):
    """A checkpoint (or a step's input) breaks a rule; the message names file, tensor, rule and fix."""


class StepFailed(CheckpointError):
    """A pipeline step stopped; nothing of it was marked done and its inputs are untouched."""


_FULL = {errno.ENOSPC: "no space left", errno.EDQUOT: "disk quota exceeded", errno.EFBIG: "file too large"}
_FIXES = {
    errno.ENOSPC: "free space there (or point --model-dir/--stage-dir at a larger disk) and rerun",
    errno.EDQUOT: "free space within the quota (or use another disk) and rerun",
    errno.EFBIG: "raise the file size limit (ulimit -f) or use another file system, and rerun",
    errno.EROFS: "remount it read-write, or point --model-dir/--stage-dir at a writable disk, and rerun",
    errno.EACCES: "give this user write access (or use another directory) and rerun",
    errno.EPERM: "give this user write access (or use another directory) and rerun",
}
# A Rust std::io::Error as safetensors reports it: its Debug form "... Os { code: 28, kind:
# StorageFull, ... }" or its Display form "I/O error: No space left on device (os error 28)"
_RUST_IO = re.compile(r"Os \{ code: (\d+),|\(os error (\d+)\)")


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The OSError behind `exc`: itself, one in its cause/context chain, one a
    torch.distributed.checkpoint failure wraps (per rank), or one a Rust writer reported."""
    seen: set[int] = set()
    queue = [exc]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            queue.extend(v for v in failures.values() if isinstance(v, BaseException))
        m = _RUST_IO.search(str(e))
        if m:
            code = int(m.group(1) or m.group(2))
            return OSError(code, os.strerror(code))
        queue.extend([e.__cause__, e.__context__])
    return None


def full_disk_error(path: Path, exc: BaseException) -> OSError | None:
    """ENOSPC for a writer that failed without an errno (torch.save's zip writer reports only
    "unexpected pos") while the file system under `path` has (almost) nothing left: call it
    before the failed step's partial output is deleted."""
    if os_error_in(exc) is not None:
        return None
    try:
        if shutil.disk_usage(_existing(path)).free >= _NEARLY_FULL:
            return None
    except OSError:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


_NEARLY_FULL = 1 << 20


def _existing(path: Path) -> Path:
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def free_space(path: Path) -> str:
    """'<free> free of <size> on <mount point>' for the file system holding `path` (or its nearest ancestor)."""
    probe = _existing(path)
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    mount = probe
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return f"{human_bytes(usage.free)} free of {human_bytes(usage.total)} on {mount}"


_FREE_AT_FAILURE = "miles_free_space_at_failure"


def remember_free_space(exc: BaseException, path: Path) -> None:
    """Record on `exc` how much space the disk under `path` had when it was raised: a failed
    step deletes its partial output, after which the disk no longer looks full."""
    if not hasattr(exc, _FREE_AT_FAILURE) and os_error_in(exc) is not None:
        try:
            setattr(exc, _FREE_AT_FAILURE, free_space(path))
        except AttributeError:
            pass  # an exception type without a __dict__


def free_space_at_failure(exc: BaseException) -> str | None:
    return getattr(exc, _FREE_AT_FAILURE, None)


def describe_os_error(
    exc: OSError, writing: Path, *, reading: bool = False, note: str = "", free: str | None = None
) -> str:
    """'<what went wrong> writing <path> (<free space>); <note>; <fix>' in one line.

    `writing` is where the failing step writes (used when the error names no file); a
    file the error names outside it is reported as read, not written. `free` is the free
    space when the error happened, if known (else it is measured now).
    """
    path = Path(exc.filename2 or exc.filename or writing)
    inside = _is_under(path, writing)
    what = _FULL.get(exc.errno) or {
        errno.EROFS: "read-only file system",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
    }.get(exc.errno, exc.strerror or f"errno {exc.errno}")
    note = f"; {note}" if note else ""
    if reading or not inside:
        return f"{what} reading {path}{note}; check that it exists and is readable, then rerun"
    fix = _FIXES.get(exc.errno, "fix the cause and rerun")
    return f"{what} writing {path} ({free or free_space(path)}){note}; {fix}"


def _is_under(path: Path, target: Path) -> bool:
    """path is target, inside it, or inside a `.<target name>.*` sibling (its temp dirs)."""
    path, target = Path(os.path.abspath(path)), Path(os.path.abspath(target))
    if path == target or target in path.parents:
        return True
    for parent in (path, *path.parents):
        if parent.parent == target.parent and parent.name.startswith(f".{target.name}."):
            return True
    return False
