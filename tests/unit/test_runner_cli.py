"""`python -m miles.ci run/plan/matrix/policy`: plans, exit codes, report paths, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.ci.reports.durations import durations_path, load_durations
from miles.ci.running.plan import TIMEOUT_FACTOR, RunOptions, build_plan, timeout_for

register_cpu_ci(est_time=4, suite="stage-a-cpu")

ROCM = "from miles.ci.register import register_rocm_ci\n"
GPU_TREE = {
    f"tests/e2e/test_gpu_{i}.py": ROCM
    + f'register_rocm_ci(est_time={t}, suite="stage-c-4-gpu-mi350", labels=["{label}"])\n'
    for i, (t, label) in enumerate(
        [(1500, "megatron"), (1400, "sglang"), (900, "megatron"), (700, "amd"), (600, "sglang"), (300, "amd")]
    )
}
CPU_PASS = {
    "tests/e2e/test_ok.py": """
        from miles.ci.register import register_cpu_ci
        register_cpu_ci(est_time=20, suite="stage-b-cpu")
        def test_ok():
            pass
    """
}


@pytest.fixture(autouse=True)
def _no_ci_env(monkeypatch):
    for key in (
        "GITHUB_ACTIONS",
        "GITHUB_STEP_SUMMARY",
        "GITHUB_OUTPUT",
        "MILES_DURATIONS_PATH",
        "MILES_HISTORY_URL",
    ):
        monkeypatch.delenv(key, raising=False)


def _plan(root, **kw):
    catalog = load_catalog()
    return build_plan(RunOptions(root=root, **kw), catalog, discover(root, catalog=catalog, cache=False))


def test_plan_prints_shards_bounds_timeouts_and_commands_and_exits_0(make_tree, capsys):
    root = make_tree(GPU_TREE)
    assert main(["run", "--root", str(root), "--lane", "rocm-mi350", "--plan"]) == 0
    out = capsys.readouterr().out
    assert (
        "suite stage-c-4-gpu-mi350: 6 test(s), 2 shard(s) (auto: budget 3600s per shard), total est 5400s"
        in out
    )
    assert (
        "lower bound 2700s = max(total/N 2700s, longest 1500s); predicted makespan 2700s; ratio 1.000" in out
    )
    assert "est   1500s  timeout   4500s  tests/e2e/test_gpu_0.py" in out
    assert "MILES_CI_BACKEND=rocm MILES_CI_SUITE=stage-c-4-gpu-mi350 MILES_CI_LANE=rocm-mi350" in out
    assert "-m pytest tests/e2e/test_gpu_5.py --junitxml=" in out


def test_plan_imports_nothing_heavy(make_tree):
    root = make_tree(GPU_TREE)
    code = (
        "import sys; from miles.ci.cli import main; "
        f"rc = main(['plan', '--root', {str(root)!r}, '--lane', 'rocm-mi350']); "
        "heavy = [m for m in ('torch', 'transformers', 'megatron', 'sglang', 'psycopg', 'matplotlib', 'numpy') "
        "if m in sys.modules]; print('HEAVY', heavy); sys.exit(rc)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "HEAVY []" in result.stdout


def test_every_shard_computes_the_same_disjoint_partition(make_tree):
    root = make_tree(GPU_TREE)
    shards = [
        {t.registration.file for t in _plan(root, lane="rocm-mi350", shard=f"{k}/3").tests} for k in (1, 2, 3)
    ]
    assert sum(len(s) for s in shards) == len(GPU_TREE)
    assert set().union(*shards) == set(GPU_TREE)


def test_timeout_is_the_larger_of_floor_and_three_times_est_time():
    assert timeout_for(15, 60) == 60
    assert timeout_for(400, 60) == 1200


def test_default_report_dir_is_named_after_lane_and_shard(make_tree):
    root = make_tree(GPU_TREE)
    assert (
        _plan(root, lane="rocm-mi350", shard="2/3").report_dir
        == root.resolve() / ".miles/reports/rocm-mi350-2of3"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lane", "rocm-mi300"], "lane 'rocm-mi300' is not in the catalog"),
        (["--suite", "stage-c-4-gpu-mi300x"], "suite 'stage-c-4-gpu-mi300x' is not in the catalog"),
        (["--lane", "cpu", "--labels", "run-ci-nope"], "label 'run-ci-nope' names no catalog label"),
        (["--lane", "cpu", "--labels", "run-ci-x;rm -rf /"], "is refused"),
        (["--lane", "cpu", "--shard", "3/2"], "need 1 <= k <= N"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(make_tree, capsys, args, message):
    root = make_tree(CPU_PASS)
    assert main(["run", "--root", str(root), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_registration_on_an_unknown_suite_fails_only_its_own_row(make_tree, capsys):
    root = make_tree(
        {
            "tests/e2e/test_typo.py": ROCM
            + 'register_rocm_ci(est_time=60, suite="stage-c-4-gpu-mi300", labels=["amd"])\n',
            **GPU_TREE,
        }
    )
    # its lane plans: the typo is the failing row of its own file, the other six tests still run
    assert main(["run", "--root", str(root), "--lane", "rocm-mi350", "--plan"]) == 0
    out = capsys.readouterr().out
    assert "fails (registration refused): tests/e2e/test_typo.py:2: " in out
    plan = _plan(root, lane="rocm-mi350")
    assert [(r.file, r.suite) for r in plan.refused] == [("tests/e2e/test_typo.py", "stage-c-4-gpu-mi350")]
    assert len(plan.tests) == 6
    # the matrix runs the first shard, which reports it; the other ROCm lanes name it as a warning
    assert main(["matrix", "--root", str(root), "--lane", "rocm-mi350"]) == 0
    assert [e["shard"] for e in json.loads(capsys.readouterr().out)["include"]] == ["1/2", "2/2"]
    assert main(["run", "--root", str(root), "--lane", "cpu", "--plan"]) == 1  # stage-a/b-cpu are empty here
    capsys.readouterr()
    assert main(["audit", "--root", str(root), "--strict"]) == 1


def test_a_refused_registration_fails_the_run_while_the_rest_of_its_suite_runs(make_tree, capsys):
    typo = (
        CPU_PASS["tests/e2e/test_ok.py"]
        .replace("stage-b-cpu", "stage-b-cpux")
        .replace("test_ok", "test_typo")
    )
    root = make_tree({"tests/e2e/test_typo.py": typo, **CPU_PASS})
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu"]) == 1
    assert "FAILED: 1 passed, 1 failed" in capsys.readouterr().out
    run = json.loads((root / ".miles/reports/stage-b-cpu-1of1/run.json").read_text())
    rows = {a["file"]: (a["status"], a["classification"]) for a in run["attempts"]}
    assert rows == {
        "tests/e2e/test_typo.py": ("failed", "registration"),
        "tests/e2e/test_ok.py": ("passed", "passed"),
    }
    (typo_row,) = [a for a in run["attempts"] if a["file"] == "tests/e2e/test_typo.py"]
    assert typo_row["message"].startswith("registration refused: tests/e2e/test_typo.py:2: register_cpu_ci: ")
    assert "stage-b-cpux" in typo_row["message"]
    junit = (root / ".miles/reports/stage-b-cpu-1of1/junit.xml").read_text()
    assert 'file="tests/e2e/test_typo.py"' in junit and "<failure" in junit


def test_a_suite_with_no_enabled_test_fails_its_lane_in_one_line(
    make_tree, capsys, catalog_with_an_empty_suite
):
    root = make_tree(GPU_TREE)  # nothing on the CUDA suites
    for argv in (
        ["run", "--lane", "cuda-h200", "--plan"],
        ["run", "--lane", "cuda-h200"],
        ["matrix", "--lane", "cuda-h200"],
    ):
        assert main([argv[0], "--root", str(root), *argv[1:]]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            "error: suites stage-b-2-gpu-h200, stage-c-2-gpu-h200, stage-c-4-gpu-h200, stage-c-8-gpu-h200, "
            "stage-c-8-gpu-h100 of "
        )
        assert "have no enabled test" in err[0] and 'empty = "..."' in err[0]
    # a suite the catalog declares empty (with its reason) passes with nothing run, and says why
    assert main(["run", "--root", str(root), "--lane", "nightly-mi350-8gpu", "--plan"]) == 0
    assert (
        "declared empty in the catalog: "
        + catalog_with_an_empty_suite.suites["nightly-stage-c-8-gpu-mi350"].empty
        in capsys.readouterr().out
    )


def test_a_suite_whose_only_test_is_disabled_is_empty(make_tree, capsys):
    off = (
        ROCM
        + 'register_rocm_ci(est_time=60, suite="stage-c-4-gpu-mi350", labels=["amd"], disabled="needs 8 GPUs")\n'
    )
    root = make_tree({"tests/e2e/test_off.py": off})
    assert main(["run", "--root", str(root), "--lane", "rocm-mi350", "--plan"]) == 1
    assert "suite stage-c-4-gpu-mi350 of rocm-mi350 has no enabled test" in capsys.readouterr().err


def test_run_exits_0_when_all_pass_and_prints_where_reports_went(make_tree, capsys):
    root = make_tree(CPU_PASS)
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu"]) == 0
    out = capsys.readouterr().out
    reports = root.resolve() / ".miles/reports/stage-b-cpu-1of1"
    for name in ("junit.xml", "summary.md", "run.json"):
        assert f"{name}: {reports / name}" in out
    durations = load_durations("cpu", path=durations_path(root))  # the project's history store
    assert {f: [ok for _, ok in rows] for f, rows in durations.items()} == {"tests/e2e/test_ok.py": [True]}


def test_run_exits_1_when_a_test_fails(make_tree, capsys):
    root = make_tree(
        {"tests/e2e/test_ok.py": CPU_PASS["tests/e2e/test_ok.py"].replace("pass", "assert False")}
    )
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu"]) == 1
    assert "FAILED: 1 failed" in capsys.readouterr().out


def test_matrix_has_one_entry_per_suite_shard_for_fromjson(make_tree, capsys, tmp_path, monkeypatch):
    root = make_tree(GPU_TREE)
    output = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(output))
    assert main(["matrix", "--root", str(root), "--lane", "rocm-mi350"]) == 0
    matrix = json.loads(capsys.readouterr().out)
    assert [(e["suite"], e["shard"]) for e in matrix["include"]] == [
        ("stage-c-4-gpu-mi350", "1/2"),
        ("stage-c-4-gpu-mi350", "2/2"),
    ]
    entry = matrix["include"][0]
    assert entry["runner_labels"] == ["self-hosted", "mi350", "gpu-4"] and entry["gpus"] == 4
    assert entry["timeout_minutes"] >= entry["predicted_s"] * TIMEOUT_FACTOR / 60
    assert json.loads(output.read_text().split("matrix=", 1)[1].splitlines()[0]) == matrix


def test_policy_command_writes_github_outputs(tmp_path, capsys, monkeypatch):
    output = tmp_path / "github_output"
    monkeypatch.setenv("GITHUB_OUTPUT", str(output))
    labels = json.dumps([{"name": "run-ci-amd"}, {"name": "documentation"}])
    assert main(["policy", "--event", "pull_request", "--labels-json", labels]) == 0
    assert "labels=run-ci-amd\n" in output.read_text()
    assert main(["policy", "--event", "pull_request", "--labels-json", '["run-ci-$(id)"]']) == 2


def test_github_actions_folds_each_test_and_streams_its_output(make_tree, capsys, tmp_path, monkeypatch):
    root = make_tree(
        {"tests/e2e/test_ok.py": CPU_PASS["tests/e2e/test_ok.py"].replace("pass", "print('HELLO-FROM-TEST')")}
    )
    summary = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    assert main(["run", "--root", str(root), "--suite", "stage-b-cpu", "--pytest-arg=-s"]) == 0
    out = capsys.readouterr().out
    group = out.index("::group::[1/1] tests/e2e/test_ok.py")
    assert group < out.index("HELLO-FROM-TEST") < out.index("::endgroup::")
    assert "## miles CI" in summary.read_text()


def test_terminal_progress_shows_position_share_and_eta(make_tree):
    import io

    from miles.ci.running.execute import TestRun
    from miles.ci.running.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    plan = _plan(make_tree(GPU_TREE), lane="rocm-mi350")
    screen = Terminal()
    progress = Progress(plan.tests, screen, github=False, streaming=False)
    first = plan.tests[0].registration
    progress.start(0, TestRun(first.file, "rocm", first.suite, "rocm-mi350", "1/2", first.est_time, 375.0))
    progress.tick(150.0)
    assert "[1/6 ·" in screen.getvalue() and "ETA 1h27m" in screen.getvalue()


def test_a_run_narrowed_to_one_suite_of_a_lane_reports_under_the_suite_name(make_tree):
    cuda = {name: text.replace("rocm", "cuda").replace("mi350", "h200") for name, text in GPU_TREE.items()}
    root = make_tree(cuda)
    plan = _plan(root, lane="cuda-h200", suites=("stage-c-4-gpu-h200",), shard="1/2")
    assert plan.report_dir.name == "stage-c-4-gpu-h200-1of2"


def test_the_plan_carries_each_files_gate_declarations(make_tree):
    gated = (
        CPU_PASS["tests/e2e/test_ok.py"]
        .replace("register_cpu_ci(", 'register_ci_gate(metric_key="train/loss")\n        register_cpu_ci(')
        .replace("import register_cpu_ci", "import register_ci_gate, register_cpu_ci")
    )
    root = make_tree({"tests/e2e/test_gated.py": gated, **CPU_PASS})
    gates = {
        t.registration.file: [g.metric_key for g in t.gates]
        for t in _plan(root, suites=("stage-b-cpu",)).tests
    }
    assert gates == {"tests/e2e/test_gated.py": ["train/loss"], "tests/e2e/test_ok.py": []}


def test_matrix_honours_a_zero_timeout_floor(make_tree, capsys):
    short = {f"tests/e2e/test_s{i}.py": CPU_PASS["tests/e2e/test_ok.py"] for i in range(3)}
    root = make_tree(short)
    minutes = []
    for floor in ("0", "1"):
        argv = ["matrix", "--root", str(root), "--lane", "cpu", "--suite", "stage-b-cpu"]
        assert main([*argv, "--timeout-floor", floor]) == 0
        minutes.append(json.loads(capsys.readouterr().out)["include"][0]["timeout_minutes"])
    assert minutes[0] == minutes[1]  # 20 s x TIMEOUT_FACTOR each under both floors


# A CPU test of the registration API itself, like the seed framework's own registry tests:
# it calls the markers inside its test functions and quotes them in string fixtures.
MARKER_API_TEST = """
from miles.ci.register import register_ci_gate, register_cpu_ci

