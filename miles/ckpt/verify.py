"""Is a prepared directory still what its manifest recorded? Checked before it is used again.

prepare-ckpt records each output file's size and sha256 in the directory's manifest
(miles.ckpt.manifest). `file_problems(directory, manifest)` checks every listed file: there,
of the recorded size, with the recorded sha256; and it refuses every file the manifest does
not list (a `model.safetensors` planted beside the index is what a loader would read).
`manifest_problems(directory)` is the check before a folder is used: a manifest that is there
but cannot be read is refused (a truncated one vouches for nothing), and so is a folder that
lost its manifest after it was written or verified with one on this machine (the digest
cache remembers which); a folder that never had one is left to the checks of its own files.
A rerun of prepare-ckpt redoes a step whose output fails (pipeline.py), and the trainer
refuses a --hf-checkpoint or --ref-load that fails (miles.train.inputs), each naming the file.

Hashing is the cost (sha256 reads every byte; benchmarks/bench_ckpt_verify.py measures it). A
file is hashed in full on first use and its digest kept in the digest cache (miles.ckpt.digests:
keyed by the file's identity, sampled and MAC'd, so a forged entry vouches for nothing); an
unchanged file then costs a stat and a few small reads. Files are hashed on up to four threads
at once (hashlib releases the GIL while it hashes a large buffer).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from miles.ckpt.digests import CACHE_ENV, DigestCache, cache_dir, identity
from miles.ckpt.errors import CheckpointError
from miles.ckpt.manifest import MANIFEST_NAME, FileRecord, Manifest, load_manifest
from miles.ckpt.shards import sha256_file

__all__ = [
    "CACHE_ENV",
    "DigestCache",
    "cache_dir",
    "dcp_problems",
    "file_problems",
    "identity",
    "manifest_problems",
]

HASH_THREADS = 4
_MAX_UNLISTED = 5  # named in a problem; the rest are counted


def manifest_problems(directory: Path) -> list[str]:
    """One line per problem of a folder a run is about to load: its manifest damaged, lost
    after it was written or verified here, or a file it lists or does not list (file_problems);
    [] for an intact folder, or one that never had a manifest."""
    directory = Path(directory)
    try:
        manifest = load_manifest(directory)
    except CheckpointError as exc:
        return [f"{exc}; without it the folder's files cannot be checked"]
    if manifest is not None:
        return file_problems(directory, manifest)
    cache = DigestCache(directory)
    if cache.remembered_manifest() is None:
        return []
    return [
        f"{directory / MANIFEST_NAME} is missing, but {directory} was written or verified with it on this "
        "machine: without it nothing vouches for its files (if the folder was replaced on purpose, delete "
        f"the record {cache.path})"
    ]


def file_problems(directory: Path, manifest: Manifest, *, use_cache: bool = True) -> list[str]:
    """One line per listed file that is missing, of another size than recorded, or whose sha256
    is not the recorded one, and per file the manifest does not list (each names the file);
    [] when every file is as written."""
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
        known = cache.lookup(rel, st, path) if cache is not None else None
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
            cache.store(rel, st, directory / rel, digest)
        if digest != record.sha256:
            problems[rel] = _changed(directory / rel)
    unlisted = _unlisted(directory, manifest)
    if unlisted:
        shown = ", ".join(str(directory / rel) for rel in unlisted[:_MAX_UNLISTED])
        more = f" and {len(unlisted) - _MAX_UNLISTED} more" if len(unlisted) > _MAX_UNLISTED else ""
        problems["\U0010ffff"] = (
            f"{shown}{more}: not in {directory / MANIFEST_NAME}, so not what the step wrote (a loader may read "
            "it instead of the listed files); remove it"
        )
    if cache is not None:
        if not problems:
            cache.remember_manifest(manifest.digest)
        cache.save()
    return [problems[rel] for rel in sorted(problems)]


def _unlisted(directory: Path, manifest: Manifest) -> list[str]:
    """Files (and links) under `directory` that are neither listed nor the manifest itself."""
    found = []
    for root, dirs, files in os.walk(directory):
        rel_root = Path(root).relative_to(directory)
        links = [d for d in dirs if os.path.islink(os.path.join(root, d))]  # never followed
        dirs[:] = sorted(d for d in dirs if d not in links)
        for name in sorted([*files, *links]):
            rel = (rel_root / name).as_posix()
            if rel != MANIFEST_NAME and rel not in manifest.files:
                found.append(rel)
    return found


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
