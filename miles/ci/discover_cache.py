"""Remember each test file's discovery result so unchanged files are not parsed again.

Entries are keyed by the file's (size, mtime_ns, inode) and the whole cache by a
fingerprint of the catalog and of discovery's own code, so an edited file, an edited
catalog or a changed rule all mean a fresh parse. As in git's index, a file modified in the
last seconds before discovery started is not cached: a second edit within the clock's
granularity could keep the same signature. The cache is an optimisation only; any problem
reading or writing it falls back to parsing.

The entries are pickled records: restoring them skips the frozen dataclasses' __init__,
which is most of what a warm discovery would otherwise spend. The file sits in the
project's own `.miles/` directory, written by the same user who runs the tests, so loading
it trusts nothing that editing a test file would not.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import time
from pathlib import Path

from miles.ci.registration import Problem, TestFile

CACHE_FILE = Path(".miles") / "cache" / "discover.pickle"
CACHE_FORMAT = 4  # bump when the shape of an entry changes
_RACY_WINDOW_NS = 2_000_000_000
_PACKAGE = Path(__file__).resolve().parents[1]
# The code whose behaviour decides a file's records and problems.
_CODE = (
    "ci/discover.py",
    "ci/rules.py",
    "ci/reasons.py",
    "ci/catalog.py",
    "ci/registration.py",
    "ci/discover_cache.py",
    "ci/register.py",
    "metrics/spec.py",
)


def fingerprint(catalog_path: Path) -> str:
    digest = hashlib.sha256(str(CACHE_FORMAT).encode())
    for path in (catalog_path, *(_PACKAGE / name for name in _CODE)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class DiscoveryCache:
    def __init__(self, root: Path, catalog_path: Path):
        self.path = root / CACHE_FILE
        self.fingerprint = fingerprint(catalog_path)
        self.started_ns = time.time_ns()
        self.entries: dict[str, tuple[tuple[int, int, int], TestFile, list[Problem]]] = {}
        self.dirty = False
        try:
            with open(self.path, "rb") as fh:
                data = pickle.load(fh)
        except Exception:  # a cache from another version or a torn write: parse instead
            return
        if isinstance(data, dict) and data.get("fingerprint") == self.fingerprint:
            self.entries = data.get("files", {})

    def get(self, rel: str, stat: os.stat_result) -> tuple[TestFile, list[Problem]] | None:
        entry = self.entries.get(rel)
        if entry is None or entry[0] != (stat.st_size, stat.st_mtime_ns, stat.st_ino):
            return None
        return entry[1], entry[2]

    def put(self, rel: str, stat: os.stat_result, test_file: TestFile, problems: list[Problem]) -> None:
        if stat.st_mtime_ns >= self.started_ns - _RACY_WINDOW_NS:
            self.entries.pop(rel, None)
            return
        self.entries[rel] = ((stat.st_size, stat.st_mtime_ns, stat.st_ino), test_file, list(problems))
        self.dirty = True

    def prune(self, seen: set[str]) -> None:
        stale = set(self.entries) - seen
        for rel in stale:
            del self.entries[rel]
        self.dirty |= bool(stale)

    def save(self) -> None:
        if not self.dirty:
            return
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as fh:
                pickle.dump({"fingerprint": self.fingerprint, "files": self.entries}, fh, protocol=5)
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
