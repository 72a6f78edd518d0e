"""Step outputs that are either finished or absent: temp siblings, renames, manifests, locks.

Every step writes into `.<name>.partial-<pid>` beside its output, writes the manifest
`.miles-ckpt.json` last, then renames the directory into place. So a directory under its
final name with a manifest is finished, and anything else is not: a killed run leaves a
`.partial-*` sibling that the next run (holding the plan's lock) deletes. The manifest
records the step, a fingerprint of its inputs, its parameters and every output file's
size and sha256; a rerun whose fingerprint and parameters match skips the step.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from miles.ckpt.digests import DigestCache
from miles.ckpt.errors import CheckpointError, remember_free_space
from miles.ckpt.shards import sha256_file
from miles.files import FileRefused, check_relative, read_regular, refuse_overlap, replace_file

MANIFEST_NAME = ".miles-ckpt.json"
TINY_STEP = "tiny"  # the step that builds a tiny random checkpoint (miles.ckpt.tiny)
# The steps whose output is a model's Hugging Face folder (a rerun may make it another way).
HF_STEPS = ("fetch", "trim", TINY_STEP)
MANIFEST_FORMAT = 1
SMALL_FILE_BYTES = 1 << 20  # inputs up to this size are fingerprinted by content
MAX_MANIFEST_BYTES = 256 << 20  # a few hundred bytes per file it lists


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: str
    inputs: str  # fingerprint of what the step read
    params: Mapping[str, Any] = field(default_factory=dict)
    files: Mapping[str, FileRecord] = field(default_factory=dict)  # relative path -> record

    def to_json(self) -> str:
        files = {k: {"size": v.size, "sha256": v.sha256} for k, v in sorted(self.files.items())}
        body = {"format": MANIFEST_FORMAT, "step": self.step, "inputs": self.inputs, "params": self.params}
        return json.dumps({**body, "files": files}, indent=1, sort_keys=True) + "\n"

    @property
    def digest(self) -> str:
        """sha256 of the manifest as written: what the digest cache remembers a folder by."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"manifest format {data.get('format')!r}")
        files = {k: FileRecord(int(v["size"]), str(v["sha256"])) for k, v in data["files"].items()}
        for rel in files:  # a manifest names files of its own folder, nothing outside it
            check_relative(rel, what="manifest entry")
        return cls(str(data["step"]), str(data["inputs"]), dict(data["params"]), files)


def read_manifest(directory: Path) -> Manifest | None:
    """The directory's manifest, or None when it has none (or one this version cannot read)."""
    try:
        return load_manifest(directory)
    except CheckpointError:
        return None


def load_manifest(directory: Path) -> Manifest | None:
    """The directory's manifest; None when it has none; a CheckpointError naming the file when
    one is there but cannot be read (truncated, not JSON, not a manifest, not a regular file)."""
    path = Path(directory) / MANIFEST_NAME
    if not os.path.lexists(path):
        return None
    try:
        raw = read_regular(path, MAX_MANIFEST_BYTES, what="manifest")
        return Manifest.from_json(raw.decode())
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None
    except OSError as exc:
        raise CheckpointError(f"manifest {path} cannot be read ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        reason = "nested too deeply" if isinstance(exc, RecursionError) else f"{type(exc).__name__}: {exc}"
        raise CheckpointError(
            f"manifest {path} is damaged ({reason[:200]}): truncated or edited, it is no manifest miles wrote"
        ) from None


def remember_written(directory: Path) -> None:
    """Tell the digest cache that `directory` was just written with its manifest, so that losing
    the manifest later is noticed (miles.ckpt.verify.manifest_problems)."""
    manifest = read_manifest(directory)
    if manifest is not None:
        cache = DigestCache(directory)
        cache.remember_manifest(manifest.digest)
        cache.save()


def is_complete(directory: Path, manifest: Manifest) -> bool:
    """Every file the manifest lists is there with its recorded size (cheap; no rehash)."""
    for rel, record in manifest.files.items():
        try:
            if (Path(directory) / rel).stat().st_size != record.size:
                return False
        except OSError:
            return False
    return True


def finished(directory: Path, step: str, inputs: str, params: Mapping[str, Any]) -> bool:
    m = read_manifest(directory)
    return (
        m is not None
        and (m.step, m.inputs, m.params) == (step, inputs, json_safe(params))
        and is_complete(directory, m)
    )


def json_safe(params: Mapping[str, Any]) -> dict[str, Any]:
    """Parameters as they read back from JSON (tuples become lists), so comparisons are exact."""
    return json.loads(json.dumps(dict(params), sort_keys=True))


def fingerprint(directory: Path) -> str:
    """A digest of a directory's content, cheap enough to compute on every run.

    A directory with a complete manifest is identified by the manifest (which holds every
    file's sha256). Anything else (a Hugging Face snapshot, a local copy) is identified by
    its file list with sizes, the content of small files and safetensors headers, and the
    modification time of large files.
    """
    directory = Path(directory)
    m = read_manifest(directory)
    if m is not None and is_complete(directory, m):
        return "manifest:" + hashlib.sha256(m.to_json().encode()).hexdigest()
    h = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        rel = path.relative_to(directory).as_posix()
        if rel.startswith(".") or "/." in rel:
            continue  # hidden bookkeeping (.cache/ of huggingface_hub, editor files)
        st = path.stat()
        h.update(f"{rel}\0{st.st_size}\0".encode())
        if st.st_size <= SMALL_FILE_BYTES:
            h.update(path.read_bytes())
        else:
            h.update(f"{st.st_mtime_ns}\0".encode())
            if path.suffix == ".safetensors":
                with open(path, "rb") as f:
                    n = int.from_bytes(f.read(8), "little")
                    h.update(f.read(min(n, SMALL_FILE_BYTES * 100)))
    return "content:" + h.hexdigest()


def write_manifest(
    directory: Path, step: str, inputs: str, params: Mapping[str, Any], files=None
) -> Manifest:
    """Record the step's outputs (hashing every file not already given) and write the manifest last."""
    directory = Path(directory)
    records = dict(files or {})
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME):
        rel = path.relative_to(directory).as_posix()
        if rel not in records:
            records[rel] = FileRecord(path.stat().st_size, sha256_file(path))
    manifest = Manifest(step, inputs, json_safe(params), records)
    replace_file(directory / MANIFEST_NAME, manifest.to_json().encode(), fsync=True)
    return manifest


