"""Copy prepared checkpoints to a node-local directory, skipping files already there.

A staged directory carries the source's manifest. A copy is taken as complete only once its
files are verified against that manifest (miles.ckpt.verify: sha256, with the digest cache),
and a file already there is kept only when its own sha256 is the recorded one: a manifest
never vouches for bytes nobody read. Every byte copied is hashed on the way and compared
with the source's manifest, so a source changed since its step is refused, not staged. The
copy is made in `.<name>.partial-<pid>` (an existing copy or a killed run's partial is moved
there and updated in place) and renamed into place when every file is there, with the
manifest written last: a half-staged directory never looks finished. The copy must lie
outside what it copies.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from miles.ckpt.errors import CheckpointError
from miles.ckpt.manifest import MANIFEST_NAME, clean_stale, partial_path, read_manifest, remember_written
from miles.ckpt.progress import Progress
from miles.ckpt.shards import sha256_file
from miles.ckpt.verify import file_problems
from miles.files import FileRefused, create_new, refuse_overlap, replace_file, resolve_inside

_CHUNK = 16 << 20


def stage_dir(src: Path, dst: Path, *, progress: Progress | None = None) -> int:
    """Make `dst` a copy of the finished directory `src`; return the bytes actually copied."""
    src, dst = Path(src), Path(dst)
    try:
        refuse_overlap(dst, [src], what="stage copy")
    except FileRefused as exc:
        raise CheckpointError(str(exc)) from None
    manifest = read_manifest(src)
    if manifest is None:
        raise CheckpointError(f"{src} has no {MANIFEST_NAME}; only finished steps' outputs can be staged")
    old = read_manifest(dst)
    if old == manifest and not file_problems(dst, manifest):
        return 0
    if dst.exists() and old is None:
        raise CheckpointError(
            f"{dst} exists and was not staged by miles; move it away or choose another stage dir"
        )
    work = _workspace(dst)
    if progress is not None:
        progress.total_bytes = sum(r.size for r in manifest.files.values())
        progress.total_tensors = 0
    copied = 0
    for rel, record in sorted(manifest.files.items()):
        target = _inside(work, rel)
        if _same(target, record.size, record.sha256):
            if progress is not None:
                progress.advance(record.size)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        _inside(work, rel)  # the folders just made (or found) stay inside the copy
        tmp = target.with_name(target.name + ".copying")
        tmp.unlink(missing_ok=True)  # a killed run's; the copy is always a new file
        try:
            digest = _copy(_inside(src, rel), tmp)
            if digest != record.sha256:
                raise CheckpointError(
                    f"{src / rel} is not the file its step wrote (its sha256 differs from {src / MANIFEST_NAME}); "
                    "rerun the step that makes it, then stage again"
                )
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, target)
        copied += record.size
        if progress is not None:
            progress.advance(record.size)
    for path in sorted(work.rglob("*"), reverse=True):
        rel = path.relative_to(work).as_posix()
        if (path.is_symlink() or path.is_file()) and rel not in manifest.files:
            path.unlink()  # a link itself, never what it points to
        elif path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            path.rmdir()
    replace_file(work / MANIFEST_NAME, manifest.to_json().encode())
    work.rename(dst)
    remember_written(dst)
    return copied


def _workspace(dst: Path) -> Path:
    """The partial directory to update: the old copy, a killed run's partial, or a new one."""
    work = partial_path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    leftovers = sorted(
        p
        for p in dst.parent.glob(f".{dst.name}.partial-*")
        if p.is_dir() and p != work and p.name.rsplit("-", 1)[-1].isdigit()
    )
    if dst.exists():
        (dst / MANIFEST_NAME).unlink(missing_ok=True)  # from here on the copy is being changed
        dst.rename(work)
    elif leftovers:
        leftovers[-1].rename(work)
    else:
        work.mkdir(exist_ok=True)
    clean_stale(dst, keep=work)
    return work


def _inside(folder: Path, rel: str) -> Path:
    try:
        return resolve_inside(folder, rel, what="manifest entry")
    except FileRefused as exc:
        raise CheckpointError(f"{folder}: {exc}") from None


def _copy(source: Path, target: Path) -> str:
    """Copy `source` to the new file `target` (fsynced); the sha256 of the bytes copied."""
    digest = hashlib.sha256()
    with open(source, "rb") as fin, create_new(target) as fout:
        while chunk := fin.read(_CHUNK):
            digest.update(chunk)
            fout.write(chunk)
        fout.flush()
        os.fsync(fout.fileno())
    return digest.hexdigest()


def _same(target: Path, size: int, sha256: str) -> bool:
    """A file already in the copy is kept when its own bytes hash to the recorded sha256."""
    try:
        if not target.is_file() or target.is_symlink() or target.stat().st_size != size:
            return False
    except OSError:
        return False
    return sha256_file(target) == sha256