register_cpu_ci(est_time=5, suite="stage-a-cpu")

FIXTURE = 'register_cuda_ci(est_time=600, suite="stage-c-8-gpu-b200", labels=["megatron"])'


def test_markers_are_no_ops_at_run_time():
    from miles.ci.register import register_cuda_ci

    assert register_cuda_ci(est_time=1, suite="stage-c-4-gpu-h200", labels=["megatron"]) is None
    assert register_ci_gate(metric_key="train/grad_norm") is None
"""


def test_a_test_of_the_markers_themselves_blocks_no_lane(make_tree, capsys):
    root = make_tree({"tests/ci/test_markers.py": MARKER_API_TEST, **GPU_TREE})
    discovery = discover(root)
    assert discovery.problems == ()
    assert [(r.backend, r.suite) for r in discovery.file("tests/ci/test_markers.py").registrations] == [
        ("cpu", "stage-a-cpu")
    ]
    for suite in ("stage-c-4-gpu-mi350", "stage-a-cpu"):
        assert main(["plan", "--root", str(root), "--suite", suite]) == 0, capsys.readouterr().err
        assert _plan(root, suites=(suite,)).refused == ()


def test_a_problem_of_a_file_fails_that_file_in_the_suites_it_registers_for(make_tree, capsys):
    bad_gate = (
        "from miles.ci.register import register_ci_gate, register_cuda_ci\n"
        'register_cuda_ci(est_time=60, suite="stage-c-4-gpu-h200", labels=["megatron"])\n'
        'register_ci_gate(metric_key="")\n'
    )
    other = (
        ROCM.replace("rocm", "cuda")
        + 'register_cuda_ci(est_time=60, suite="stage-b-2-gpu-h200", labels=["fsdp"])\n'
    )
    root = make_tree({"tests/e2e/test_bad_gate.py": bad_gate, "tests/e2e/test_other.py": other})
    plan = _plan(root, suites=("stage-c-4-gpu-h200",))
    # the file does not run with a broken gate: its row is the failure
    assert [r.message for r in plan.refused] == [
        "register_ci_gate: metric_key='' must be a non-empty string such as 'train/grad_norm'"
    ]
    assert plan.tests == ()
    assert main(["plan", "--root", str(root), "--suite", "stage-b-2-gpu-h200"]) == 0
    assert "warning: 1 registration problem(s) in other suites" in capsys.readouterr().out
