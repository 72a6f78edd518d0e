"""A run with jobs runs its files side by side, one runner process per job, and reports them as one run.

The jobs take files from one queue (each file once, the next to the job that frees first); the
files of different jobs overlap in time; a failure in one job leaves the other's file running;
the run's reports hold every file's attempt once; the plan predicts the last job to finish; a
lane that asks for jobs gets them, one per core with "cores", and a run split by --shard does not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=10, suite="stage-a-cpu")

REPORTS = ".miles/reports/stage-b-cpu-1of1"
# Each file notes when its test started and ended, and waits until the other job's file has
# started too (up to a minute), so that two jobs can only pass by running at the same time.
MEETS = """
import time
from pathlib import Path
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time={est}, suite="stage-b-cpu")
OUT = Path(__file__).parents[2] / "seen"
def test_meet():
    import os
    OUT.mkdir(exist_ok=True)
    (OUT / "{name}.threads").write_text(os.environ.get("OMP_NUM_THREADS", "unset"))
    (OUT / "{name}.start").write_text(str(time.time()))
    deadline = time.time() + 60
    while len(list(OUT.glob("*.start"))) < {wait_for} and time.time() < deadline:
        time.sleep(0.05)
    (OUT / "{name}.end").write_text(str(time.time()))
    assert len(list(OUT.glob("*.start"))) >= {wait_for}
"""
FAILS = """
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=1, suite="stage-b-cpu")
def test_fails():
    assert 1 == 2
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path_factory):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "MILES_HISTORY_URL", "MILES_TINY_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MILES_DURATIONS_PATH", str(tmp_path_factory.mktemp("store") / "durations.sqlite"))


def _run(root: Path, *extra: str) -> int:
    return main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream", *extra])


def _attempts(root: Path) -> list[dict]:
    return json.loads((root / REPORTS / "run.json").read_text())["attempts"]


def test_two_jobs_run_their_files_side_by_side_and_report_one_run(make_tree, capsys):
    root = make_tree({
        "tests/e2e/test_a.py": MEETS.format(est=20, name="a", wait_for=2),
        "tests/e2e/test_b.py": MEETS.format(est=20, name="b", wait_for=2),
    })  # fmt: skip
    assert _run(root, "--jobs", "2") == 0
    seen = root / "seen"
    a = (float((seen / "a.start").read_text()), float((seen / "a.end").read_text()))
    b = (float((seen / "b.start").read_text()), float((seen / "b.end").read_text()))
    assert a[0] < b[1] and b[0] < a[1], (a, b)  # the two tests overlapped
    # each test process gets its share of the cores as its OpenMP threads, unless the caller said
    share = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert (seen / "a.threads").read_text() == (seen / "b.threads").read_text() == share
    attempts = _attempts(root)
    assert sorted(x["file"] for x in attempts) == ["tests/e2e/test_a.py", "tests/e2e/test_b.py"]
    assert {x["shard"] for x in attempts} == {"1/2", "2/2"} and {x["status"] for x in attempts} == {"passed"}
    out = capsys.readouterr().out
    assert "[1/2] " in out and "[2/2] " in out and "PASSED: 2 passed" in out
    assert out.count("plan · ") == 1  # the run's plan, not each job's
    # the prediction the summary compares the wall time with is the plan's: two files of 20 s side
    # by side, not one after the other
    run = json.loads((root / REPORTS / "run.json").read_text())
    assert run["predicted"] == 20
    assert "(predicted 20.0s)" in (root / REPORTS / "summary.md").read_text()


# Runs until every file of the run is claimed (up to a minute): while it runs, its job takes nothing.
HOLDS = """
import time
from pathlib import Path
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=20, suite="stage-b-cpu")
def test_holds():
    claims = Path(__file__).parents[2] / "{reports}" / "attempts" / "claims"
    deadline = time.time() + 60
    while len(list(claims.iterdir())) < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert len(list(claims.iterdir())) == 3
"""


def test_a_failure_in_one_job_leaves_the_other_jobs_file_running_and_stops_the_queue(make_tree):
    root = make_tree({
        "tests/e2e/test_fails.py": FAILS,
        "tests/e2e/test_holds.py": HOLDS.format(reports=REPORTS),
        "tests/e2e/test_a.py": MEETS.format(est=30, name="a", wait_for=1),
    })  # fmt: skip
    assert _run(root, "--jobs", "2") == 1
    status = {x["file"]: x["status"] for x in _attempts(root)}
    # shortest first: one job fails test_fails and claims the rest (test_a) as skipped while the
    # other still runs test_holds to its end
    assert status == {
        "tests/e2e/test_fails.py": "failed",
        "tests/e2e/test_holds.py": "passed",
        "tests/e2e/test_a.py": "skipped",
    }, status


