"""Remember each test file's discovery result so unchanged files are not parsed again.

Entries are keyed by the file's (size, mtime_ns, inode) and the whole cache by a
fingerprint of the catalog and of discovery's own code, so an edited file, an edited
catalog or a changed rule all mean a fresh parse. As in git's index, a file modified in the
last seconds before discovery started is not cached: a second edit within the clock's
granularity could keep the same signature. The cache is an optimisation only; any problem
reading or writing it falls back to parsing.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from miles.ci.registration import (
    Problem,
    TestFile,
    gate_from_json,
    registration_from_json,
)

CACHE_FILE = Path(".miles") / "cache" / "discover.json"
_RACY_WINDOW_NS = 2_000_000_000
_PACKAGE = Path(__file__).resolve().parents[1]
# The code whose behaviour decides a file's records and problems.
_CODE = (
    "ci/discover.py",
    "ci/rules.py",
    "ci/registration.py",
    "ci/discover_cache.py",
    "ci/register.py",
    "metrics/spec.py",
)


def fingerprint(catalog_path: Path) -> str:
    digest = hashlib.sha256()
    for path in (catalog_path, *(_PACKAGE / name for name in _CODE)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _signature(stat: os.stat_result) -> list[int]:
    return [stat.st_size, stat.st_mtime_ns, stat.st_ino]


class DiscoveryCache:
    def __init__(self, root: Path, catalog_path: Path):
        self.path = root / CACHE_FILE
        self.fingerprint = fingerprint(catalog_path)
        self.started_ns = time.time_ns()
        self.entries: dict[str, dict] = {}
        self.dirty = False
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(data, dict) and data.get("fingerprint") == self.fingerprint:
            self.entries = data.get("files", {})

    def get(self, rel: str, stat: os.stat_result) -> tuple[TestFile, list[Problem]] | None:
        entry = self.entries.get(rel)
        if entry is None or entry["sig"] != _signature(stat):
            return None
        try:
            test_file = TestFile(
                rel,
                tuple(registration_from_json(r) for r in entry["registrations"]),
                tuple(gate_from_json(g) for g in entry["gates"]),
            )
            problems = [Problem(rel, line, message) for line, message in entry["problems"]]
        except (KeyError, TypeError, ValueError):
            return None
        return test_file, problems

    def put(self, rel: str, stat: os.stat_result, test_file: TestFile, problems: list[Problem]) -> None:
        if stat.st_mtime_ns >= self.started_ns - _RACY_WINDOW_NS:
            self.entries.pop(rel, None)
            return
        self.entries[rel] = {
            "sig": _signature(stat),
            "registrations": [r.to_json() for r in test_file.registrations],
            "gates": [g.to_json() for g in test_file.gates],
            "problems": [[p.line, p.message] for p in problems],
        }
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
            tmp.write_text(
                json.dumps({"fingerprint": self.fingerprint, "files": self.entries}), encoding="utf-8"
            )
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
