"""Weights handed to the engines through a directory: full versions and deltas, checksummed.

The trainer publishes each weight sync as a version directory under --update-weight-disk-dir:
`v00000012/` holds safetensors shards and `manifest.json` (written last, then the directory
is renamed into place, so a half-written version is never visible). A full version holds every
tensor; a delta (--update-weight-transfer-mode disk-delta, as the seed framework's) holds only
the tensors whose bytes changed since the previous version, byte-level and dtype-blind:
`xor` (new ^ old: small, but applying it twice reverts it) or `overwrite` (the changed byte
positions and their new values: idempotent). Every tensor's result and every file carry a
checksum (--update-weight-delta-checksum) that the reader verifies.

An engine host applies versions to its own full copy, --update-weight-local-checkpoint-dir
(`apply_version`): the files a delta touches are rebuilt in a staging directory, each patched
tensor checked against its recorded checksum, then renamed into place, and the copy's own
manifest (its version) is written last. An apply that was interrupted resumes: a complete
staging directory is renamed in, an incomplete one is rebuilt from the untouched files, and a
copy already at the version is left alone, so even an xor delta is applied exactly once.
Engines sharing a host take turns (a file lock). A publish that was interrupted resumes too:
shards already written with the same bytes are kept.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from miles.train.remote.checksums import digest, tensor_checksum

FORMAT = "miles-weights/1"
MANIFEST = "manifest.json"
ENCODINGS = ("xor", "overwrite")


class WeightFilesError(RuntimeError):
    """A version directory or local copy is missing, damaged or out of order; says which and why."""


def version_dir(disk_dir: str | Path, version: int) -> Path:
    return Path(disk_dir) / f"v{version:08d}"


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightFilesError(f"{path}: missing; {directory} is not a complete weight version") from None
    except json.JSONDecodeError as exc:
        raise WeightFilesError(f"{path}: not JSON ({exc})") from None
    if manifest.get("format") != FORMAT:
        raise WeightFilesError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def _dtype_name(tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _as_bytes(tensor):
    import torch

    return tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)


# --- the trainer's side ----------------------------------------------------------------------


@dataclass
class Publisher:
    """Writes each weight sync as a version directory (full, or a delta against the last one)."""

    disk_dir: Path
    delta: bool = False
    encoding: str = "xor"
    checksum: str = "sha256"
    bucket_bytes: int = 512 << 20
    keep: int = 2  # version directories left on disk (the newest)
    _snapshot: dict = field(default_factory=dict)  # name -> uint8 bytes of the last version (delta)
    _last: int | None = None

    def publish(self, named_tensors: Iterable[tuple[str, object]], version: int) -> Path:
        """Write `version` (a delta when there is a previous version to diff against)."""
        hashed = digest(self.checksum)
        as_delta = self.delta and self._last is not None
        final = version_dir(self.disk_dir, version)
        partial = final.with_name(f".{final.name}.partial")
        partial.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, dict] = {}
        files: dict[str, str] = {}
        shard: dict = {}
        size = 0
        snapshot = {} if self.delta else None
        for name, tensor in named_tensors:
            raw = _as_bytes(tensor)
            entry = {
                "dtype": _dtype_name(tensor),
                "shape": list(tensor.shape),
                "checksum": tensor_checksum(tensor),
            }
            if snapshot is not None:
                snapshot[name] = raw.clone()
            if as_delta:
                encoded = self._encode(name, raw)
                if encoded is None:
                    continue  # unchanged since the last version
            else:
                encoded = {name: tensor.detach().to("cpu").contiguous().clone()}
            entry["file"] = _shard_name(len(files))
            tensors[name] = entry
            shard.update(encoded)
            size += sum(t.numel() * t.element_size() for t in encoded.values())
            if size >= self.bucket_bytes:
                files[entry["file"]] = _write_shard(partial / entry["file"], shard, hashed)
                shard, size = {}, 0
        if shard:
            files[_shard_name(len(files))] = _write_shard(partial / _shard_name(len(files)), shard, hashed)
        manifest = {
            "format": FORMAT,
            "version": version,
            "kind": "delta" if as_delta else "full",
            "base": self._last if as_delta else None,
            "encoding": self.encoding if as_delta else None,
            "checksum": self.checksum,
            "tensors": tensors,
            "files": files,
        }
        _write_json(partial / MANIFEST, manifest)
        _replace_dir(partial, final)
        if snapshot is not None:
            self._snapshot = snapshot
        self._last = version
        self._prune(version)
        return final

    def _encode(self, name: str, raw) -> dict | None:
        import torch

        old = self._snapshot.get(name)
        if old is None or old.numel() != raw.numel():
            raise WeightFilesError(
                f"a delta of {name} has no base of its size in the previous version; the trainer's weights "
                "changed shape between syncs"
            )
        if torch.equal(old, raw):
            return None
        if self.encoding == "xor":
            return {name: torch.bitwise_xor(raw, old)}
        positions = (raw != old).nonzero().squeeze(1)
        return {f"{name}/positions": positions, f"{name}/values": raw[positions].clone()}

    def _prune(self, newest: int) -> None:
        versions = sorted(p for p in self.disk_dir.glob("v" + "[0-9]" * 8) if p.is_dir())
        for old in versions[: max(0, len(versions) - self.keep)]:
            if int(old.name[1:]) < newest:
                shutil.rmtree(old, ignore_errors=True)


def _shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


def _write_shard(path: Path, tensors: dict, hashed) -> str:
    """Write a shard (kept when an interrupted publish already wrote the same bytes); its digest."""
    from safetensors.torch import save

    data = save(tensors)
    checksum = hashed(data)
    sidecar = path.with_name(path.name + ".digest")
    if path.is_file() and sidecar.is_file() and sidecar.read_text() == checksum:
        return checksum
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    sidecar.write_text(checksum)
    return checksum


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _replace_dir(source: Path, target: Path) -> None:
    for sidecar in source.glob("*.digest"):
        sidecar.unlink()
    if target.exists():
        stale = target.with_name(f".{target.name}.replaced")
        shutil.rmtree(stale, ignore_errors=True)
        os.replace(target, stale)
        os.replace(source, target)
        shutil.rmtree(stale, ignore_errors=True)
    else:
        os.replace(source, target)


# --- the engine host's side -----------------------------------------------------------------


def read_weights(directory: str | Path) -> Iterator[tuple[str, object]]:
    """Every tensor of a full version or local copy, its files verified against the manifest."""
    from safetensors.torch import load

    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest["kind"] != "full":
        raise WeightFilesError(
            f"{directory}: a delta of version {manifest['base']}; load a full version or the local copy it was "
            "applied to"
        )
    hashed = digest(manifest["checksum"])
    for file, expected in sorted(manifest["files"].items()):
        data = _read_verified(directory / file, expected, hashed)
        yield from load(data).items()


def _read_verified(path: Path, expected: str, hashed) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise WeightFilesError(f"{path}: missing (listed in {path.parent / MANIFEST})") from None
    if hashed(data) != expected:
        raise WeightFilesError(
            f"{path}: checksum {hashed(data)} is not the manifest's {expected}: the file is damaged"
        )
    return data


def local_version(local_dir: str | Path) -> int | None:
    """The version a local copy holds (None: no complete copy yet)."""
    path = Path(local_dir) / MANIFEST
    return read_manifest(local_dir)["version"] if path.is_file() else None


@contextmanager
def _host_lock(local_dir: Path):
    local_dir.mkdir(parents=True, exist_ok=True)
    with open(local_dir / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def apply_version(version_path: str | Path, local_dir: str | Path) -> int:
    """Bring the local copy to `version_path`'s version (see the module docstring); returns it."""
    version_path, local_dir = Path(version_path), Path(local_dir)
    manifest = read_manifest(version_path)
    target = manifest["version"]
    with _host_lock(local_dir):
        held = local_version(local_dir)
        if held == target:
            return target
        if manifest["kind"] == "delta" and held != manifest["base"]:
            raise WeightFilesError(
                f"{version_path} is a delta from version {manifest['base']}, but {local_dir} holds "
                f"{'no version' if held is None else f'version {held}'}; apply the versions in order (a full "
                "version reseeds it)"
            )
        staging = local_dir / f".staging-{target:08d}"
        if not (staging / MANIFEST).is_file():
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            if manifest["kind"] == "full":
                staged = _stage_full(version_path, manifest, staging)
            else:
                staged = _stage_delta(version_path, manifest, local_dir, staging)
            _write_json(staging / MANIFEST, staged)
        staged = read_manifest(staging)
        if manifest["kind"] == "full":
            for old in local_dir.glob("shard-*.safetensors"):
                if old.name not in staged["files"]:
                    old.unlink()
        for file in staged["files"]:
            if (staging / file).is_file():
                os.replace(staging / file, local_dir / file)
        _write_json(local_dir / MANIFEST, staged)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _stage_full(version_path: Path, manifest: dict, staging: Path) -> dict:
    hashed = digest(manifest["checksum"])
    for file, expected in manifest["files"].items():
        (staging / file).write_bytes(_read_verified(version_path / file, expected, hashed))
    return {**manifest, "kind": "full", "base": None, "encoding": None}


