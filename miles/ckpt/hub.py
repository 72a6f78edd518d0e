"""Fetch: turn a plan's source into a local directory, and materialise it as the HF dir.

Sources: "tiny:<family>" (built locally), a local path, or a Hugging Face repo id with an
optional "@revision". Repo ids go through huggingface_hub's cache (HF_HOME / HF_HUB_CACHE
are honoured). The cache is consulted first without network, so a machine that already
has the files never needs the hub; HF_HUB_OFFLINE=1 makes a missing file an error instead
of a download. When the plan cuts a slice, only the shards holding the kept layers are
downloaded.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import num_layers
from miles.ckpt.manifest import FileRecord
from miles.ckpt.plan import TINY_SOURCE_PREFIX
from miles.ckpt.progress import Progress
from miles.ckpt.shards import (
    INDEX_NAME,
    SINGLE_SHARD,
    checkpoint_file,
    read_json_file,
    read_weight_map,
    sha256_file,
)

META_PATTERNS = ["*.json", "*.txt", "*.jinja", "*.model", "*.tiktoken"]
_REPO_RE = re.compile(r"^[\w.-]+/[\w.-]+(@[\w./-]+)?$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Source:
    kind: str  # "tiny" | "local" | "hub"
    value: str  # family, absolute path, or repo id
    revision: str | None = None


def parse_source(source: str) -> Source:
    if source.startswith(TINY_SOURCE_PREFIX):
        return Source("tiny", source[len(TINY_SOURCE_PREFIX) :])
    path = Path(source).expanduser()
    if path.is_absolute() or source.startswith(".") or path.exists():
        return Source("local", str(path.resolve()))
    if _REPO_RE.match(source):
        repo, _, revision = source.partition("@")
        return Source("hub", repo, revision or None)
    raise CheckpointError(
        f"source {source!r} is not tiny:<family>, an existing path, or a Hugging Face repo id (org/name[@revision])"
    )


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_local(source: Source) -> Path:
    path = Path(source.value)
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"source {path} has no config.json; point the plan at a Hugging Face checkpoint directory"
        )
    return path


def resolve_hub(
    source: Source, *, keep_layers: int | None = None, download: bool = True
) -> tuple[Path | None, bool]:
    """(snapshot directory holding what the plan needs, whether anything was downloaded).

    keep_layers: the plan cuts this many layers, so only shards holding them are needed.
    download=False only looks in the cache (for --dry) and gives None when files are missing.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, IncompleteSnapshotError, LocalEntryNotFoundError

    def fetch(patterns: list[str], local_only: bool) -> Path | None:
        try:
            return Path(
                snapshot_download(
                    source.value,
                    revision=source.revision,
                    allow_patterns=patterns,
                    local_files_only=local_only,
                )
            )
        except (LocalEntryNotFoundError, IncompleteSnapshotError, FileNotFoundError):
            return None
        except (HfHubHTTPError, OSError) as exc:
            raise CheckpointError(f"cannot download {source.value}: {exc}") from exc

    for local_only in (True, False):
        if not local_only and (offline() or not download):
            break
        root = fetch(META_PATTERNS, local_only)
        if root is None or not (root / "config.json").is_file():
            continue
        patterns = META_PATTERNS + _weight_files(root, keep_layers)
        root = fetch(patterns, local_only)
        if root is not None and _has_weights(root, keep_layers):
            return root, not local_only
    if not download:
        return None, False
    hint = "HF_HUB_OFFLINE is set and " if offline() else ""
    raise CheckpointError(
        f"{source.value}: {hint}the Hugging Face cache ({os.environ.get('HF_HOME', '~/.cache/huggingface')}) "
        "lacks config.json or weight shards; unset HF_HUB_OFFLINE or download it on a machine with network"
    )


def _weight_files(root: Path, keep_layers: int | None) -> list[str]:
    from miles.ckpt.trim import trimmed_name

    if not (root / INDEX_NAME).is_file():
        return [SINGLE_SHARD]
    weight_map = read_weight_map(root).weight_map  # every shard name checked to stay inside root
    total = num_layers(read_json_file(root / "config.json"))
    if keep_layers is None or total is None or keep_layers >= total:
        return sorted(set(weight_map.values()))
    return sorted(
        {shard for name, shard in weight_map.items() if trimmed_name(name, keep_layers, total) is not None}
    )


def _has_weights(root: Path, keep_layers: int | None) -> bool:
    return all((root / f).is_file() for f in _weight_files(root, keep_layers))


def materialize(src: Path, dst: Path, *, progress: Progress | None = None) -> dict[str, FileRecord]:
    """Fill the empty dir `dst` with `src`'s files: hard links where possible, else copies.

    Hub cache files are links to blobs named by their sha256 (for large files), so their
    hash is known without reading them; other files are hashed once here.
    """
    files = sorted(p for p in Path(src).rglob("*") if p.is_file() and not _hidden(p.relative_to(src)))
    for path in files:  # a link out of the source would copy (or hard-link) an outside file in
        checkpoint_file(src, path.relative_to(src).as_posix())
    if progress is not None:
        progress.total_bytes = sum(p.stat().st_size for p in files)
    records = {}
    for path in files:
        rel = path.relative_to(src)
        real = path.resolve()
        target = Path(dst) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(real, target)
        except OSError:
            shutil.copyfile(real, target)
        size = target.stat().st_size
        digest = real.name if _SHA256_RE.match(real.name) and real.name != path.name else sha256_file(target)
        records[rel.as_posix()] = FileRecord(size, digest)
        if progress is not None:
            progress.advance(size)
    return records


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)
