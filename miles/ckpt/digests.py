"""The digest cache: each checkpoint file's sha256 computed once and reused while the file is
unchanged, and the record that a folder was verified with its manifest.

A file's entry holds its identity (device, inode, size, modification and change times in
nanoseconds: writing into a file changes both times, and the change time cannot be set back
by the user), its sha256, and the sha256 of a few small windows of its bytes at offsets only
this user can compute. An entry is used only while the identity is unchanged, the windows
still read back the same and its MAC checks: every entry and every folder record carries an
HMAC-SHA256 over the folder, the file's name, identity and digests, keyed by a random secret
(`<cache>/key`, 32 bytes, readable by its owner only, refused otherwise). So an entry someone
wrote without the key (the tampered file's identity beside the manifest's digest) vouches for
nothing, and bytes changed without a write through the file system are found in the windows
a forger cannot predict. A cache or key that cannot be read safely means hashing in full,
never an error: it is read only from a regular file of bounded size (never a FIFO or device),
and a file that does not parse, however deep its JSON, is no cache.

The cache lives in `$MILES_CACHE_DIR/digests/` (default `~/.cache/miles`), one JSON file per
folder.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from pathlib import Path

from miles.files import FileRefused, read_regular, replace_file

CACHE_ENV = "MILES_CACHE_DIR"
KEY_NAME = "key"
KEY_BYTES = 32
MAX_CACHE_BYTES = 64 << 20  # a few hundred bytes per file of one folder
SAMPLE_WINDOWS = 4
SAMPLE_BYTES = 4096
_FORMAT = 2


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


def cache_key(root: Path | None = None) -> bytes | None:
    """The secret the cache's MACs are keyed with, made on first use; None when it cannot be
    read or made safely (another owner's, readable by others, a link, the wrong size)."""
    path = (root or cache_dir()) / KEY_NAME
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return _read_key(path)
    except OSError:
        return None
    with os.fdopen(fd, "wb") as fh:
        fh.write(secrets.token_bytes(KEY_BYTES))
    return _read_key(path)


def _read_key(path: Path) -> bytes | None:
    try:
        info = os.stat(path, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return None
        raw = read_regular(path, KEY_BYTES, follow=False, what="digest cache key")
    except (OSError, FileRefused):
        return None
    return raw if len(raw) == KEY_BYTES else None


class DigestCache:
    """sha256 digests of one folder's files, reused while each file is unchanged (see above)."""

    def __init__(self, directory: Path | str, root: Path | None = None):
        root = root or cache_dir()
        self.folder = str(Path(directory).resolve())
        self.path = root / "digests" / f"{hashlib.sha256(self.folder.encode()).hexdigest()[:32]}.json"
        self.key = cache_key(root)
        self.entries: dict[str, dict] = {}
        self.record: dict | None = None
        self.changed = False
        if self.key is not None:
            self._load()

    def _load(self) -> None:
        try:
            data = json.loads(read_regular(self.path, MAX_CACHE_BYTES, follow=False, what="digest cache"))
        except (OSError, ValueError, RecursionError):  # FileRefused and bad JSON are ValueErrors
            return
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            return
        if isinstance(data.get("files"), dict):
            self.entries = data["files"]
        if isinstance(data.get("verified"), dict):
            self.record = data["verified"]

    def _mac(self, *parts: object) -> str:
        assert self.key is not None
        body = json.dumps([self.folder, *parts], separators=(",", ":"))
        return hmac.new(self.key, body.encode(), hashlib.sha256).hexdigest()

    def lookup(self, rel: str, st: os.stat_result, path: Path) -> str | None:
        """The cached sha256 of `path` (the file `rel`, of status `st`), or None to hash it."""
        entry = self.entries.get(rel)
        if self.key is None or not isinstance(entry, dict) or entry.get("id") != identity(st):
            return None
        digest, samples = entry.get("sha256"), entry.get("samples")
        if not isinstance(digest, str) or not isinstance(samples, str):
            return None
        if not hmac.compare_digest(
            str(entry.get("mac")), self._mac("file", rel, identity(st), digest, samples)
        ):
            return None
        try:
            if not hmac.compare_digest(samples, self._samples(rel, st, path)):
                return None
        except OSError:
            return None
        return digest

    def store(self, rel: str, st: os.stat_result, path: Path, digest: str) -> None:
        if self.key is None:
            return
        try:
            samples = self._samples(rel, st, path)
        except OSError:
            return
        mac = self._mac("file", rel, identity(st), digest, samples)
        self.entries[rel] = {"id": identity(st), "sha256": digest, "samples": samples, "mac": mac}
        self.changed = True

    def _samples(self, rel: str, st: os.stat_result, path: Path) -> str:
        """sha256 of SAMPLE_WINDOWS windows of the file at offsets derived from the key."""
        size = st.st_size
        seed = hmac.new(self.key or b"", f"{self.folder}\0{rel}\0{identity(st)}".encode(), "sha256").digest()
        span = max(size - SAMPLE_BYTES, 0) + 1
        offsets = [int.from_bytes(seed[8 * i : 8 * i + 8], "little") % span for i in range(SAMPLE_WINDOWS)]
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for offset in sorted(offsets):
                h.update(os.pread(fh.fileno(), SAMPLE_BYTES, offset))
        return h.hexdigest()

    def remember_manifest(self, manifest_sha256: str) -> None:
        """Record that the folder was written or verified with the manifest of this digest."""
        if self.key is None:
            return
        self.record = {"manifest": manifest_sha256, "mac": self._mac("verified", manifest_sha256)}
        self.changed = True

    def remembered_manifest(self) -> str | None:
        """The digest of the manifest the folder was last written or verified with, if recorded."""
        record = self.record
        if self.key is None or not isinstance(record, dict) or not isinstance(record.get("manifest"), str):
            return None
        if not hmac.compare_digest(str(record.get("mac")), self._mac("verified", record["manifest"])):
            return None
        return record["manifest"]

    def save(self) -> None:
        if not self.changed or self.key is None:
            return
        body = {"format": _FORMAT, "files": self.entries, "verified": self.record}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, json.dumps(body, sort_keys=True).encode(), mode=0o600)
        except OSError:
            pass  # an unwritable cache only means hashing in full next time
        self.changed = False
