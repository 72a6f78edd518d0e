"""The SQL both history stores share: schema, migrations and every query of the contract.

Queries are written once with `?` placeholders and the types as `{id_pk}`, `{real}`,
`{bool}`, `{ts}`; a dialect subclass supplies the connection, the placeholder style, the
types and timestamp conversion.
"""

from __future__ import annotations

import math
import re
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

from miles.metrics.capture import NON_FINITE, decode_value, encode_value
from miles.metrics.spec import Coordinate
from miles.metrics.store import (
    DurationRecord,
    HistoryStore,
    MetricValue,
    RunEntry,
    StoredRun,
    StoreError,
    check_commit_prefix,
    finite_or_none,
    now,
)
from miles.text import printable

T = TypeVar("T")
SCHEMA_VERSION = 1
_CHUNK = 500  # ids per IN (...) list; well under SQLite's parameter limit

# (version, statements). Append a new entry to change the schema; never edit a shipped one.
MIGRATIONS: tuple[tuple[int, tuple[str, ...]], ...] = (
    (
        1,
        (
            """CREATE TABLE runs (
                id {id_pk},
                uid TEXT NOT NULL UNIQUE,
                test TEXT NOT NULL,
                backend TEXT NOT NULL,
                suite TEXT NOT NULL,
                lane TEXT NOT NULL,
                cadence TEXT NOT NULL,
                commit_sha TEXT,
                pr TEXT,
                ci_run_id TEXT,
                created_at {ts} NOT NULL,
                trusted {bool} NOT NULL,
                untrusted_reason TEXT
            )""",
            "CREATE INDEX runs_by_test ON runs (test, backend, suite, created_at)",
            "CREATE INDEX runs_by_commit ON runs (commit_sha)",
            """CREATE TABLE metric_values (
                run_id BIGINT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
                metric TEXT NOT NULL,
                steps_key TEXT NOT NULL,
                constraint_key TEXT NOT NULL,
                step INTEGER NOT NULL,
                value {real},
                nonfinite TEXT,
                verdict TEXT,
                ref {real},
                low {real},
                high {real},
                PRIMARY KEY (run_id, metric, steps_key, constraint_key, step)
            )""",
            """CREATE TABLE durations (
                id {id_pk},
                file TEXT NOT NULL,
                backend TEXT NOT NULL,
                suite TEXT NOT NULL,
                lane TEXT NOT NULL,
                status TEXT NOT NULL,
                elapsed_s {real} NOT NULL,
                est_time {real},
                commit_sha TEXT,
                created_at {ts} NOT NULL
            )""",
            "CREATE INDEX durations_by_file ON durations (backend, suite, file, created_at)",
        ),
    ),
)

_RUN_COLUMNS = "id, uid, test, backend, suite, lane, cadence, commit_sha, pr, ci_run_id, created_at, trusted, untrusted_reason"
_VALUE_COLUMNS = "run_id, metric, steps_key, constraint_key, step, value, nonfinite, verdict, ref, low, high"


