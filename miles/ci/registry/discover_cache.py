"""Remember each test file's discovery result so unchanged files are not parsed again.

Entries are keyed by the file's (size, mtime_ns, inode) and the whole cache by a
fingerprint of the catalog and of discovery's own code, so an edited file, an edited
catalog or a changed rule all mean a fresh parse. As in git's index, a file modified in the
last seconds before discovery started is not cached: a second edit within the clock's
granularity could keep the same signature. The cache is an optimisation only; any problem
reading or writing it falls back to parsing.

The cache is JSON, never pickle: loading it runs no code whatever it holds. It is also
signed (HMAC-SHA256) with a key of this user's on this machine, kept outside the project
(`$XDG_CACHE_HOME/miles/discover.key`, else `~/.cache/miles/`), so a cache file that came
with a checkout (committed, copied, crafted) fails the signature and is ignored: it cannot
add, hide or change a registration. Where no key can be kept, nothing is cached.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from pathlib import Path

from miles.ci.registry.registration import GateDeclaration, Problem, Registration, TestFile
from miles.files import FileRefused, read_regular, replace_file

CACHE_FILE = Path(".miles") / "cache" / "discover.json"
CACHE_FORMAT = 5  # bump when the shape of an entry changes
KEY_ENV = "XDG_CACHE_HOME"
MAX_CACHE_BYTES = 256 << 20
_RACY_WINDOW_NS = 2_000_000_000
_PACKAGE = Path(__file__).resolve().parents[2]
# The code whose behaviour decides a file's records and problems.
_CODE = (
    "ci/registry/discover.py",
    "ci/registry/rules.py",
    "ci/registry/reasons.py",
    "ci/registry/catalog.py",
    "ci/registry/registration.py",
    "ci/registry/discover_cache.py",
    "ci/register.py",
    "metrics/spec.py",
    "text.py",
)


def fingerprint(catalog_path: Path) -> str:
    digest = hashlib.sha256(str(CACHE_FORMAT).encode())
    for path in (catalog_path, *(_PACKAGE / name for name in _CODE)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def key_path() -> Path:
    base = os.environ.get(KEY_ENV, "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "miles" / "discover.key"


def signing_key() -> bytes | None:
    """This user's secret for signing caches (made on first use, mode 0600), or None when
    it can be neither read nor made (then nothing is cached)."""
    path = key_path()
    for _ in range(2):
        try:
            key = read_regular(path, 256, follow=False, what="discovery cache key").strip()
            return key if len(key) >= 32 else None
        except FileNotFoundError:
            pass
        except (OSError, FileRefused):
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue  # another process made it first: read theirs
        except OSError:
            return None
        with os.fdopen(fd, "wb") as fh:
            fh.write(secrets.token_hex(32).encode())
    return None


def _sign(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).hexdigest().encode()


class DiscoveryCache:
    def __init__(self, root: Path, catalog_path: Path):
        self.path = root / CACHE_FILE
        self.fingerprint = fingerprint(catalog_path)
        self.started_ns = time.time_ns()
        self.entries: dict[str, tuple[tuple[int, int, int], TestFile, list[Problem]]] = {}
        self.dirty = False
        self.key = signing_key()
        if self.key is None:
            return
        try:
            raw = read_regular(self.path, MAX_CACHE_BYTES, follow=False, what="discovery cache")
            signature, _, payload = raw.partition(b"\n")
            if not hmac.compare_digest(signature, _sign(self.key, payload)):
                return  # not written by this user on this machine: ignored, then rewritten
            data = json.loads(payload)
            if data.get("fingerprint") == self.fingerprint and data.get("format") == CACHE_FORMAT:
                self.entries = {rel: _decode(entry) for rel, entry in data["files"].items()}
        except Exception:  # absent, torn, another version: parse instead
            self.entries = {}

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
        if not self.dirty or self.key is None:
            return
        data = {
            "format": CACHE_FORMAT,
            "fingerprint": self.fingerprint,
            "files": {rel: _encode(entry) for rel, entry in self.entries.items()},
        }
        payload = json.dumps(data, separators=(",", ":")).encode("ascii")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            replace_file(self.path, _sign(self.key, payload) + b"\n" + payload)
        except OSError:
            pass


def _encode(entry) -> list:
    signature, test_file, problems = entry
    return [
        list(signature),
        test_file.path,
        [
            [
                r.backend,
                r.file,
                r.line,
                r.est_time,
                r.suite,
                list(r.labels),
                r.nightly,
                r.disabled,
                r.implicit,
            ]
            for r in test_file.registrations
        ],
        [
            [
                g.file,
                g.line,
                g.metric_key,
                g.steps if isinstance(g.steps, str) else list(g.steps),
                [list(c) for c in g.constraint],
                g.enforce,
            ]
            for g in test_file.gates
        ],  # fmt: skip
        [[p.file, p.line, p.message, list(p.backends), p.suite, p.refused] for p in problems],
    ]


def _decode(entry: list) -> tuple[tuple[int, int, int], TestFile, list[Problem]]:
    signature, path, regs, gates, problems = entry
    test_file = TestFile(
        path,
        tuple(Registration(b, f, ln, e, s, tuple(lab), n, d, i) for b, f, ln, e, s, lab, n, d, i in regs),
        tuple(
            GateDeclaration(
                f, ln, m, st if isinstance(st, str) else tuple(st), tuple(tuple(c) for c in cs), en
            )
            for f, ln, m, st, cs, en in gates
        ),
    )
    found = [Problem(f, ln, m, tuple(bs), s, r) for f, ln, m, bs, s, r in problems]
    return (signature[0], signature[1], signature[2]), test_file, found