def partial_path(final: Path) -> Path:
    return final.parent / f".{final.name}.partial-{os.getpid()}"


def clean_stale(final: Path, keep: Path | None = None) -> None:
    """Delete what killed runs left beside `final` (call only while holding the plan's lock)."""
    final = Path(final)
    if not final.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(final.name)}\.(partial|stale)-\d+")
    for sibling in final.parent.glob(f".{final.name}.*"):
        if sibling != keep and pattern.fullmatch(sibling.name) and sibling.is_dir():
            shutil.rmtree(sibling, ignore_errors=True)


@contextmanager
def atomic_dir(final: Path, *, reads: Iterable[Path | str], replaces: Iterable[str]) -> Iterator[Path]:
    """Yield an empty temp sibling; on success rename it over `final`, on any failure delete it.

    reads: the step's inputs; `final` must not be, lie inside or contain one of them.
    replaces: the steps whose finished output `final` may already hold; any other step's
        output, or a folder without a manifest, is refused before anything is written.
    The caller writes the manifest inside the temp dir as its last act. An old `final` is
    moved aside first and deleted after the rename, so no moment shows a mixed directory.
    """
    final = Path(final)
    replaceable = tuple(replaces)
    try:
        refuse_overlap(final, reads)
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None
    _check_replaceable(final, replaceable)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException as exc:
        remember_free_space(exc, tmp)  # before the partial output goes and the disk looks roomy again
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _check_replaceable(final, replaceable)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        stale = final.parent / f".{final.name}.stale-{os.getpid()}"
        final.rename(stale)
        tmp.rename(final)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)
    remember_written(final)


def _check_replaceable(final: Path, replaces: tuple[str, ...]) -> None:
    """A CheckpointError when `final` exists and is not a finished output of one of `replaces`."""
    if not (final.exists() or final.is_symlink()):
        return
    held = read_manifest(final)
    if held is None:
        raise CheckpointError(
            f"{final} exists and was not written by miles (no {MANIFEST_NAME}); "
            "move it away, or make it the plan's source"
        )
    if held.step not in replaces:
        raise CheckpointError(
            f"{final} holds the finished output of another step ({held.step!r}), which this step "
            f"({' or '.join(repr(s) for s in replaces)}) does not replace; choose another output folder"
        )


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def plan_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for one plan; a second run waits, then finds the work done.

    flock is released by the kernel when the holder dies, even by SIGKILL. A lock file that
    exists but cannot be opened for writing (read-only mount, another user's dir) is locked
    through a read-only descriptor; one that cannot be created raises the OSError.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        f = open(path, "a")
    except OSError:
        if not path.is_file():
            raise
        f = open(path)  # a model dir this user cannot write: flock works on a read-only descriptor
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another run holding {path}", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
