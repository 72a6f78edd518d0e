"""Tiny checkpoints and their torch_dist forms, built once and shared: a content-addressed cache.

A tiny checkpoint is a function of its parameters (miles.ckpt.tiny.tiny_params) and of the code
and libraries that build it; its torch_dist form, of the tiny checkpoint's content and the
conversion's parameters. The cache keeps each entry under the sha256 of exactly that
(`<root>/tiny-<key>/`, `<root>/torch_dist-<key>/`), written by the one builder of each
(make_tiny_checkpoint, convert_to_torch_dist) into a temporary sibling and renamed into place with
its manifest last, so a reader sees a finished entry or none. Every use verifies the entry's files
against its manifest (size and sha256; the digest cache of miles.ckpt.verify makes an unchanged
file a stat) and a damaged entry is moved aside and built again. Builders of one entry take turns
under a lock (the second finds the first's work); readers never wait for a lock.

An entry is shared: treat it as read-only (`copy_of` gives a private copy to change). The cache's
folder is `$MILES_TINY_CACHE`; the CI runner gives every file of a lane run the same fresh one, so
the lane builds each family and size once; without it, each call builds into a folder of the
caller's (`root=`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from miles.ckpt.errors import CheckpointError
from miles.ckpt.manifest import atomic_dir, fingerprint, plan_lock, read_manifest, write_manifest
from miles.ckpt.tiny import DEFAULT_SHARD_BYTES, TINY_STEP, make_tiny_checkpoint, tiny_params

CACHE_ENV = "MILES_TINY_CACHE"
TORCH_DIST_STEP = "torch_dist"
FORMAT = 1  # of the cache's layout; a new one leaves old entries unread


@dataclass(frozen=True)
class TinyCheckpoint:
    """A cached tiny checkpoint: its HF folder and, when asked for, its torch_dist form."""

    hf: Path
    torch_dist: Path | None = None


def cache_root(root: str | Path | None = None) -> Path:
    """`root`, else $MILES_TINY_CACHE; a CheckpointError naming both when neither is given."""
    given = root if root is not None else os.environ.get(CACHE_ENV)
    if not given:
        raise CheckpointError(
            f"no tiny-checkpoint cache: set {CACHE_ENV} to a folder (the CI runner sets one per lane run) "
            "or pass root="
        )
    path = Path(given)
    path.mkdir(parents=True, exist_ok=True)
    return path


def tiny_checkpoint(
    family: str,
    layers: int,
    *,
    torch_dist: bool = False,
    seed: int = 0,
    dtype: str = "bfloat16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    root: str | Path | None = None,
    **dims: Any,
) -> TinyCheckpoint:
    """The tiny checkpoint make_tiny_checkpoint(family, layers, seed=, dtype=, shard_bytes=, **dims)
    builds, from the cache (built there first if missing or damaged); with `torch_dist`, also its
    torch_dist form (convert_to_torch_dist with the family's own mapping)."""
    folder = cache_root(root)
    params = tiny_params(family, layers, seed, dtype, shard_bytes, dims)
    key = _key({"step": TINY_STEP, "params": params})
    hf = _entry(
        folder / f"tiny-{key}",
        lambda out: make_tiny_checkpoint(
            family, layers, out, seed=seed, dtype=dtype, shard_bytes=shard_bytes, progress=False, **dims
        ),  # fmt: skip
    )
    if not torch_dist:
        return TinyCheckpoint(hf)
    source = fingerprint(hf)  # the manifest's hash: the checkpoint's content
    dist_key = _key({"step": TORCH_DIST_STEP, "source": source, "family": family})
    return TinyCheckpoint(
        hf, _entry(folder / f"torch_dist-{dist_key}", lambda out: _convert(hf, out, family, source))
    )


def copy_of(entry: Path, into: Path) -> Path:
    """A private copy of a cached folder at `into` (a test that changes a checkpoint changes this)."""
    shutil.copytree(entry, into, symlinks=False)
    for path in [into, *into.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return into


def _convert(hf: Path, out: Path, family: str, source: str) -> None:
    from miles.ckpt.torch_dist import convert_to_torch_dist

    with atomic_dir(out, reads=[hf], replaces=(TORCH_DIST_STEP,)) as tmp:
        convert_to_torch_dist(hf, tmp, family)
        write_manifest(tmp, TORCH_DIST_STEP, source, {"family": family})


def _entry(final: Path, build) -> Path:
    """`final` verified, or built under its lock when it is missing or damaged."""
    if _sound(final):
        return final
    with plan_lock(final.parent / f".{final.name}.lock"):
        if _sound(final):  # another builder finished it while this one waited
            return final
        if final.exists():  # damaged: moved aside whole, so no reader sees it half replaced
            aside = final.parent / f".{final.name}.stale-{os.getpid()}"
            _writable(final)
            final.rename(aside)
            shutil.rmtree(aside, ignore_errors=True)
        build(final)
        _read_only(final)
    if not _sound(final):
        raise CheckpointError(f"{final}: built, but its files do not match its manifest")
    return final


def _sound(entry: Path) -> bool:
    from miles.ckpt.verify import file_problems

    manifest = read_manifest(entry)
    return manifest is not None and not file_problems(entry, manifest)


def _read_only(entry: Path) -> None:
    for path in entry.rglob("*"):
        if path.is_file():
            path.chmod(0o444)


def _writable(entry: Path) -> None:
    for path in [entry, *entry.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def _key(what: dict[str, Any]) -> str:
    body = json.dumps({"format": FORMAT, "builder": builder_fingerprint(), **what}, sort_keys=True)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


@cache
def builder_fingerprint() -> str:
    """What else decides an entry's bytes: the versions of torch, transformers and megatron-core,
    and miles' own source (a change to a family's tiny recipe or mapping makes new entries)."""
    from importlib import metadata

    versions = {}
    for name in ("torch", "transformers", "megatron-core", "safetensors"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    h = hashlib.sha256(json.dumps(versions, sort_keys=True).encode())
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def tiny_here(
    family: str, layers: int, out_dir: str | Path, *, torch_dist: bool = False, **kwargs: Any
) -> TinyCheckpoint:
    """The tiny checkpoint (and with `torch_dist` its torch_dist form) from the cache when
    $MILES_TINY_CACHE names one (a CI run's); else built in `out_dir` (its torch_dist form in
    `<out_dir>_torch_dist`), as a tool run by hand on a fresh machine does."""
    if os.environ.get(CACHE_ENV):
        return tiny_checkpoint(family, layers, torch_dist=torch_dist, **kwargs)
    from miles.ckpt.torch_dist import convert_to_torch_dist

    out = Path(out_dir)
    hf = make_tiny_checkpoint(family, layers, out, progress=False, **kwargs)
    if not torch_dist:
        return TinyCheckpoint(hf)
    dist = out.with_name(f"{out.name}_torch_dist")
    if not (dist / "latest_checkpointed_iteration.txt").is_file():
        shutil.rmtree(dist, ignore_errors=True)
        dist.mkdir(parents=True)
        convert_to_torch_dist(hf, dist, family)
    return TinyCheckpoint(hf, dist)
