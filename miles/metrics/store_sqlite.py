"""The embedded history store: one SQLite file in WAL mode, shared by concurrent processes.

WAL lets readers run while one writer commits; writers take the write lock up front
(BEGIN IMMEDIATE) and wait up to BUSY_TIMEOUT_S for each other instead of failing.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from miles.metrics.store import StoreError, StoreUnreachable
from miles.metrics.store_sql import SqlStore

T = TypeVar("T")
BUSY_TIMEOUT_S = 60.0


class SqliteStore(SqlStore):
    types = {"id_pk": "INTEGER PRIMARY KEY AUTOINCREMENT", "real": "REAL", "bool": "INTEGER", "ts": "TEXT"}

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.url = f"sqlite:///{self.path.as_posix()}"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreUnreachable(f"history store unreachable: {self.url}: {exc}") from exc
        self._enable_wal()
        self.migrate()

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
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
            raise StoreUnreachable(f"history store unreachable: {self.url}: {exc}") from exc
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
        except sqlite3.IntegrityError as exc:
            conn.execute("ROLLBACK")
            raise StoreError(f"history store {self.url}: {exc}") from exc
        except (sqlite3.OperationalError, sqlite3.DatabaseError) as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise StoreUnreachable(f"history store unreachable: {self.url}: {exc}") from exc
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        finally:
            conn.close()

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