def test_each_test_of_a_run_of_several_jobs_gets_its_share_of_the_cores_as_threads(monkeypatch):
    from miles.ci.running.plan import thread_share

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert thread_share({}, 2)["OMP_NUM_THREADS"] == "4"
    assert thread_share({}, 16)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in thread_share({"A": "b"}, 1)
    assert thread_share({"OMP_NUM_THREADS": "3"}, 2)["OMP_NUM_THREADS"] == "3"  # the caller's wins


def test_the_plan_predicts_the_last_job_to_finish(make_tree, capsys):
    root = make_tree({
        f"tests/e2e/test_{n}.py": MEETS.format(est=est, name=n, wait_for=1)
        for n, est in (("a", 40), ("b", 30), ("c", 20))
    })  # fmt: skip
    plan = ["plan", "--root", str(root), "--suite", "stage-b-cpu", "--jobs", "2"]
    assert main([*plan, "--continue-on-error"]) == 0
    out = capsys.readouterr().out
    assert "2 jobs at once" in out
    # longest first: a (40) on one job, b (30) then c (20) on the other
    assert "predicted wall 50s: 2 jobs side by side" in out and "(job 1: 40s, job 2: 50s)" in out
    assert main(plan) == 0  # fast-fail: shortest first, c (20) then a (40) on one job, b (30) on the other
    assert "predicted wall 60s: 2 jobs side by side" in capsys.readouterr().out


def test_in_a_run_that_goes_on_the_second_job_walks_each_suite_from_its_shortest_file(make_tree):
    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.running.claims import walk
    from miles.ci.running.plan import RunOptions, build_plan

    root = make_tree({
        **{f"tests/unit/test_u{est}.py": PASSES.format(est=est, suite="stage-a-cpu") for est in (3, 9, 6)},
        **{f"tests/e2e/test_e{est}.py": PASSES.format(est=est, suite="stage-b-cpu") for est in (40, 20, 30)},
    })  # fmt: skip
    catalog = load_catalog()
    plan = build_plan(RunOptions(root=root, lane="cpu", jobs="2"), catalog, discover(root, catalog=catalog))
    names = [
        [t.registration.file.split("_")[-1].removesuffix(".py") for t in walk(plan.tests, j, both_ends=True)]
        for j in (1, 2)
    ]
    assert names == [["u9", "u6", "u3", "e40", "e30", "e20"], ["u3", "u6", "u9", "e20", "e30", "e40"]]
    assert walk(plan.tests, 2, both_ends=False) == plan.tests  # a fast-fail run: every job shortest first


# The file that waits for the others: it passes only if another job runs all three while this one waits.
WAITS = """
import time
from pathlib import Path
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=5, suite="stage-b-cpu")
def test_waits():
    seen = Path(__file__).parents[2] / "seen"
    deadline = time.time() + 60
    while len(list(seen.glob("*.end"))) < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert len(list(seen.glob("*.end"))) == 3
"""


def test_a_job_that_frees_takes_the_next_file_nobody_took(make_tree):
    # A fixed split into two equal shares would give the waiting file (5 s) and one of the three
    # 10 s files to one job, the waiting file first: it would wait for a file queued behind it.
    root = make_tree({
        "tests/e2e/test_waits.py": WAITS,
        **{f"tests/e2e/test_{n}.py": MEETS.format(est=10, name=n, wait_for=1) for n in ("q1", "q2", "q3")},
    })  # fmt: skip
    assert _run(root, "--jobs", "2") == 0
    shard = {x["file"].removeprefix("tests/e2e/"): x["shard"] for x in _attempts(root)}
    assert len(shard) == 4 and set(shard.values()) == {"1/2", "2/2"}
    assert {shard["test_q1.py"], shard["test_q2.py"], shard["test_q3.py"]} == {
        "1/2", "2/2"
    } - {shard["test_waits.py"]}  # fmt: skip
    claims = root / REPORTS / "attempts" / "claims"
    assert len(list(claims.iterdir())) == 4  # each file taken once


def test_a_lane_asks_for_its_jobs_and_a_sharded_run_uses_one(make_tree, capsys):
    from miles.ci.registry.catalog import load_catalog

    root = make_tree({  # both of the lane's suites have a test: an empty one fails the plan
        "tests/e2e/test_a.py": MEETS.format(est=5, name="a", wait_for=1),
        "tests/unit/test_u.py": PASSES.format(est=5, suite="stage-a-cpu"),
    })  # fmt: skip
    assert load_catalog().lanes["cpu"].jobs == "cores" and load_catalog().lanes["cpu"].fast_fail is False
    assert main(["plan", "--root", str(root), "--lane", "cpu"]) == 0
    out = capsys.readouterr().out
    cores = len(os.sched_getaffinity(0))
    assert (f"{cores} jobs at once" in out) == (cores > 1) and "continue on error" in out
    assert main(["plan", "--root", str(root), "--lane", "cpu", "--shard", "1/1"]) == 0
    assert "jobs at once" not in capsys.readouterr().out
    assert main(["plan", "--root", str(root), "--lane", "cpu", "--shard", "1/1", "--jobs", "2"]) == 2