class SqlStore(HistoryStore):
    """Every contract operation, each one a single transaction on a fresh connection."""

    types: dict[str, str]

    # -- what a dialect provides --------------------------------------------------------
    @abstractmethod
    def _transaction(self, fn: Callable[[Any], T], *, write: bool) -> T:
        """Open a connection, run fn(conn) in one transaction, commit, close."""

    @abstractmethod
    def _lock_schema(self, conn: Any) -> None:
        """Serialise schema creation between processes (inside the migration transaction)."""

    @abstractmethod
    def _insert_id(self, conn: Any, sql: str, params: Sequence) -> int: ...

    @abstractmethod
    def _table_exists(self, conn: Any, name: str) -> bool: ...

    def _sql(self, sql: str) -> str:
        return sql

    def _ts_param(self, value: datetime) -> Any:
        return value

    def _ts_value(self, value: Any) -> datetime:
        return value.astimezone(UTC)

    # -- plumbing -----------------------------------------------------------------------
    def _exec(self, conn: Any, sql: str, params: Sequence = ()) -> Any:
        return conn.execute(self._sql(sql), tuple(params))

    def _executemany(self, conn: Any, sql: str, rows: list[tuple]) -> None:
        if rows:
            conn.cursor().executemany(self._sql(sql), rows)

    def migrate(self) -> int:
        """Create or upgrade the schema; returns the version now in place. A store already at
        this version is only read, so a read-only role (history show) can open it."""

        def current(conn: Any) -> int:
            return self._read_version(conn) if self._table_exists(conn, "miles_meta") else 0

        version = self._transaction(current, write=False)
        if version == SCHEMA_VERSION:
            return version
        self._check_not_newer(version)

        def run(conn: Any) -> int:
            self._lock_schema(conn)
            self._exec(
                conn, "CREATE TABLE IF NOT EXISTS miles_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
            )
            version = self._read_version(conn)
            self._check_not_newer(version)
            for target, statements in MIGRATIONS:
                if target > version:
                    for statement in statements:
                        self._exec(conn, statement.format(**self.types))
                    version = target
            self._exec(conn, "DELETE FROM miles_meta WHERE key = 'schema_version'")
            self._exec(
                conn, "INSERT INTO miles_meta (key, value) VALUES ('schema_version', ?)", (str(version),)
            )
            return version

        return self._transaction(run, write=True)

    def _check_not_newer(self, version: int) -> None:
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"history store {self.url} has schema version {version}, newer than this miles "
                f"understands ({SCHEMA_VERSION}); upgrade miles before writing to it"
            )

    def _read_version(self, conn: Any) -> int:
        row = self._exec(conn, "SELECT value FROM miles_meta WHERE key = 'schema_version'").fetchone()
        if not row:
            return 0
        try:
            return int(str(row[0]).strip())
        except ValueError:
            raise StoreError(
                f"history store {self.url}: miles_meta.schema_version is {str(row[0])[:40]!r}, not a number; "
                "the table was written by something other than miles or edited by hand"
            ) from None

    def schema_version(self) -> int:
        return self._transaction(self._read_version, write=False)

    # -- runs and values ----------------------------------------------------------------
    def add_run(self, run: RunEntry, values: Sequence[MetricValue] = ()) -> int:
        created = self._ts_param(run.created_at or now())

        def write(conn: Any) -> int:
            row = self._exec(conn, "SELECT id FROM runs WHERE uid = ?", (run.uid,)).fetchone()
            if row:  # a retried write whose first try had landed
                return int(row[0])
            run_id = self._insert_id(
                conn,
                "INSERT INTO runs (uid, test, backend, suite, lane, cadence, commit_sha, pr, ci_run_id,"
                " created_at, trusted) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (run.uid, run.test, run.backend, run.suite, run.lane, run.cadence, run.commit, run.pr,
                 run.ci_run_id, created, bool(run.trusted)),
            )  # fmt: skip
            rows = [_value_row(run_id, v) for v in values]
            self._executemany(
                conn, f"INSERT INTO metric_values ({_VALUE_COLUMNS}) VALUES ({_marks(11)})", rows
            )
            return run_id

        return self._transaction(write, write=True)

    def baselines(
        self, test: str, backend: str, suite: str, coordinates: Iterable[Coordinate], k: int
    ) -> dict[Coordinate, list[float]]:
        wanted = set(coordinates)
        if not wanted:
            return {}
        metrics = sorted({c.metric for c in wanted})
        sql = f"""
            SELECT metric, steps_key, constraint_key, step, value FROM (
                SELECT v.metric, v.steps_key, v.constraint_key, v.step, v.value,
                       ROW_NUMBER() OVER (
                           PARTITION BY v.metric, v.steps_key, v.constraint_key, v.step
                           ORDER BY r.created_at DESC, r.id DESC) AS rn
                FROM metric_values v JOIN runs r ON r.id = v.run_id
                WHERE r.test = ? AND r.backend = ? AND r.suite = ? AND r.trusted = ?
                  AND v.value IS NOT NULL AND v.metric IN ({_marks(len(metrics))})
            ) ranked
            WHERE rn <= ?
            ORDER BY metric, steps_key, constraint_key, step, rn"""

        def read(conn: Any) -> list:
            return self._exec(conn, sql, (test, backend, suite, True, *metrics, k)).fetchall()

        found: dict[Coordinate, list[float]] = {c: [] for c in wanted}
        for metric, steps_key, constraint_key, step, value in self._transaction(read, write=False):
            row = _Row(self.url, "metric_values", f"metric {str(metric)[:60]!r} step {str(step)[:20]}")
            coordinate = Coordinate(
                row.text("metric", metric), row.text("steps_key", steps_key),
                row.text("constraint_key", constraint_key), row.integer("step", step),
            )  # fmt: skip
            if coordinate in found:
                found[coordinate].append(row.number("value", value))
        return found

    def runs(
        self,
        *,
        test: str | None = None,
        backend: str | None = None,
        suite: str | None = None,
        limit: int | None = None,
    ) -> list[StoredRun]:
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            # SQLite reads LIMIT -1 as "no limit", PostgreSQL refuses it: neither is taken
            raise StoreError(f"limit {limit} must be at least 1 (or None for every run)")
        where, params = _filters(test=test, backend=backend, suite=suite)
        sql = f"SELECT {_RUN_COLUMNS} FROM runs{where} ORDER BY created_at DESC, id DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params.append(int(limit))
        rows = self._transaction(lambda conn: self._exec(conn, sql, params).fetchall(), write=False)
        return [self._stored_run(row) for row in rows]

    def _stored_run(self, values: Sequence) -> StoredRun:
        (id_, uid, test, backend, suite, lane, cadence, commit, pr, ci_run_id, created, trusted, reason) = (
            values
        )
        row = _Row(self.url, "runs", f"id {str(id_)[:20]}")
        return StoredRun(
            row.integer("id", id_), row.text("uid", uid), row.text("test", test), row.text("backend", backend),
            row.text("suite", suite), row.text("lane", lane), row.text("cadence", cadence),
            row.text("commit_sha", commit, null=True), row.text("pr", pr, null=True),
            row.text("ci_run_id", ci_run_id, null=True), row.timestamp("created_at", created, self._ts_value),
            row.flag("trusted", trusted), row.text("untrusted_reason", reason, null=True),
        )  # fmt: skip

    def values(self, run_ids: Iterable[int], metric: str | None = None) -> dict[int, list[MetricValue]]:
        ids = sorted({int(i) for i in run_ids})
        out: dict[int, list[MetricValue]] = {i: [] for i in ids}

        def read(conn: Any) -> list:
            rows = []
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start : start + _CHUNK]
                sql = f"SELECT {_VALUE_COLUMNS} FROM metric_values WHERE run_id IN ({_marks(len(chunk))})"
                params: list = list(chunk)
                if metric is not None:
                    sql += " AND metric = ?"
                    params.append(metric)
                sql += " ORDER BY run_id, metric, steps_key, constraint_key, step"
                rows.extend(self._exec(conn, sql, params).fetchall())
            return rows

        for run_id, metric_, steps_key, constraint_key, step, value, nonfinite, verdict, ref, low, high in (
            self._transaction(read, write=False) if ids else []
        ):
            row = _Row(self.url, "metric_values", f"run_id {str(run_id)[:20]} metric {str(metric_)[:60]!r}")
            if value is not None:
                number = row.number("value", value)
            elif nonfinite is None or nonfinite in NON_FINITE:
                number = decode_value(nonfinite or "NaN")
            else:
                raise row.refuse("nonfinite", nonfinite, f"one of {', '.join(NON_FINITE)} or NULL")
            coordinate = Coordinate(
                row.text("metric", metric_), row.text("steps_key", steps_key),
                row.text("constraint_key", constraint_key), row.integer("step", step),
            )  # fmt: skip
            out.setdefault(row.integer("run_id", run_id), []).append(
                MetricValue(
                    coordinate, number, row.text("verdict", verdict, null=True), row.number("ref", ref, null=True),
                    row.number("low", low, null=True), row.number("high", high, null=True),
                )
            )  # fmt: skip
        return out

    def mark_untrusted(self, *, run_id: int | None = None, commit: str | None = None, reason: str) -> int:
        if (run_id is None) == (commit is None):
            raise StoreError("mark_untrusted needs exactly one of run_id or commit")
        if run_id is not None:
            where, params = "id = ?", [int(run_id)]
        else:
            where, params = "LOWER(commit_sha) LIKE ?", [check_commit_prefix(commit) + "%"]
        sql = f"UPDATE runs SET trusted = ?, untrusted_reason = ? WHERE {where}"
        return self._transaction(
            lambda conn: self._exec(conn, sql, [False, reason, *params]).rowcount, write=True
        )

    # -- durations ----------------------------------------------------------------------
    def add_durations(self, records: Sequence[DurationRecord]) -> None:
        rows = [
            (r.file, r.backend, r.suite, r.lane, r.status, float(r.elapsed_s), r.est_time, r.commit,
             self._ts_param(r.created_at or now()))
            for r in records
        ]  # fmt: skip
        sql = (
            "INSERT INTO durations (file, backend, suite, lane, status, elapsed_s, est_time, commit_sha,"
            f" created_at) VALUES ({_marks(9)})"
        )
        self._transaction(lambda conn: self._executemany(conn, sql, rows), write=True)

    def durations(
        self, backend: str, suite: str | None = None, *, per_file: int = 20
    ) -> list[DurationRecord]:
        where, params = _filters(backend=backend, suite=suite)
        sql = f"""
            SELECT file, backend, suite, lane, status, elapsed_s, est_time, commit_sha, created_at FROM (
                SELECT d.*, ROW_NUMBER() OVER (
                    PARTITION BY suite, file ORDER BY created_at DESC, id DESC) AS rn
                FROM durations d{where}
            ) ranked WHERE rn <= ? ORDER BY file, suite, created_at DESC, rn"""
        rows = self._transaction(
            lambda conn: self._exec(conn, sql, [*params, per_file]).fetchall(), write=False
        )
        out = []
        for file, backend_, suite_, lane, status, elapsed, est, commit, at in rows:
            row = _Row(self.url, "durations", f"file {str(file)[:80]!r}")
            out.append(
                DurationRecord(
                    row.text("file", file), row.text("backend", backend_), row.text("suite", suite_),
                    row.number("elapsed_s", elapsed), row.text("status", status), row.text("lane", lane),
                    row.number("est_time", est, null=True), row.text("commit_sha", commit, null=True),
                    row.timestamp("created_at", at, self._ts_value),
                )
            )  # fmt: skip
        return out


