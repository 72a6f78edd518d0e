"""How long each test file took, per backend and suite: the input of `calibrate`.

Rows live in the metric history store (miles.metrics.store): the SQLite file
`.miles/history.sqlite` under the project root by default, PostgreSQL when
`$MILES_HISTORY_URL` names one, or a SQLite file at `$MILES_DURATIONS_PATH`. The two public
functions are the contract. Every write is one transaction, so runners finishing at once
lose nothing; a store that cannot be reached raises OSError, which the runner reports as a
warning without failing the run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path

from miles.ci.reports.record import FAILED, FLAKY, PASSED, TIMEOUT, Attempt

PATH_ENV = "MILES_DURATIONS_PATH"
KEEP_PER_KEY = 50  # newest rows read per (backend, suite, file)


def durations_path(root: Path | str = ".") -> Path | str:
    """Where durations go: $MILES_DURATIONS_PATH (a SQLite file), else the history store of
    `root`. A URL in MILES_DURATIONS_PATH is a StoreError: it would become directories named
    after its password; a PostgreSQL store belongs in MILES_HISTORY_URL."""
    from miles.metrics.store import StoreError, check_store_url, is_keyword_dsn, mask_url, resolve_url

    env = os.environ.get(PATH_ENV, "").strip()
    if not env:
        return check_store_url(resolve_url(None, root=root), name="MILES_HISTORY_URL")
    if env.startswith("sqlite:///"):
        return env
    if "://" in env or is_keyword_dsn(env):
        raise StoreError(
            f"{PATH_ENV} names a SQLite file, but {mask_url(env)!r} is a store URL; "
            f"put it in MILES_HISTORY_URL and unset {PATH_ENV}"
        )
    return Path(check_store_url(env, name=PATH_ENV))


def check_store_settings(root: Path | str = ".") -> None:
    """Raise StoreError (one line, password masked) when MILES_HISTORY_URL or
    MILES_DURATIONS_PATH cannot name a store, before anything runs."""
    from miles.metrics.store import HISTORY_URL_ENV, check_store_url, statement_timeout

    url = os.environ.get(HISTORY_URL_ENV, "").strip()
    if url:
        check_store_url(url, name=HISTORY_URL_ENV)
    durations_path(root)
    statement_timeout()


def _ran_to_an_end(a: Attempt) -> bool:
    """Only attempts whose elapsed time says something about the test: it ran and ended by
    itself (passed or failed) or hit its timeout. Cancelled, never-started and missing-file
    attempts are left out."""
    if a.status == TIMEOUT:
        return True
    return a.status in (PASSED, FLAKY, FAILED) and (a.exit_code is not None or a.signal is not None)


def record_durations(attempts: Iterable[Attempt], path: Path | str | None = None) -> int:
    """Store the elapsed time of every attempt that ran; returns how many rows were added."""
    from miles.metrics.store import DurationRecord

    rows = [
        DurationRecord(
            file=a.file,
            backend=a.backend,
            suite=a.suite,
            elapsed_s=round(a.elapsed, 3),
            status=a.status,
            lane=a.lane,
            est_time=a.est_time,
            commit=a.commit or None,
            created_at=datetime.fromtimestamp(a.started_at, UTC),
        )
        for a in attempts
        if _ran_to_an_end(a)
    ]
    if rows:
        _call(path, lambda store: store.add_durations(rows))
    return len(rows)


def load_durations(
    backend: str, suite: str | None = None, path: Path | str | None = None
) -> dict[str, list[tuple[float, bool]]]:
    """file -> [(elapsed seconds, passed)], oldest first, for one backend (and suite)."""
    records = _call(path, lambda store: store.durations(backend, suite, per_file=KEEP_PER_KEY))
    out: dict[str, list[tuple[float, bool]]] = {}
    # The store answers newest first; reversed and stably sorted, equal times keep write order.
    for r in sorted(reversed(records), key=lambda r: r.created_at):
        out.setdefault(r.file, []).append((r.elapsed_s, r.status in (PASSED, FLAKY)))
    return out


def _call(path: Path | str | None, action):
    from miles.metrics.store import StoreError, StoreUnreachable, open_store

    target = path if path is not None else durations_path()
    try:
        return action(open_store(str(target)))
    except StoreUnreachable as exc:
        raise OSError(str(exc)) from None
    except StoreError as exc:
        raise ValueError(str(exc)) from None
