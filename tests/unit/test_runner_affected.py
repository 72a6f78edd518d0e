"""Which suites a change may skip; every doubt runs everything."""

from __future__ import annotations

import subprocess

import pytest

from miles.ci.cli import main
from miles.ci.register import register_cpu_ci
from miles.ci.registry.catalog import load_catalog
from miles.ci.registry.discover import discover
from miles.ci.selection.affected import affected_suites, parse_name_status

register_cpu_ci(est_time=1, suite="stage-a-cpu")

CATALOG = load_catalog()
GPU_SUITES = {s.name for s in CATALOG.suites.values() if s.is_gpu}
TREE = {
    "README.md": "# x\n",
    "miles/core.py": "X = 1\n",
    "tests/unit/test_fast.py": "def test_x():\n    pass\n",
    "tests/e2e/test_amd.py": """
        from miles.ci.register import register_cuda_ci, register_rocm_ci
        register_rocm_ci(est_time=600, suite="stage-c-4-gpu-mi350", labels=["amd"])
        register_cuda_ci(est_time=600, suite="stage-c-4-gpu-h200", labels=["megatron"],
                         disabled="fp8 kernel mismatch tracked in #77")
    """,
}


@pytest.fixture
def project(make_tree):
    root = make_tree(TREE)
    return root, discover(root, catalog=CATALOG, cache=False)


def _diff(*entries: str) -> bytes:
    return b"".join(e.encode() + b"\0" for e in entries)


def test_docs_only_change_skips_gpu_suites_and_runs_cpu_ones(project):
    _, discovery = project
    result = affected_suites(_diff("M", "README.md", "A", "docs/guide.rst"), CATALOG, discovery)
    assert set(result.skip) == GPU_SUITES
    assert set(result.run) == {"stage-a-cpu", "stage-b-cpu"}


def test_changed_test_file_selects_only_its_enabled_suites(project):
    _, discovery = project
    result = affected_suites(_diff("M", "tests/e2e/test_amd.py", "M", "README.md"), CATALOG, discovery)
    assert result.run == ["stage-c-4-gpu-mi350"]
    assert "stage-c-4-gpu-h200" in result.skip  # its registration there is disabled


def test_a_code_change_runs_everything(project):
    _, discovery = project
    result = affected_suites(_diff("M", "tests/e2e/test_amd.py", "M", "miles/core.py"), CATALOG, discovery)
    assert result.run == list(CATALOG.suites) and result.skip == {}
    assert "miles/core.py" in result.reason


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"", "empty"),
        (b"M\0README.md\0X\0", "cannot be read"),
        (b"\xff\xfe", "cannot be read"),
        (_diff("D", "tests/e2e/test_amd.py"), "not documentation or a registered test"),
        (_diff("R100", "scripts/run_x.py", "tests/e2e/test_amd.py"), "moved from scripts/run_x.py"),
    ],
)
def test_doubt_fails_open(project, raw, why):
    _, discovery = project
    result = affected_suites(raw, CATALOG, discovery)
    assert result.skip == {} and why in result.reason


def test_parses_real_git_output_with_renames(tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True).stdout

    git("init", "-q")
    (tmp_path / "a.md").write_text("a\n" * 20)
    (tmp_path / "b.py").write_text("b\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    (tmp_path / "docs").mkdir()
    git("mv", "a.md", "docs/a.md")
    (tmp_path / "b.py").write_text("c\n")
    git("add", "-A")
    changes = parse_name_status(git("diff", "--cached", "--name-status", "-z", "-M"))
    assert [(c.status, c.path, c.old_path) for c in changes] == [
        ("M", "b.py", None),
        ("R", "docs/a.md", "a.md"),
    ]


def test_affected_command_prints_run_and_skip(project, tmp_path, capsys):
    root, _ = project
    diff = tmp_path / "diff.bin"
    diff.write_bytes(_diff("M", "README.md"))
    assert main(["affected", "--root", str(root), "--diff", str(diff)]) == 0
    out = capsys.readouterr().out
    assert "skip  stage-c-4-gpu-mi350: documentation-only change" in out
    assert "run   stage-a-cpu" in out
