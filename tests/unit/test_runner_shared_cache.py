"""Every file of a run shares one tiny-checkpoint cache, made fresh for the run and gone after it;
a cache the caller names is used as it is and kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.running.runner import TINY_CACHE_ENV
from miles.ckpt.tiny_cache import CACHE_ENV

register_cpu_ci(est_time=3, suite="stage-a-cpu")

WRITES_ITS_CACHE = """
import os
from pathlib import Path
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=5, suite="stage-b-cpu")
def test_cache():
    folder = Path(os.environ["MILES_TINY_CACHE"])
    assert folder.is_dir()
    (Path(__file__).parents[2] / "{name}.seen").write_text(str(folder))
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path_factory):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_HISTORY_URL", CACHE_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MILES_DURATIONS_PATH", str(tmp_path_factory.mktemp("store") / "durations.sqlite"))


def _project(make_tree) -> Path:
    return make_tree({f"tests/e2e/test_{n}.py": WRITES_ITS_CACHE.format(name=n) for n in ("a", "b")})


def test_the_runner_and_the_cache_read_one_variable():
    assert TINY_CACHE_ENV == CACHE_ENV


def test_the_files_of_a_run_share_one_fresh_cache_that_is_gone_after_the_run(make_tree):
    root = _project(make_tree)
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"]) == 0
    seen = {(root / f"{n}.seen").read_text() for n in ("a", "b")}
    assert len(seen) == 1
    assert not Path(seen.pop()).exists()


def test_a_cache_the_caller_names_is_used_and_kept(make_tree, monkeypatch, tmp_path_factory):
    root = _project(make_tree)
    mine = tmp_path_factory.mktemp("my-cache")
    monkeypatch.setenv(CACHE_ENV, str(mine))
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"]) == 0
    assert {(root / f"{n}.seen").read_text() for n in ("a", "b")} == {str(mine)}
    assert mine.is_dir()
