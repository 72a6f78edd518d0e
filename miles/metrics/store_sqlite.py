"""The embedded history store: one SQLite file in WAL mode, shared by concurrent processes.

WAL lets readers run while one writer commits; writers take the write lock up front
(BEGIN IMMEDIATE) and wait for each other instead of failing, up to the store timeout
($MILES_HISTORY_TIMEOUT, miles.metrics.store.statement_timeout), which also bounds every
transaction's statements: past it SQLite interrupts them and the operation fails.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from miles.metrics.store import DEFAULT_SQLITE_PATH, StoreError, StoreUnreachable, statement_timeout
from miles.metrics.store_sql import SqlStore

T = TypeVar("T")
_PROGRESS_OPS = 20_000  # SQLite VM steps between deadline checks (well under a millisecond)


class SqliteStore(SqlStore):
    types = {"id_pk": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL", "bool": "INTEGER", "ts": "TEXT"}

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.url = f"sqlite:///{self.path.as_posix()}"
        self.timeout = statement_timeout()
        folder = self.path.parent
        try:
            if (folder.name, self.path.name) == (DEFAULT_SQLITE_PATH.parent.name, DEFAULT_SQLITE_PATH.name):
                folder.mkdir(exist_ok=True)  # the default store's own folder, in an existing project
        except OSError as exc:
            raise StoreUnreachable(f"history store unreachable: {self.url}: {exc}") from exc
        if not folder.is_dir():  # a URL's folders are never made: a typo would become a tree
            raise StoreUnreachable(
                f"history store unreachable: {self.url}: its folder {folder} does not exist (or is not a "
                "folder); create it, or correct the URL"
            )
        self._enable_wal()
        self.migrate()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
        deadline = time.monotonic() + self.timeout
        conn.set_progress_handler(lambda: time.monotonic() > deadline, _PROGRESS_OPS)
        # text another program stored as bad UTF-8 reads back visibly damaged, never as a crash
        conn.text_factory = lambda raw: raw.decode("utf-8", "replace")
        conn.execute("PRAGMA foreign_keys = ON")
        # In WAL mode NORMAL survives a crashed process; only power loss can drop the last commit.
        conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    def _enable_wal(self) -> None:
        try:
            conn = self._connect()
            try:
                mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            finally:
                conn.close()
        except sqlite3.Error as exc:
            raise StoreUnreachable(f"history store unreachable: {self.url}: {exc}{self._hint(exc)}") from exc
        if str(mode).lower() != "wal":
            raise StoreError(
                f"history store {self.url}: SQLite refused WAL mode (got {mode!r}); put the file on a "
                "local filesystem or point MILES_HISTORY_URL at PostgreSQL"
            )

    def _transaction(self, fn: Callable[[Any], T], *, write: bool) -> T:
        try:
            conn = self._connect()
        except sqlite3.Error as exc:
            raise StoreUnreachable(f"history store unreachable: {self.url}: {exc}") from exc
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            result = fn(conn)
            conn.execute("COMMIT")
            return result
        except BaseException as exc:
            if conn.in_transaction:
                conn.set_progress_handler(None, 0)  # the rollback itself must not be interrupted
                conn.execute("ROLLBACK")
            if isinstance(exc, sqlite3.IntegrityError):
                raise StoreError(f"history store {self.url}: {exc}") from exc
            if isinstance(exc, sqlite3.DatabaseError):  # OperationalError included
                raise StoreUnreachable(
                    f"history store unreachable: {self.url}: {exc}{self._hint(exc)}"
                ) from exc
            raise
        finally:
            conn.close()

    def _hint(self, exc: BaseException) -> str:
        if "locked" not in str(exc) and "interrupted" not in str(exc):
            return ""
        return (
            f" (no answer within {self.timeout:g} s: another process holds the database; "
            "raise MILES_HISTORY_TIMEOUT to wait longer)"
        )

    def _lock_schema(self, conn: Any) -> None:
        pass  # BEGIN IMMEDIATE already holds the database's write lock

    def _table_exists(self, conn: Any, name: str) -> bool:
        row = conn.execute(
            "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
        ).fetchone()
        return row is not None

    def _insert_id(self, conn: Any, sql: str, params: Sequence) -> int:
        return int(conn.execute(sql, tuple(params)).lastrowid)

    def _ts_param(self, value: datetime) -> str:
        # Fixed-width UTC text sorts in time order.
        return value.astimezone(UTC).isoformat(timespec="microseconds")

    def _ts_value(self, value: Any) -> datetime:
        return datetime.fromisoformat(value)
