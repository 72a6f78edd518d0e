"""The history store: runs, their metric values per coordinate, and test durations.

One contract (`HistoryStore`), two implementations with the same schema and the same
tests: an embedded SQLite file (the default, `.miles/history.sqlite`, WAL, safe with several
writer processes) and PostgreSQL (psycopg 3) when `MILES_HISTORY_URL` names one. Each
operation opens its own connection and runs in one transaction, so a writer that dies
leaves either its whole run or nothing. The schema carries a version and is created or
migrated when a store is opened. URLs shown anywhere have their password masked.
"""

from __future__ import annotations

import math
import os
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import unquote, urlsplit

from miles.metrics.spec import Coordinate

HISTORY_URL_ENV = "MILES_HISTORY_URL"
TIMEOUT_ENV = "MILES_HISTORY_TIMEOUT"  # seconds any one store statement (or lock wait) may take
DEFAULT_TIMEOUT_S = 60.0
MAX_TIMEOUT_S = 3600.0
DEFAULT_SQLITE_PATH = Path(".miles") / "history.sqlite"
BASELINE_CADENCES = ("nightly", "weekly")
_COMMIT_PREFIX = re.compile(r"[0-9a-fA-F]{7,64}")
_QUERY_PASSWORD = re.compile(r"((?:^|[?&])password=)([^&#]*)")


class StoreError(RuntimeError):
    """The store refused an operation (bad schema version, bad argument)."""


class BadSetting(StoreError):
    """A store setting in the environment that is not a value the store can use; bad input."""


class StoreUnreachable(StoreError):
    """The store could not be reached or did not answer; the message masks credentials."""


@dataclass(frozen=True)
class RunEntry:
    """A run as its writer knows it; `uid` makes a retried write land once."""

    test: str
    backend: str
    suite: str
    lane: str
    cadence: str
    trusted: bool
    commit: str | None = None
    pr: str | None = None
    ci_run_id: str | None = None
    created_at: datetime | None = None
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class StoredRun:
    id: int
    uid: str
    test: str
    backend: str
    suite: str
    lane: str
    cadence: str
    commit: str | None
    pr: str | None
    ci_run_id: str | None
    created_at: datetime
    trusted: bool
    untrusted_reason: str | None


@dataclass(frozen=True)
class MetricValue:
    """One value at one coordinate, with the verdict and band it got when it was gated."""

    coordinate: Coordinate
    value: float
    verdict: str | None = None
    ref: float | None = None
    low: float | None = None
    high: float | None = None


@dataclass(frozen=True)
class DurationRecord:
    """How long one test file took in one attempt, for est_time calibration."""

    file: str
    backend: str
    suite: str
    elapsed_s: float
    status: str
    lane: str = ""
    est_time: float | None = None
    commit: str | None = None
    created_at: datetime | None = None