def _stage_delta(version_path: Path, manifest: dict, local_dir: Path, staging: Path) -> dict:
    """Rebuild each local file holding a changed tensor, patched and verified, in `staging`."""
    from safetensors.torch import load, save

    hashed = digest(manifest["checksum"])
    held = read_manifest(local_dir)
    delta: dict = {}
    for file, expected in manifest["files"].items():
        delta.update(load(_read_verified(version_path / file, expected, hashed)))
    changed_by_file: dict[str, list[str]] = {}
    for name in manifest["tensors"]:
        if name not in held["tensors"]:
            raise WeightFilesError(f"{version_path}: tensor {name} is not in the local copy {local_dir}")
        changed_by_file.setdefault(held["tensors"][name]["file"], []).append(name)
    tensors = {name: dict(entry) for name, entry in held["tensors"].items()}
    files = dict(held["files"])
    local_hashed = digest(held["checksum"])
    for file, names in changed_by_file.items():
        content = load(_read_verified(local_dir / file, held["files"][file], local_hashed))
        for name in names:
            entry = manifest["tensors"][name]
            content[name] = _patched(name, content[name], delta, manifest["encoding"])
            if tensor_checksum(content[name]) != entry["checksum"]:
                raise WeightFilesError(
                    f"{version_path}: {name} patched onto version {held['version']} has checksum "
                    f"{tensor_checksum(content[name])}, not the trainer's {entry['checksum']}: the local copy is not "
                    "the delta's base"
                )
            tensors[name] = {**tensors[name], "checksum": entry["checksum"]}
        data = save(content)
        (staging / file).write_bytes(data)
        files[file] = hashed(data)
    return {
        **held,
        "version": manifest["version"],
        "checksum": manifest["checksum"],
        "tensors": tensors,
        "files": files,
    }


def _patched(name: str, old, delta: dict, encoding: str):
    import torch

    raw = old.contiguous().reshape(-1).view(torch.uint8).clone()
    if encoding == "xor":
        raw = torch.bitwise_xor(raw, delta[name])
    elif encoding == "overwrite":
        raw[delta[f"{name}/positions"]] = delta[f"{name}/values"]
    else:
        raise WeightFilesError(f"unknown delta encoding {encoding!r}; known: {', '.join(ENCODINGS)}")
    return raw.view(old.dtype).reshape(old.shape)