def test_a_signal_to_the_run_stops_every_job_and_the_reports_are_written(make_tree):
    root = make_tree({
        f"tests/e2e/test_{n}.py": MEETS.format(est=30, name=n, wait_for=3) for n in ("a", "b")
    })  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    env["MILES_DURATIONS_PATH"] = str(root / "durations.sqlite")
    proc = subprocess.Popen(
        [sys.executable, "-m", "miles.ci", "run", "--root", str(root), "--suite", "stage-b-cpu", "--jobs", "2"],
        cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 120
    while len(list((root / "seen").glob("*.start"))) < 2 and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 1
    statuses = {x["status"] for x in _attempts(root)}
    assert statuses == {"cancelled"}, statuses


HANGS = """
import time
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time=1, suite="stage-a-cpu")
def test_hangs():
    time.sleep(600)
"""
PASSES = """
from miles.ci.register import register_cpu_ci
register_cpu_ci(est_time={est}, suite="{suite}")
def test_passes():
    assert True is not False
"""


def test_the_cpu_lane_runs_and_reports_every_file_after_one_fails_or_times_out(make_tree):
    # only test_hangs has a limit it must meet (3 s counted at the load); the others get enough
    # that a pytest start on a loaded machine is not taken for a hang
    root = make_tree({
        "tests/unit/test_hangs.py": HANGS,
        "tests/unit/test_after.py": PASSES.format(est=120, suite="stage-a-cpu"),
        "tests/unit/test_fails.py": FAILS.replace("stage-b-cpu", "stage-a-cpu").replace("est_time=1", "est_time=120"),
        "tests/e2e/test_stage_b.py": PASSES.format(est=121, suite="stage-b-cpu"),
    })  # fmt: skip
    assert main(["run", "--root", str(root), "--lane", "cpu", "--no-stream", "--timeout-floor", "1"]) == 1
    run = json.loads((root / ".miles/reports/cpu-1of1/run.json").read_text())
    status = {a["file"]: a["status"] for a in run["attempts"]}
    assert status == {
        "tests/unit/test_hangs.py": "timeout",
        "tests/unit/test_fails.py": "failed",
        "tests/unit/test_after.py": "passed",
        "tests/e2e/test_stage_b.py": "passed",
    }, status
    assert run["counts"]["skipped"] == 0


def test_a_job_that_leaves_no_report_has_its_files_reported_as_not_finished(make_tree):
    import subprocess as sp

    from miles.ci.registry.catalog import load_catalog
    from miles.ci.registry.discover import discover
    from miles.ci.running.claims import claim_name
    from miles.ci.running.execute import CancelToken
    from miles.ci.running.jobs import merge
    from miles.ci.running.plan import RunOptions, build_plan

    root = make_tree(
        {
            f"tests/e2e/test_{n}.py": PASSES.format(est=est, suite="stage-b-cpu")
            for n, est in (("a", 9), ("b", 5))
        }
    )
    catalog = load_catalog()
    plan = build_plan(
        RunOptions(root=root, suites=("stage-b-cpu",), jobs="2"), catalog, discover(root, catalog=catalog)
    )
    died = sp.CompletedProcess([], -9)
    taken = {claim_name("stage-b-cpu", "tests/e2e/test_a.py"): 1}  # job 1 took a; no job took b
    record = merge(plan, [None, None], [died, died], 0.0, CancelToken(), taken)
    assert not record.complete and not record.passed
    assert sorted((a.file, a.status) for a in record.attempts) == [
        ("tests/e2e/test_a.py", "cancelled"), ("tests/e2e/test_b.py", "cancelled"),
    ]  # fmt: skip
    message = {a.file: a.message for a in record.attempts}
    assert "job 1/2 took it and ended (exit code -9) without a report" in message["tests/e2e/test_a.py"]
    assert message["tests/e2e/test_b.py"] == (
        "not finished: no job took it; job 1/2 (exit code -9), job 2/2 (exit code -9) ended without a report"
    )


def test_a_job_line_without_an_end_is_relayed_in_bounded_pieces():
    """A job that prints megabytes with no newline costs the relay MAX_LINE_BYTES at a time, and
    every byte still reaches the run's output with the job's prefix."""
    import io
    import threading

    from miles.ci.running.jobs import MAX_LINE_BYTES, _relay

    out = io.StringIO()
    _relay(io.BytesIO(b"x" * (3 * MAX_LINE_BYTES + 5) + b"\nend\n"), "[1/2] ", out, threading.Lock())
    lines = out.getvalue().splitlines()
    assert all(line.startswith("[1/2] ") and len(line) <= len("[1/2] ") + MAX_LINE_BYTES for line in lines)
    assert "".join(line.removeprefix("[1/2] ") for line in lines[:-1]) == "x" * (3 * MAX_LINE_BYTES + 5)
    assert lines[-1] == "[1/2] end" and len(lines) == 5
