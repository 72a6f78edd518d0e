"""Is a prepared directory still what its manifest recorded? Checked before it is used again.

prepare-ckpt records each output file's size and sha256 in the directory's manifest
(miles.ckpt.manifest). `file_problems(directory, manifest)` checks every listed file: there,
of the recorded size, with the recorded sha256. A rerun of prepare-ckpt redoes a step whose
output fails (pipeline.py), and the trainer refuses a --hf-checkpoint or --ref-load that fails
(miles.train.inputs), each naming the file.

Hashing is the cost (sha256 reads every byte; benchmarks/bench_ckpt_verify.py measures it). A
file is hashed in full on first use and its digest kept in a cache keyed by the file's identity:
device, inode, size, and modification and change times in nanoseconds. Writing into a file
changes both times, and the change time cannot be set back by the user, so a file overwritten in
place (same size or not) is hashed again; an unchanged one costs a stat. What the cache cannot
see is a file whose bytes change without a write through the file system (bit rot on the disk):
that is checked only on first use. The cache lives in `$MILES_CACHE_DIR/digests/` (default
`~/.cache/miles`), one JSON file per directory; a cache that cannot be read or written means
hashing in full, never an error. Files are hashed on up to four threads at once (hashlib
releases the GIL while it hashes a large buffer).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles.ckpt.manifest import FileRecord, Manifest
from miles.ckpt.shards import sha256_file
from miles.files import replace_file

CACHE_ENV = "MILES_CACHE_DIR"
HASH_THREADS = 4
_CACHE_FORMAT = 1


def cache_dir() -> Path:
    """Where digests are cached: $MILES_CACHE_DIR, else $XDG_CACHE_HOME/miles, else ~/.cache/miles."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "miles"


def identity(st: os.stat_result) -> list[int]:
    """What must be unchanged for a cached digest to stand for a file's bytes."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


class DigestCache:
    """sha256 digests of one directory's files, reused while a file's identity is unchanged."""

    def __init__(self, directory: Path, root: Path | None = None):
        key = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:32]
        self.path = (root or cache_dir()) / "digests" / f"{key}.json"
        self.entries: dict[str, dict] = {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") == _CACHE_FORMAT and isinstance(data.get("files"), dict):
                self.entries = data["files"]
        except (OSError, ValueError, AttributeError):
            pass
        self.changed = False

    def lookup(self, rel: str, st: os.stat_result) -> str | None:
        entry = self.entries.get(rel)
        if isinstance(entry, dict) and entry.get("id") == identity(st):
            digest = entry.get("sha256")
            return digest if isinstance(digest, str) else None
        return None

    def store(self, rel: str, st: os.stat_result, digest: str) -> None:
        self.entries[rel] = {"id": identity(st), "sha256": digest}
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            body = json.dumps({"format": _CACHE_FORMAT, "files": self.entries}, sort_keys=True)
            replace_file(self.path, body.encode())
        except OSError:
            pass  # an unwritable cache only means hashing in full next time


def file_problems(directory: Path, manifest: Manifest, *, use_cache: bool = True) -> list[str]:
    """One line per listed file that is missing, of another size than recorded, or whose sha256
    is not the recorded one (each names the file); [] when every file is as written."""
    directory = Path(directory)
    problems: dict[str, str] = {}
    to_hash: dict[str, tuple[FileRecord, os.stat_result]] = {}
    cache = DigestCache(directory) if use_cache else None
    for rel, record in sorted(manifest.files.items()):
        path = directory / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            problems[rel] = f"{path} is missing (the manifest lists it, {record.size} bytes)"
            continue
        except OSError as exc:
            problems[rel] = f"{path} cannot be read ({exc.strerror or exc})"
            continue
        if st.st_size != record.size:
            problems[rel] = (
                f"{path} is {st.st_size} bytes, but {record.size} were written (truncated or replaced)"
            )
            continue
        known = cache.lookup(rel, st) if cache is not None else None
        if known is None:
            to_hash[rel] = (record, st)
        elif known != record.sha256:
            problems[rel] = _changed(path)
    digests = _hash_all({rel: directory / rel for rel in to_hash})
    for rel, (record, st) in to_hash.items():
        digest = digests[rel]
        if isinstance(digest, OSError):
            problems[rel] = f"{directory / rel} cannot be read ({digest.strerror or digest})"
            continue
        if cache is not None:
            cache.store(rel, st, digest)
        if digest != record.sha256:
            problems[rel] = _changed(directory / rel)
    if cache is not None:
        cache.save()
    return [problems[rel] for rel in sorted(problems)]


def _changed(path: Path) -> str:
    return f"{path} is not the file that was written: its sha256 differs from the recorded one (changed in place)"


def _hash_all(paths: Mapping[str, Path]) -> dict[str, str | OSError]:
    """sha256 of each file, several at once (largest first, so one big file does not finish last)."""

    def one(path: Path) -> str | OSError:
        try:
            return sha256_file(path)
        except OSError as exc:
            return exc

    order = sorted(paths, key=lambda rel: -_size(paths[rel]))
    if len(order) <= 1:
        return {rel: one(paths[rel]) for rel in order}
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(order))) as pool:
        return dict(zip(order, pool.map(one, [paths[rel] for rel in order]), strict=True))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def dcp_problems(directory: Path) -> list[str]:
    """One line per file a torch.distributed.checkpoint directory (a torch_dist release, a training
    checkpoint) lacks or holds too few bytes of, from its own index (`.metadata`): a missing index,
    a missing data file, a data file shorter than the tensors it indexes end."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    index = directory / ".metadata"
    if not index.is_file():
        return [f"{index} is missing (the index of the checkpoint's tensor files)"]
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ValueError) as exc:
        return [f"{index} cannot be read ({type(exc).__name__}: {exc}); the index is damaged"]
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), end)
    problems = []
    for rel, end in sorted(ends.items()):
        size = _size(directory / rel) if (directory / rel).is_file() else None
        if size is None:
            problems.append(f"{directory / rel} is missing (its index lists tensors in it)")
        elif size < end:
            problems.append(
                f"{directory / rel} is {size} bytes, but its tensors end at byte {end} (truncated)"
            )
    return problems
