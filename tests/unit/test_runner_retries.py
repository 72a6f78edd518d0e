"""Which failures are retried, decided from the failing test's own exception.

Each row is a real test that pytest runs (one pytest process for the whole table, module
fixture); its JUnit case is classified on its own. The rows are the cases the old rule
(patterns over the whole output) got wrong, in both directions, and the ones it got right.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.running.outcome import classify_attempt, classify_case, is_retryable, read_junit

register_cpu_ci(est_time=3, suite="stage-a-cpu")

TABLE = {
    # ---- never retried: a real bug, whatever infra words are around it
    "keyerror_whose_line_mentions_enospc": (
        "test-failure",
        """
        codes = {}
        codes["ENOSPC"]  # the errno table lacks ENOSPC: No space left on device
        """,
    ),
    "hip_error_in_the_test_id": ("test-failure", 'raise RuntimeError("wrong output shape (4, 8)")'),
    "warning_of_another_passing_test_in_the_log": ("test-failure", 'raise ValueError("reward is negative")'),
    "rank0_assertion_then_rank1_nccl_exit": (
        "assertion",
        """
        raise RuntimeError(
            "torchrun failed:\\n[rank0]: AssertionError: logprob diff 0.31 > 0.05\\n"
            "[rank1]: NCCL error: remote process exited or there was a network error"
        )
        """,
    ),
    "assertion_with_nccl_words": ("assertion", 'assert False, "NCCL error: unhandled system error"'),
    "disk_full_printed_but_failing_on_a_value": (
        "test-failure",
        """
        print("OSError: [Errno 28] No space left on device")
        raise ValueError("bad config: lr must be > 0")
        """,
    ),
    "out_of_memory_next_to_a_hip_error": (
        "oom",
        'raise RuntimeError("HIP out of memory. Tried to allocate 2 GiB; HIP error: hipErrorOutOfMemory")',
    ),
    "import_error": ("import-error", "import numba_that_is_not_installed"),
    "typeerror_mentioning_connection_refused": (
        "test-failure",
        'raise TypeError("connect() got Connection refused as a keyword")',
    ),
    # ---- retried: the test's own exception is an infrastructure failure
    "plain_connection_refused_errno_111": (
        "infra:connection-refused",
        "raise ConnectionRefusedError(111, 'Connection refused')",
    ),
    "urllib_refusal": (
        "infra:connection-refused",
        """
        import socket, urllib.request
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5)
        """,
    ),
    "pytorch_error_802": (
        "infra:cuda-802",
        'raise RuntimeError("Unexpected error from cudaGetDeviceCount(). Did you run some cuda functions '
        'before calling NumCudaDevices() that might have already set an error? Error 802: system not yet initialized")',
    ),
    "nccl_init": (
        "infra:nccl-init",
        'raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error")',
    ),
    "rccl_remote_exit": (
        "infra:nccl-init",
        'raise RuntimeError("RCCL error: remote process exited or there was a network error")',
    ),
    "hip_runtime": ("infra:hip-runtime", 'raise RuntimeError("HIP error: hipErrorNoDevice")'),
    "disk_full_chained_under_a_save_error": (
        "infra:disk-full",
        """
        try:
            raise OSError(28, "No space left on device")
        except OSError as exc:
            raise RuntimeError("checkpoint save failed") from exc
        """,
    ),
    "connection_refused_while_handling_another": (
        "infra:connection-refused",
        """
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError:
            raise RuntimeError("sglang server did not come up")
        """,
    ),
}


def _source() -> str:
    out = [
        "import warnings, pytest",
        "from miles.ci.register import register_cpu_ci",
        'register_cpu_ci(est_time=5, suite="stage-b-cpu")',
        "",
        "def test_passes_with_a_warning():",
        '    warnings.warn("NCCL WARN Bootstrap : socket error, no space left on device (ENOSPC)")',
        "",
    ]
    for name, (_, body) in TABLE.items():
        if name == "hip_error_in_the_test_id":
            out.append('@pytest.mark.parametrize("case", ["hipErrorNoDevice"])')
            out.append(f"def test_{name}(case):")
        else:
            out.append(f"def test_{name}():")
        out.append(textwrap.indent(textwrap.dedent(body).strip(), "    "))
        out.append("")
    return "\n".join(out)


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("retries")
    (root / "tests").mkdir()
    (root / "tests" / "test_table.py").write_text(_source())
    junit = root / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "tests/test_table.py", f"--junitxml={junit}", "-o",
         "junit_family=xunit1", "-p", "no:cacheprovider", "-q"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    parsed = read_junit(junit)
    assert parsed.ok, parsed.problem
    return {c.name.removeprefix("test_").split("[")[0]: c for c in parsed.cases}


@pytest.mark.parametrize("name", list(TABLE))
def test_a_failure_is_classified_from_its_own_exception(cases, name):
    expected = TABLE[name][0]
    assert classify_case(cases[name]) == expected, cases[name]
    assert is_retryable(expected) == expected.startswith("infra:")


def test_the_warning_of_a_passing_test_does_not_count(cases):
    assert cases["passes_with_a_warning"].outcome == "passed"


def _attempt_of(*cases):
    from miles.ci.running.outcome import JUnitResult

    return classify_attempt(returncode=1, timed_out=False, cancelled_by=None, junit=JUnitResult(True, cases),
                            timeout=75.0, est_time=60.0)  # fmt: skip


def test_an_attempt_is_infrastructure_only_when_every_failing_test_is(cases):
    assert _attempt_of(cases["nccl_init"], cases["disk_full_chained_under_a_save_error"])[1].startswith(
        "infra:"
    )
    status, kind, message = _attempt_of(cases["nccl_init"], cases["rank0_assertion_then_rank1_nccl_exit"])
    assert (status, kind) == ("failed", "assertion") and "rank0_assertion" in message


def test_the_chain_keeps_exception_lines_and_drops_source_lines(cases):
    chain = cases["keyerror_whose_line_mentions_enospc"].chain
    assert "KeyError" in chain and "No space left" not in chain
    assert "No space left on device" in cases["disk_full_chained_under_a_save_error"].chain


def test_the_runner_marks_a_retried_pass_flaky_and_a_real_bug_failed(tmp_path):
    """End to end: an infra failure on attempt 1 is retried and reported flaky; an assertion
    beside NCCL noise is not retried, and the run fails."""
    from miles.ci.cli import main

    (tmp_path / "tests" / "e2e").mkdir(parents=True)
    head = "import os\nfrom miles.ci.register import register_cpu_ci\n"
    (tmp_path / "tests/e2e/test_flake.py").write_text(
        head + 'register_cpu_ci(est_time=1, suite="stage-b-cpu")\ndef test_f():\n'
        '    if os.environ["MILES_CI_ATTEMPT"] == "1":\n'
        '        raise ConnectionRefusedError(111, "Connection refused")\n'
    )
    (tmp_path / "tests/e2e/test_bug.py").write_text(
        head + 'register_cpu_ci(est_time=2, suite="stage-b-cpu")\ndef test_b():\n'
        '    print("NCCL error: remote process exited or there was a network error")\n'
        '    raise RuntimeError("[rank0]: AssertionError: loss went up")\n'
    )
    argv = ["run", "--root", str(tmp_path), "--suite", "stage-b-cpu", "--max-attempts", "2",
            "--continue-on-error", "--no-stream"]  # fmt: skip
    assert main(argv) == 1
    import json

    run = json.loads((tmp_path / ".miles/reports/stage-b-cpu-1of1/run.json").read_text())
    assert [(Path(a["file"]).name, a["attempt"], a["status"]) for a in run["attempts"]] == [
        ("test_flake.py", 1, "failed"),
        ("test_flake.py", 2, "flaky"),
        ("test_bug.py", 1, "failed"),
    ]
    assert run["counts"]["flaky"] == 1
    summary = (tmp_path / ".miles/reports/stage-b-cpu-1of1/summary.md").read_text()
    assert "### Flaky" in summary
