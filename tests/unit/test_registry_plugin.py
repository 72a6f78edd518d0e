"""The pytest plugin runs a file only where it is registered and says why it skipped the rest."""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-a-cpu")

HEADER = "from miles.ci.register import register_cpu_ci, register_cuda_ci, register_rocm_ci\n"


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeini("[pytest]\n")
    pytester.makeconftest('pytest_plugins = ("miles.ci.pytest_plugin",)\n')
    return pytester


def _write(pytester: pytest.Pytester, rel: str, source: str) -> None:
    path = pytester.path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)


GPU_ONLY = (
    HEADER
    + "import gpu_stack_that_is_not_installed\n"
    + 'register_rocm_ci(est_time=60, suite="stage-c-4-gpu-mi350", labels=["amd"])\n'
    + 'register_cuda_ci(est_time=60, suite="stage-c-4-gpu-h200", labels=["megatron"])\n'
    + "def test_needs_gpu():\n    pass\n"
)


def test_gpu_only_file_is_skipped_without_import_and_names_the_hardware(project, monkeypatch):
    monkeypatch.delenv("MILES_CI_BACKEND", raising=False)
    _write(project, "tests/e2e/test_gpu.py", GPU_ONLY)
    result = project.runpytest("-rs", "tests")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*4x mi350 (rocm: stage-c-4-gpu-mi350) or 4x h200 (cuda: stage-c-4-gpu-h200)*"]
    )


def test_cpu_registered_and_unit_files_run(project, monkeypatch):
    monkeypatch.delenv("MILES_CI_BACKEND", raising=False)
    _write(
        project,
        "tests/e2e/test_cpu.py",
        HEADER + 'register_cpu_ci(est_time=5, suite="stage-b-cpu")\n'
        "def test_runs():\n    assert 1 + 1 == 2\n",
    )
    _write(project, "tests/unit/test_fast.py", "def test_runs():\n    assert True\n")
    project.runpytest("tests").assert_outcomes(passed=2)


def test_runner_backend_makes_the_gpu_file_run(project, monkeypatch):
    monkeypatch.setenv("MILES_CI_BACKEND", "rocm")
    _write(project, "tests/e2e/test_gpu.py", GPU_ONLY)
    result = project.runpytest("tests")
    result.assert_outcomes(errors=1)  # imported for real now, and the GPU stack is absent here
    result.stdout.fnmatch_lines(["*gpu_stack_that_is_not_installed*"])


def test_broken_registration_is_a_collection_error_with_discoverys_message(project):
    _write(
        project,
        "tests/e2e/test_bad.py",
        HEADER + 'register_rocm_ci(est_time=5, suite="stage-c-4-gpu-mi300x", labels=["amd"])\n',
    )
    result = project.runpytest("tests")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*tests/e2e/test_bad.py:2: register_rocm_ci: suite 'stage-c-4-gpu-mi300x'*"])


def test_file_disabled_on_this_backend_is_skipped_with_its_reason(project, monkeypatch):
    monkeypatch.delenv("MILES_CI_BACKEND", raising=False)
    _write(
        project,
        "tests/e2e/test_off.py",
        HEADER
        + 'register_cpu_ci(est_time=5, suite="stage-b-cpu", disabled="gloo barrier deadlocks, see #77")\n'
        "def test_x():\n    pass\n",
    )
    result = project.runpytest("-rs", "tests")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*disabled on cpu (stage-b-cpu): gloo barrier deadlocks, see #77*"])


def test_files_run_longest_registered_first_under_xdist_too(project, monkeypatch):
    # pytest-xdist's loadfile would hand out the three-test file first (most tests first) and the
    # long one-test file last; the plugin orders files by est_time and turns that reorder off.
    monkeypatch.delenv("MILES_CI_BACKEND", raising=False)
    _write(project, "tests/unit/test_many.py", "".join(f"def test_{i}():\n    pass\n" for i in range(3)))
    _write(
        project,
        "tests/e2e/test_long.py",
        HEADER + 'register_cpu_ci(est_time=300, suite="stage-b-cpu")\ndef test_trains():\n    pass\n',
    )
    collected = project.runpytest("--collect-only", "-q", "tests")
    ids = [line for line in collected.outlines if "::" in line]
    assert ids[0] == "tests/e2e/test_long.py::test_trains" and len(ids) == 4, ids
    ran = project.runpytest("-n", "1", "--dist", "loadfile", "-v", "tests")
    ran.assert_outcomes(passed=4)
    order = [line.split()[-1] for line in ran.outlines if line.startswith("[gw0]") and "PASSED" in line]
    assert order[0] == "tests/e2e/test_long.py::test_trains", ran.outlines