class _Row:
    """Reads one stored row's columns, refusing a value miles never writes (a row another
    program wrote, or one edited by hand) with one line naming table, row and column."""

    def __init__(self, url: str, table: str, which: str):
        self.url, self.table, self.which = url, table, which

    def refuse(self, column: str, value: object, expected: str) -> StoreError:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return StoreError(
            f"history store {self.url}: {self.table} row ({printable(self.which)}) has {column} = "
            f"{printable(shown)}, not {expected}; miles did not write that row: delete or repair it"
        )

    def text(self, column: str, value: object, *, null: bool = False) -> str | None:
        if value is None and null:
            return None
        if not isinstance(value, str) or _SURROGATE.search(value):
            raise self.refuse(column, value, "text" + (" or NULL" if null else ""))
        return value

    def integer(self, column: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.refuse(column, value, "an integer")
        return value

    def number(self, column: str, value: object, *, null: bool = False) -> float | None:
        if value is None and null:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.refuse(column, value, "a number" + (" or NULL" if null else ""))
        return float(value)

    def flag(self, column: str, value: object) -> bool:
        if value in (0, 1) and isinstance(value, int):  # bool is an int: True/False pass too
            return bool(value)
        raise self.refuse(column, value, "true or false")

    def timestamp(self, column: str, value: object, convert: Callable[[Any], datetime]) -> datetime:
        try:
            stamp = convert(value)
        except (TypeError, ValueError, AttributeError, OverflowError):
            raise self.refuse(column, value, "a timestamp") from None
        if not isinstance(stamp, datetime) or stamp.tzinfo is None:
            raise self.refuse(column, value, "a timestamp with its time zone")
        return stamp


_SURROGATE = re.compile("[\ud800-\udfff]")


def _marks(n: int) -> str:
    return ", ".join("?" * n)


def _filters(**columns: str | None) -> tuple[str, list]:
    given = [(name, value) for name, value in columns.items() if value is not None]
    if not given:
        return "", []
    return " WHERE " + " AND ".join(f"{name} = ?" for name, _ in given), [value for _, value in given]


def _value_row(run_id: int, v: MetricValue) -> tuple:
    c = v.coordinate
    nonfinite = None if math.isfinite(v.value) else encode_value(v.value)
    return (
        run_id, c.metric, c.steps_key, c.constraint_key, c.step, finite_or_none(v.value), nonfinite, v.verdict,
        finite_or_none(v.ref), finite_or_none(v.low), finite_or_none(v.high),
    )  # fmt: skip
