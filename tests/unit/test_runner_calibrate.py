"""Durations are stored per attempt; calibrate proposes est_time from them and rewrites only
the number."""

from __future__ import annotations

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.ci.reports.calibrate import apply_proposals, nearest_rank_quantile, propose, round_up_to_bucket
from miles.ci.reports.durations import load_durations, record_durations
from miles.ci.reports.record import Attempt

register_cpu_ci(est_time=1, suite="stage-a-cpu")

CATALOG = load_catalog()
SOURCE = (
    "# -*- coding: utf-8 -*-\n"
    '"""Grüße: non-ASCII before the call must not shift the byte offsets."""\n'
    "from miles.ci.register import register_cpu_ci, register_rocm_ci\n"
    "\n"
    'register_cpu_ci(est_time=60, suite="stage-b-cpu")  # keep this comment\n'
    "register_rocm_ci(\n"
    "    est_time=900.0,\n"
    '    suite="stage-c-4-gpu-mi350",\n'
    '    labels=["amd"],\n'
    ")\n"
    "\n"
    "def test_x():\n"
    "    pass\n"
)
FILE = "tests/e2e/test_recipe.py"


def _attempt(
    elapsed: float, status: str = "passed", backend: str = "cpu", suite: str = "stage-b-cpu"
) -> Attempt:
    return Attempt(
        file=FILE,
        backend=backend,
        suite=suite,
        lane="cpu",
        shard="1/1",
        attempt=1,
        status=status,
        exit_code=0 if status == "passed" else 1,
        signal=None,
        elapsed=elapsed,
        est_time=60,
        retry_reason=None,
        classification=status,
    )


@pytest.fixture
def project(make_tree):
    root = make_tree({FILE: ""})
    (root / FILE).write_text(SOURCE, encoding="utf-8")
    return root


def test_durations_round_trip_per_backend_and_suite(tmp_path):
    store = tmp_path / "durations.sqlite"
    added = record_durations([_attempt(10), _attempt(12, "failed"), _attempt(99, backend="rocm")], store)
    assert added == 3
    assert load_durations("cpu", "stage-b-cpu", store) == {FILE: [(10.0, True), (12.0, False)]}
    assert load_durations("rocm", path=store) == {FILE: [(99.0, True)]}


def test_cancelled_and_never_started_attempts_are_not_durations(tmp_path):
    store = tmp_path / "durations.sqlite"
    cancelled = _attempt(3, "cancelled").replace(exit_code=None)
    missing = _attempt(0, "failed").replace(exit_code=None, classification="missing-file")
    assert record_durations([cancelled, missing], store) == 0
    assert load_durations("cpu", path=store) == {}


def test_durations_path_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_DURATIONS_PATH", str(tmp_path / "elsewhere.sqlite"))
    record_durations([_attempt(5)])
    assert load_durations("cpu") == {FILE: [(5.0, True)]}


def test_buckets_round_up_and_quantile_is_a_measured_value():
    assert [round_up_to_bucket(s) for s in (0.2, 2.3, 11, 61, 301, 1801)] == [1, 3, 15, 75, 360, 2100]
    # the unit files (2 to 4 s each, a hundred of them) would add minutes to the prediction at 5 s
    assert nearest_rank_quantile([10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 0.9) == 90


def test_no_proposal_from_fewer_than_three_passed_runs(project, tmp_path):
    store = tmp_path / "d.sqlite"
    record_durations([_attempt(30), _attempt(31), _attempt(500, "failed")], store)
    (row,) = propose(discover(project, catalog=CATALOG, cache=False), store, backend="cpu").rows
    assert row.proposed is None and "needs 3 passed runs" in row.note


def test_proposal_is_the_high_quantile_rounded_up(project, tmp_path):
    store = tmp_path / "d.sqlite"
    record_durations([_attempt(s) for s in (30, 31, 33, 42)] + [_attempt(400, "failed")], store)
    (row,) = propose(discover(project, catalog=CATALOG, cache=False), store, backend="cpu").rows
    assert row.measured == 42 and row.proposed == 45  # up to the 5 s step; the timeout is 3 x that


def test_write_changes_only_the_numbers_and_prints_a_diff(project, tmp_path):
    store = tmp_path / "d.sqlite"
    record_durations([_attempt(s) for s in (30, 31, 33, 40)], store)
    record_durations(
        [_attempt(s, backend="rocm", suite="stage-c-4-gpu-mi350") for s in (1000, 1100, 1200)], store
    )
    proposals = propose(discover(project, catalog=CATALOG, cache=False), store)
    diff = apply_proposals(project, proposals.changes)
    expected = SOURCE.replace("est_time=60,", "est_time=40,").replace("est_time=900.0,", "est_time=1200,")
    assert (project / FILE).read_text(encoding="utf-8") == expected
    assert "-register_cpu_ci(est_time=60," in diff and "+    est_time=1200," in diff
    reread = {r.backend: r.est_time for r in discover(project, catalog=CATALOG, cache=False).registrations}
    assert reread == {"cpu": 40, "rocm": 1200}


def test_calibrate_command_lists_proposals_and_writes_on_request(project, capsys, monkeypatch):
    monkeypatch.setenv("MILES_DURATIONS_PATH", str(project / "d.sqlite"))
    record_durations([_attempt(s) for s in (30, 31, 33, 40)])
    assert main(["calibrate", "--root", str(project), "--suite", "stage-b-cpu"]) == 0
    out = capsys.readouterr().out
    assert "1 change(s) proposed" in out and FILE in out
    assert (project / FILE).read_text(encoding="utf-8") == SOURCE
    assert main(["calibrate", "--root", str(project), "--suite", "stage-b-cpu", "--write"]) == 0
    assert "+register_cpu_ci(est_time=40," in capsys.readouterr().out


UNIT = "tests/unit/test_slow_on_a_busy_machine.py"
UNIT_SOURCE = (
    '"""A unit file: implicitly stage-a-cpu."""\n\nimport time\n\n\ndef test_x():\n    assert time.time()\n'
)


def test_an_implicitly_registered_file_gets_its_own_measured_est_time_and_timeout(make_tree, tmp_path):
    from miles.ci.running.plan import RunOptions, build_plan

    root = make_tree({UNIT: UNIT_SOURCE})
    before = discover(root, catalog=CATALOG, cache=False)
    (reg,) = before.registrations
    assert reg.implicit and reg.est_time == 15  # the directory's flat value: a 60 s timeout
    store = tmp_path / "d.sqlite"
    # 7.7 s on a quiet machine, 57.7 s on a busy one (the run whose 60 s timeout stopped the lane)
    record_durations([_attempt(s, suite="stage-a-cpu").replace(file=UNIT) for s in (7.7, 9.0, 57.7)], store)
    proposals = propose(before, store, backend="cpu")
    (row,) = proposals.rows
    assert row.proposed == 60 and row.changes  # 57.7, up to the 5 s step
    apply_proposals(root, proposals.changes)
    text = (root / UNIT).read_text()
    assert 'register_cpu_ci(est_time=60, suite="stage-a-cpu")' in text
    assert "from miles.ci.register import register_cpu_ci" in text
    (after,) = discover(root, catalog=CATALOG, cache=False).registrations
    assert not after.implicit and after.suite == "stage-a-cpu" and after.est_time == 60
    plan = build_plan(
        RunOptions(root=root, suites=("stage-a-cpu",)), CATALOG, discover(root, catalog=CATALOG, cache=False)
    )
    assert (
        plan.tests[0].timeout == 180
    )  # 3 x 60: well above the busy machine's 57.7 s, and counted at its load