class HistoryStore(ABC):
    """The contract both stores implement (see tests/unit/test_metrics_store_contract.py)."""

    url: str  # masked, safe to print

    @abstractmethod
    def schema_version(self) -> int: ...

    @abstractmethod
    def add_run(self, run: RunEntry, values: Sequence[MetricValue] = ()) -> int:
        """Write a run and its values in one transaction; returns the run id."""

    @abstractmethod
    def baselines(
        self, test: str, backend: str, suite: str, coordinates: Iterable[Coordinate], k: int
    ) -> dict[Coordinate, list[float]]:
        """The last `k` finite values of trusted runs per coordinate, newest first."""

    @abstractmethod
    def runs(
        self,
        *,
        test: str | None = None,
        backend: str | None = None,
        suite: str | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        """Runs newest first."""

    @abstractmethod
    def values(self, run_ids: Iterable[int], metric: str | None = None) -> dict[int, list[MetricValue]]:
        """Stored values of the given runs, by run id, ordered by coordinate."""

    @abstractmethod
    def mark_untrusted(self, *, run_id: int | None = None, commit: str | None = None, reason: str) -> int:
        """Mark one run, or every run of a commit (a prefix of 7+ hex digits), untrusted."""

    @abstractmethod
    def add_durations(self, records: Sequence[DurationRecord]) -> None: ...

    @abstractmethod
    def durations(
        self, backend: str, suite: str | None = None, *, per_file: int = 20
    ) -> list[DurationRecord]:
        """The newest `per_file` durations of each file on `backend` (and `suite`), newest first."""


def writes_baseline(cadence: str) -> bool:
    """Whether runs of this cadence extend baselines. Whether a given run may store history at
    all (only runs of the main line, never a PR) is the CI policy's call (`stores_history`)."""
    return cadence in BASELINE_CADENCES


# libpq connection keywords: a string made of `keyword=value` pairs is a keyword DSN
# ("host=db password=..."), which miles does not take (see check_store_url).
_DSN_KEYWORDS = (
    "host|hostaddr|port|dbname|user|password|passfile|sslmode|sslpassword|options|service|"
    "connect_timeout|application_name|target_session_attrs|require_auth|channel_binding"
)
_DSN = re.compile(rf"^\s*(?:{_DSN_KEYWORDS})\s*=|\s(?:{_DSN_KEYWORDS})\s*=")
_DSN_PASSWORD = re.compile(r"(\bpassword\s*=\s*)('(?:[^'\\]|\\.)*'?|\S*)")
_BAD_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_POSTGRES_SCHEMES = ("postgresql", "postgres")
URL_FORMS = (
    "postgresql://user:password@host:port/db (password percent-encoded), sqlite:///path, or a file path"
)


def is_keyword_dsn(text: str) -> bool:
    """Whether `text` is a libpq keyword DSN ("host=... password=...") rather than a URL or a path."""
    return "://" not in text and bool(_DSN.search(text))


def mask_url(url: str) -> str:
    """The URL (or keyword DSN) with its password replaced by ***; safe to print.

    Works on malformed text too: everything between the user name and the last '@' of the
    authority is the password as far as masking goes, so a password holding an unencoded
    '@', '/', '?' or '#' is still hidden (at worst with part of the host)."""
    text = _CONTROL.sub("?", url)
    if is_keyword_dsn(text):
        return _DSN_PASSWORD.sub(r"\1***", text)
    head, sep, rest = text.partition("://")
    if not sep:
        return text
    at = rest.rfind("@")
    if at >= 0:
        user, colon, _ = rest[:at].partition(":")
        if colon:
            rest = f"{user}:***{rest[at:]}"
    return head + sep + _QUERY_PASSWORD.sub(r"\1***", rest)


def check_store_url(url: str, *, name: str = "store URL") -> str:
    """`url` if miles can hand it to a driver as it is; otherwise StoreError with one line
    that names the problem and shows the URL masked. Catches what drivers would misread
    into a host name, a DNS query or a file named after the password."""
    shown = mask_url(url)

    def refuse(problem: str) -> StoreError:
        return StoreError(f"{name} {shown!r}: {problem}; write {URL_FORMS}")

    if is_keyword_dsn(url):
        raise refuse("a libpq keyword DSN (host=... password=...) is not accepted")
    if _CONTROL.search(url):
        raise refuse("it contains a control character (a newline?)")
    scheme, sep, rest = url.partition("://")
    if sep and scheme.lower() not in (*_POSTGRES_SCHEMES, "sqlite"):
        raise refuse(f"unknown scheme '{scheme}'")
    if not sep or scheme.lower() not in _POSTGRES_SCHEMES:
        return url
    authority_end = len(rest)
    at = rest.rfind("@")
    # the authority ends at the first '/', '?' or '#' after the user info
    for mark in "/?#":
        found = rest.find(mark, at + 1)
        if found >= 0:
            authority_end = min(authority_end, found)
    userinfo = rest[:at] if at >= 0 else ""
    if " " in url:
        raise refuse("it contains a space; percent-encode it as %20")
    if userinfo.count("@"):
        raise refuse("the password contains an unencoded '@'; percent-encode it as %40")
    for char, code in (("/", "%2F"), ("?", "%3F"), ("#", "%23")):
        if at >= 0 and char in userinfo:
            raise refuse(f"the password contains an unencoded '{char}'; percent-encode it as {code}")
    if _BAD_PERCENT.search(url):
        raise refuse("it has a '%' that does not start a %XX escape; percent-encode '%' as %25")
    try:
        _ = urlsplit(f"{scheme}://{rest[:authority_end]}").port  # raises for a bad port
    except ValueError:
        raise refuse("the port is not a number from 1 to 65535") from None
    return url


def scrub(text: str, url: str) -> str:
    """Remove the URL's password from text that a driver produced (errors can echo DSNs)."""
    for secret in _passwords(url):
        text = text.replace(secret, "***")
    return text


def _passwords(url: str) -> list[str]:
    found: set[str] = set()
    head, sep, rest = url.partition("://")
    if sep:
        at = rest.rfind("@")
        user, colon, password = rest[:at].partition(":") if at >= 0 else ("", "", "")
        if colon and password:
            found |= {password, unquote(password)}
        for match in _QUERY_PASSWORD.finditer(rest):
            if match.group(2):  # a driver may echo the value as written or decoded
                found |= {match.group(2), unquote(match.group(2))}
    for match in _DSN_PASSWORD.finditer(url):
        value = match.group(2).strip("'")
        if value:
            found.add(value)
    return sorted((f for f in found if len(f) >= 3), key=len, reverse=True)


def resolve_url(url: str | None = None, *, root: Path | str = ".") -> str:
    """The store URL in effect: the argument, else $MILES_HISTORY_URL, else the SQLite default."""
    url = url or os.environ.get(HISTORY_URL_ENV, "").strip()
    if url:
        return url
    return f"sqlite:///{(Path(root) / DEFAULT_SQLITE_PATH).as_posix()}"


def open_store(url: str | None = None, *, root: Path | str = ".") -> HistoryStore:
    """Open (creating or migrating the schema) the store named by `url` or the environment;
    a malformed URL is a StoreError naming the problem, with the password masked."""
    url = check_store_url(resolve_url(url, root=root))
    scheme = url.split(":", 1)[0].lower() if "://" in url else ""
    if scheme in ("postgresql", "postgres"):
        from miles.metrics.store_postgres import PostgresStore

        return PostgresStore(url)
    if scheme in ("sqlite", ""):
        from miles.metrics.store_sqlite import SqliteStore

        path = url[len("sqlite:///") :] if scheme else url
        if scheme and not url.startswith("sqlite:///"):
            raise StoreError(
                f"store URL {mask_url(url)!r}: write sqlite:///relative/path or sqlite:////absolute/path"
            )
        return SqliteStore(Path(path))
    raise StoreError(f"store URL {mask_url(url)!r}: unknown scheme '{scheme}'; use {URL_FORMS}")


def statement_timeout() -> float:
    """Seconds one store statement may run or wait for a lock: $MILES_HISTORY_TIMEOUT, else 60.
    Every query of both stores is held to it, so a locked table fails a command, never hangs it."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise BadSetting(
            f"{TIMEOUT_ENV}={text[:40]!r} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:g}"
        )
    return value


def now() -> datetime:
    return datetime.now(UTC)


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def check_commit_prefix(commit: str) -> str:
    if not _COMMIT_PREFIX.fullmatch(commit):
        raise StoreError(f"commit {commit!r} is not a commit id; give at least 7 hex digits of it")
    return commit.lower()
