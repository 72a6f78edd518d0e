"""Store URLs as people mistype them: the password is never printed, never sent to DNS, never
turned into a file name; every driver error becomes one masked line.

The PostgreSQL cases run against the real server of the store contract
(MILES_TEST_POSTGRES_URL, set by .ci/run); the read-only role is MILES_TEST_POSTGRES_READER_URL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.metrics.store import StoreError, check_store_url, mask_url, open_store

register_cpu_ci(est_time=2, suite="stage-a-cpu")

SECRET = "s3cr3t-Pw"
HOST = "127.0.0.1:5432"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_DURATIONS_PATH", "MILES_HISTORY_URL"):
        monkeypatch.delenv(key, raising=False)


BAD_URLS = [
    # (url, what the one line must say)
    (f"postgresql://miles:{SECRET}%zz@{HOST}/db", "'%' that does not start a %XX escape"),
    (f"postgresql://miles:{SECRET} x@{HOST}/db", "a space"),
    (f"postgresql://miles:{SECRET}@x@{HOST}/db", "an unencoded '@'"),
    (f"postgresql://miles:{SECRET}/x@{HOST}/db", "an unencoded '/'"),
    (f"postgresql://miles:{SECRET}@{HOST}:99999999/db", "port"),
    (f"postgresql://miles:{SECRET}\n@{HOST}/db", "a control character"),
    (f"host=127.0.0.1 user=miles password={SECRET} dbname=db", "libpq keyword DSN"),
    (f"dbname=db password='{SECRET} x'", "libpq keyword DSN"),
]


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_a_malformed_store_url_is_refused_in_one_masked_line(url, why, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreError) as info:
        open_store(url)
    message = str(info.value)
    assert why in message and "\n" not in message
    assert SECRET not in message and "3cr3t" not in message
    assert list(tmp_path.iterdir()) == []  # no SQLite file or directory named after the password


@pytest.mark.parametrize(("url", "why"), BAD_URLS)
def test_mask_url_hides_the_password_of_a_malformed_url(url, why):
    shown = mask_url(url)
    assert SECRET not in shown and "3cr3t" not in shown and "\n" not in shown


def test_a_well_formed_url_passes_the_check_unchanged():
    url = f"postgresql://miles:{SECRET.replace('-', '%2D')}@{HOST}/db?sslmode=require"
    assert check_store_url(url) == url
    assert check_store_url("sqlite:////tmp/history.sqlite") == "sqlite:////tmp/history.sqlite"
    assert check_store_url("/tmp/a=b/history.sqlite") == "/tmp/a=b/history.sqlite"


def _cli(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    return subprocess.run(
        [sys.executable, "-m", "miles.ci", *argv],
        cwd=cwd,
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("variable", ["MILES_HISTORY_URL", "MILES_DURATIONS_PATH"])
@pytest.mark.parametrize(
    "value",
    [
        f"postgresql://miles:{SECRET}@x@{HOST}/db",
        f"postgresql://miles:{SECRET}%zz@{HOST}/db",
        f"host=127.0.0.1 password={SECRET}",
    ],
)
def test_the_runner_refuses_a_bad_store_setting_before_running_anything(variable, value, make_tree):
    root = make_tree({"tests/unit/test_a.py": "def test_a():\n    pass\n"})
    done = _cli("run", "--root", str(root), "--suite", "stage-a-cpu", env={variable: value}, cwd=root)
    assert done.returncode == 2, done.stderr
    assert SECRET not in done.stdout + done.stderr and "Traceback" not in done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: {variable}")
    assert not (root / ".miles" / "reports").exists()  # nothing ran
    assert not any(SECRET in str(p) or "3cr3t" in str(p) for p in root.rglob("*"))


def test_durations_path_names_a_file_so_a_url_there_is_refused_with_the_right_variable(monkeypatch):
    from miles.ci.reports.durations import durations_path

    monkeypatch.setenv("MILES_DURATIONS_PATH", f"postgresql://miles:{SECRET}@{HOST}/db")
    with pytest.raises(
        StoreError, match="MILES_DURATIONS_PATH names a SQLite file.*MILES_HISTORY_URL"
    ) as info:
        durations_path(".")
    assert SECRET not in str(info.value)


# --------------------------------------------------------------------- real PostgreSQL


def _postgres(variable: str = "MILES_TEST_POSTGRES_URL") -> str:
    url = os.environ.get(variable, "")
    if not url:
        reason = f"{variable} is not set (.ci/run sets it)"
        if os.environ.get("MILES_REQUIRE_POSTGRES") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return url


def _with_password(url: str, password: str) -> str:
    head, rest = url.split("://", 1)
    userinfo, host = rest.rsplit("@", 1)
    return f"{head}://{userinfo.split(':', 1)[0]}:{password}@{host}"


@pytest.mark.parametrize(
    "query",
    [
        "bogus_option=1",
        "sslmode=not-a-mode",
        "target_session_attrs=nonsense",
        "options=-c%20no_such_setting%3D1",
    ],
)
def test_every_driver_error_is_a_store_error_without_the_password(query):
    base = _postgres()
    password = base.split("://", 1)[1].rsplit("@", 1)[0].split(":", 1)[1]
    with pytest.raises(StoreError) as info:
        open_store(f"{base}?{query}")
    message = str(info.value)
    assert password not in message and "\n" not in message and message.startswith("history store")


def test_a_wrong_password_is_reported_without_it():
    wrong = _with_password(_postgres(), SECRET)
    with pytest.raises(StoreError) as info:
        open_store(wrong)
    assert SECRET not in str(info.value) and "***" in str(info.value)


@pytest.fixture
def schema_url():
    import psycopg

    base = _postgres()
    schema = f"miles_secrets_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    yield base, schema, f"{base}?options=-csearch_path%3D{schema}"
    with psycopg.connect(base, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


def test_a_read_only_role_can_show_history(schema_url, make_tree, capsys):
    import psycopg

    base, schema, url = schema_url
    reader = _postgres("MILES_TEST_POSTGRES_READER_URL")
    open_store(url)  # the writer creates the schema
    with psycopg.connect(base, autocommit=True) as conn:
        role = reader.split("://", 1)[1].split(":", 1)[0]
        conn.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        conn.execute(f"GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {role}")
    reader_url = f"{reader}?options=-csearch_path%3D{schema}"
    root = make_tree({"tests/e2e/test_x.py": ""})
    argv = ["history", "show", "--root", str(root), "--store", reader_url, "--test", "tests/e2e/test_x.py"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "no stored runs" in capsys.readouterr().out
