"""The command line as a careless user and an attacker type it: every bad value is one line and
exit 2 before anything runs, every outside failure is one line, and nothing hangs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=3, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
CPU_PASS = {
    "tests/e2e/test_ok.py": """
        from miles.ci.register import register_cpu_ci
        register_cpu_ci(est_time=20, suite="stage-b-cpu")
        def test_ok():
            pass
    """
}
DOWN = "postgresql://miles:pw-that-stays-hidden@127.0.0.1:1/none"


@pytest.fixture(autouse=True)
def _no_ci_env(monkeypatch):
    for key in ("GITHUB_ACTIONS", "GITHUB_STEP_SUMMARY", "GITHUB_OUTPUT", "MILES_DURATIONS_PATH",
                "MILES_HISTORY_URL"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)


def _one_line_exit_2(argv: list[str], capsys, expected: str) -> None:
    assert main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("error: ") and expected in line, line


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--timeout-floor", "nan", "--timeout-floor nan must be a finite number of seconds"),
        ("--timeout-floor", "inf", "--timeout-floor inf must be a finite number of seconds"),
        ("--timeout-floor", "-1", "--timeout-floor -1 must be between 0 and"),
        ("--grace", "inf", "--grace inf must be a finite number of seconds"),
        ("--grace", "nan", "--grace nan must be a finite number of seconds"),
        ("--grace", "1e9", "--grace 1e+09 must be between 0 and"),
        ("--max-attempts", "0", "--max-attempts 0 must be between 1 and"),
        ("--max-attempts", "1000000", "--max-attempts 1000000 must be between 1 and"),
        ("--shards", "100000000", "--shards 100000000 must be between 1 and 64"),
        ("--shard", "1/100000000", "--shard 1/100000000: N must be between 1 and 64"),
    ],
)
def test_numbers_that_would_hang_or_explode_are_refused(make_tree, capsys, flag, value, expected):
    root = make_tree(CPU_PASS)
    _one_line_exit_2(["run", "--root", str(root), "--suite", "stage-b-cpu", flag, value], capsys, expected)
    assert not (root / ".miles" / "reports").exists()


def test_matrix_refuses_a_non_finite_timeout_floor(make_tree, capsys):
    root = make_tree(CPU_PASS)
    _one_line_exit_2(["matrix", "--root", str(root), "--lane", "cpu", "--timeout-floor", "inf"], capsys,
                     "--timeout-floor inf must be a finite number")  # fmt: skip


def test_a_report_dir_that_is_a_file_is_refused_before_any_test_runs(make_tree, capsys):
    root = make_tree({**CPU_PASS, "reports.txt": "not a directory"})
    argv = ["run", "--root", str(root), "--suite", "stage-b-cpu", "--report-dir", str(root / "reports.txt")]
    _one_line_exit_2(argv, capsys, "--report-dir")
    assert (root / "reports.txt").read_text() == "not a directory"


@pytest.mark.parametrize("command", [["run", "--suite", "stage-b-cpu"], ["list"], ["audit"], ["plan", "--lane", "cpu"],
                                     ["matrix", "--lane", "cpu"], ["manifest", "--json"]])  # fmt: skip
def test_a_root_that_does_not_exist_is_exit_2_not_an_empty_success(tmp_path, capsys, command):
    argv = [command[0], "--root", str(tmp_path / "nowhere"), *command[1:]]
    _one_line_exit_2(argv, capsys, f"--root {tmp_path / 'nowhere'} does not exist")


def test_a_root_without_tests_is_named(tmp_path, capsys):
    _one_line_exit_2(["list", "--root", str(tmp_path)], capsys, "has no tests/ directory")


def test_calibrate_with_the_store_down_is_one_masked_line_and_exit_1(make_tree, capsys, monkeypatch):
    root = make_tree(CPU_PASS)
    monkeypatch.setenv("MILES_HISTORY_URL", DOWN)
    assert main(["calibrate", "--root", str(root), "--suite", "stage-b-cpu"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: history store unreachable: postgresql://miles:***@127.0.0.1:1/none")
    assert "pw-that-stays-hidden" not in line


@pytest.mark.parametrize("limit", ["-1", "0"])
def test_history_limit_below_one_is_bad_usage(make_tree, capsys, limit):
    root = make_tree(CPU_PASS)
    argv = ["history", "show", "--root", str(root), "--test", "tests/e2e/test_ok.py", "--limit", limit]
    _one_line_exit_2(argv, capsys, f"--limit {limit} must be at least 1")


def test_an_unwritable_step_summary_is_a_warning_and_the_run_keeps_its_exit_code(
    make_tree, capsys, monkeypatch
):
    root = make_tree(CPU_PASS)
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(root / "no-such-dir" / "summary.md"))
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--no-stream"]) == 0
    err = capsys.readouterr().err
    assert "warning: the summary was not appended to $GITHUB_STEP_SUMMARY" in err
    assert (root / ".miles/reports/stage-b-cpu-1of1/junit.xml").is_file()


def test_ignored_pr_labels_cannot_become_workflow_commands(capsys):
    labels = json.dumps(["bug", "x\n::warning::pwned", "y\r\n::add-mask::z", "run-ci-amd"])
    assert main(["policy", "--event", "pull_request", "--labels-json", labels]) == 0
    captured = capsys.readouterr()
    for line in (captured.out + captured.err).splitlines():
        assert not line.lstrip().startswith("::"), line
    assert '"x\\n::warning::pwned"' in captured.err


def test_nox_keeps_the_runners_exit_code_2(tmp_path):
    """A lane session whose runner refuses its input ends nox with 2, not nox's own 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GITHUB_", "MILES_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        [sys.executable, "-m", "nox", "--no-venv", "-s", "cpu", "--", "--plan", "--shard", "0/1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--shard '0/1': need 1 <= k <= N" in done.stdout + done.stderr
