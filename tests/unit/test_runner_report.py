"""Reading pytest's JUnit, classifying outcomes, and rendering one run record three ways."""

from __future__ import annotations

import json
import re
import signal
import xml.etree.ElementTree as ET

import pytest

from miles.ci.register import register_cpu_ci
from miles.ci.reports.record import Attempt, CaseResult, Exclusion, RunRecord
from miles.ci.reports.report import render_junit, render_markdown, write_reports
from miles.ci.running.outcome import JUnitResult, classify_attempt, is_retryable, read_junit
from miles.metrics.gate import GateVerdict

register_cpu_ci(est_time=1, suite="stage-a-cpu")

JUNIT_FAILED = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite
 name="pytest" errors="0" failures="2" skipped="1" tests="4"><testcase classname="tests.e2e.test_a" name="test_ok"
 file="tests/e2e/test_a.py" line="1" time="0.5" /><testcase classname="tests.e2e.test_a" name="test_assert"
 file="tests/e2e/test_a.py" line="2" time="0.1"><failure message="assert 1 == 2">E   assert 1 == 2

tests/e2e/test_a.py:3: AssertionError</failure></testcase><testcase classname="tests.e2e.test_a"
 name="test_launch" file="tests/e2e/test_a.py" line="5" time="0.1"><failure
 message="subprocess.CalledProcessError: Command died">E   subprocess.CalledProcessError: Command died

tests/e2e/test_a.py:9: CalledProcessError</failure></testcase><testcase classname="tests.e2e.test_a"
 name="test_skip" file="tests/e2e/test_a.py" line="7" time="0"><skipped type="pytest.skip"
 message="needs 4 GPUs">skip</skipped></testcase></testsuite></testsuites>"""

JUNIT_COLLECTION_ERROR = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest"
 errors="1"><testcase classname="" name="tests.e2e.test_b" file="tests/e2e/test_b.py" time="0"><error
 message="collection failure">ImportError while importing test module '/x/tests/e2e/test_b.py'.
E   ModuleNotFoundError: No module named 'numba'</error></testcase></testsuite></testsuites>"""


def _junit(tmp_path, text: str) -> JUnitResult:
    path = tmp_path / "junit.xml"
    path.write_text(text)
    return read_junit(path)


def _classify(junit: JUnitResult, returncode: int | None = 1, **kw):
    args = dict(timed_out=False, cancelled_by=None, timeout=75.0, est_time=60.0)
    args.update(kw)
    return classify_attempt(returncode=returncode, junit=junit, **args)


def test_junit_cases_keep_file_line_outcome_and_exception_type(tmp_path):
    result = _junit(tmp_path, JUNIT_FAILED)
    assert result.ok
    by_name = {c.name: c for c in result.cases}
    assert by_name["test_ok"].outcome == "passed" and by_name["test_ok"].file == "tests/e2e/test_a.py"
    assert by_name["test_assert"].kind == "AssertionError" and by_name["test_assert"].line == 2
    assert by_name["test_launch"].kind == "CalledProcessError"
    assert by_name["test_skip"].outcome == "skipped" and by_name["test_skip"].message == "needs 4 GPUs"


def test_missing_or_corrupt_junit_is_an_error_not_a_pass(tmp_path):
    missing = read_junit(tmp_path / "absent.xml")
    assert _classify(missing, returncode=0)[:2] == ("error", "no-junit")
    corrupt = _junit(tmp_path, "<testsuites><testsuite")
    status, kind, message = _classify(corrupt, returncode=0)
    assert (status, kind) == ("error", "bad-junit") and "corrupt" in message


def test_assertion_failure_is_never_retried(tmp_path):
    junit = _junit(tmp_path, JUNIT_FAILED)
    status, kind, _ = _classify(junit)
    assert (status, kind) == ("failed", "assertion")
    assert not is_retryable(kind)


def test_import_error_is_never_retried(tmp_path):
    status, kind, message = _classify(_junit(tmp_path, JUNIT_COLLECTION_ERROR), returncode=2)
    assert kind == "import-error" and not is_retryable(kind)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ("RuntimeError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled system error", "infra:nccl-init"),
        (
            "torch.distributed.DistBackendError: RCCL error: remote process exited or there was a network error",
            "infra:nccl-init",
        ),
        ("RuntimeError: CUDA error: system not yet initialized (802)", "infra:cuda-802"),
        ("RuntimeError: HIP error: hipErrorNoDevice", "infra:hip-runtime"),
        (
            "requests.exceptions.ConnectionError: HTTPConnectionPool(host='127.0.0.1', port=30000): "
            "Failed to establish a new connection: [Errno 111] Connection refused",
            "infra:connection-refused",
        ),
        ("OSError: [Errno 28] No space left on device: '/tmp/ckpt'", "infra:disk-full"),
        ("ValueError: bad config", "test-failure"),
    ],
)
def test_infrastructure_patterns_on_the_failing_tests_own_exception(message, expected):
    kind = message.split(":", 1)[0].rsplit(".", 1)[-1]
    crashed = JUnitResult(True, (CaseResult("t", "c", "f.py", 1, 0.1, "failed", message, kind),))
    assert _classify(crashed)[1] == expected


def test_out_of_memory_is_never_retried_even_next_to_an_infra_pattern():
    message = (
        "torch.OutOfMemoryError: HIP out of memory. Tried to allocate 2 GiB; HIP error: hipErrorOutOfMemory"
    )
    crashed = JUnitResult(
        True, (CaseResult("t", "c", "f.py", 1, 0.1, "failed", message, "OutOfMemoryError"),)
    )
    kind = _classify(crashed)[1]
    assert kind == "oom" and not is_retryable(kind)


def test_a_signal_death_is_a_crash_named_after_the_signal():
    status, kind, message = _classify(
        JUnitResult(False, problem="x", problem_kind="no-junit"), returncode=-11
    )
    assert (status, kind) == ("failed", "crash") and "SIGSEGV" in message


def test_timeout_and_cancel_win_over_everything_else():
    empty = JUnitResult(False, problem="x", problem_kind="no-junit")
    assert _classify(empty, returncode=-signal.SIGKILL, timed_out=True)[0] == "timeout"
    assert _classify(empty, returncode=-signal.SIGTERM, cancelled_by="SIGTERM")[0] == "cancelled"


def _attempt(file: str, status: str, **kw) -> Attempt:
    base = dict(
        file=file,
        backend="cpu",
        suite="stage-b-cpu",
        lane="cpu",
        shard="1/1",
        attempt=1,
        status=status,
        exit_code=0 if status == "passed" else 1,
        signal=None,
        elapsed=2.0,
        est_time=3.0,
        retry_reason=None,
        classification=status if status != "failed" else "assertion",
        started_at=1000.0,
        commit="abc123",
    )
    base.update(kw)
    return Attempt(**base)


def _run() -> RunRecord:
    verdict = GateVerdict(
        "train/grad_norm", "last", "FAIL", True, "0.9 is above the band [0.1, 0.5]"
    ).to_json()
    flaky = _attempt(
        "tests/e2e/test_flaky.py", "failed", classification="infra:nccl-init", message="NCCL init"
    )
    return RunRecord(
        lane="cpu",
        backend="cpu",
        suites=("stage-b-cpu",),
        shard="1/1",
        cadence="regular",
        labels=None,
        commit="abc123",
        started_at=1000.0,
        finished_at=1010.0,
        attempts=(
            _attempt(
                "tests/e2e/test_train.py",
                "failed",
                classification="gate",
                message="metric gate failed",
                gate_verdicts=(verdict,),
                cases=(
                    CaseResult(
                        "test_train", "tests.e2e.test_train", "tests/e2e/test_train.py", 4, 1.5, "passed"
                    ),
                ),
            ),
            flaky,
            flaky.replace(
                attempt=2, status="passed", classification="passed", retry_reason="attempt 1: NCCL init"
            ),
            _attempt(
                "tests/e2e/test_later.py",
                "skipped",
                classification="fast-fail",
                elapsed=0.0,
                message="not run: fast-fail after tests/e2e/test_train.py ended failed",
            ),
        ),
        excluded=(
            Exclusion("tests/e2e/test_off.py", "stage-b-cpu", "disabled", "tokenizer download 404s, #42"),
        ),
    )


def test_run_record_round_trips_through_json():
    run = _run()
    back = RunRecord.from_json(json.loads(json.dumps(run.to_json())))
    assert back == run
    assert back.attempts[0].gate_verdicts[0]["message"] == "0.9 is above the band [0.1, 0.5]"
    assert back.exit_code == run.exit_code == 1


def test_junit_report_is_xunit1_with_file_and_gate_verdicts():
    root = ET.fromstring(render_junit(_run()))
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    train = suites["stage-b-cpu:tests/e2e/test_train.py"]
    assert train.get("file") == "tests/e2e/test_train.py"
    gate = [c for c in train.iter("testcase") if c.get("name") == "gate[train/grad_norm]"]
    assert gate[0].find("failure").get("message") == "FAIL: 0.9 is above the band [0.1, 0.5]"
    skipped = [c for c in suites["excluded"].iter("testcase")]
    assert "tokenizer download 404s" in skipped[0].find("skipped").get("message")
    assert root.get("failures") == "1" and root.get("skipped") == "2"  # the excluded test and the one not run


def test_markdown_has_failed_retried_disabled_gate_tables_and_a_gantt():
    text = render_markdown(_run())
    headings = ("### Failed", "### Retried", "### Not run", "### Disabled", "### Metric gates", "### Passed")
    for heading in (*headings, "```mermaid"):
        assert heading in text
    assert (
        "| `tests/e2e/test_train.py` | `train/grad_norm` | FAIL | 0.9 is above the band [0.1, 0.5] |" in text
    )
    assert "tests/e2e/test_flaky.py (attempt 2) :done" in text
    assert (
        "| `tests/e2e/test_later.py` | stage-b-cpu | not run: fast-fail after tests/e2e/test_train.py ended failed |"
        in text
    )


def test_reports_are_written_together_and_appended_to_the_step_summary(tmp_path, monkeypatch):
    summary = tmp_path / "step_summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    paths = write_reports(_run(), tmp_path / "reports")
    assert sorted(p.name for p in paths.values()) == ["junit.xml", "run.json", "summary.md"]
    assert json.loads(paths["run.json"].read_text())["attempts"][0]["gate_verdicts"][0]["status"] == "FAIL"
    assert summary.read_text() == paths["summary.md"].read_text()
    assert not list((tmp_path / "reports").glob(".*tmp"))


# ------------------------------------------------------------------ hostile text in reports

HOSTILE_TAIL = "\x1b[31mFAILED\x1b[0m x\x00y\x07z\x0bv\x0cw\x1bq\x1f\x7f and \ud800 lone surrogate\n"


def _hostile_run(file: str = "tests/e2e/test_a|b`c\nd.py") -> RunRecord:
    bad = _attempt(
        file,
        "failed",
        classification="test-failure",
        message="boom \x1b[1mbold\x1b[0m\x00",
        output_tail=HOSTILE_TAIL,
        cases=(CaseResult("test_\x08x", "tests.e2e", file, 1, 0.1, "failed", "E\x1b[0m \x02", "Error"),),
    )
    timeout = _attempt("tests/e2e/test_t.py", "timeout", classification="timeout", output_tail=HOSTILE_TAIL)
    return RunRecord("cpu", "cpu", ("stage-b-cpu",), "1/1", "regular", ("run-ci-amd",), "abc", 1000.0, 1010.0,
                     (bad, timeout))  # fmt: skip


def test_junit_is_valid_xml_whatever_the_output_held():
    text = render_junit(_hostile_run())
    root = ET.fromstring(text.encode("utf-8"))  # the standard library parser, no lxml
    failures = [el for el in root.iter() if el.tag in ("failure", "error")]
    assert failures
    body = "".join((el.text or "") + el.get("message", "") for el in failures)
    assert "\x1b" not in body and "\x00" not in body
    assert "FAILED" in body and "\\x00" in body and "\\x07" in body  # shown, not dropped


def test_junit_written_to_disk_parses_with_element_tree(tmp_path):
    write_reports(_hostile_run(), tmp_path)
    assert ET.parse(tmp_path / "junit.xml").getroot().get("failures") is not None


@pytest.mark.parametrize("file", ["tests/e2e/test_a|b.py", "tests/e2e/test_`x`.py", "tests/e2e/test_a\nb.py",
                                  "tests/e2e/test_<b>&.py", "tests/e2e/test_a:b#c;d.py"])  # fmt: skip
def test_markdown_tables_and_the_gantt_survive_any_file_name(file):
    text = render_markdown(_hostile_run(file))
    table = [ln for ln in text.splitlines() if ln.startswith("| ") and "test-failure" in ln]
    (row,) = table
    assert len(re.findall(r"(?<!\\)\|", row)) == 7  # still six cells: no raw '|' from the name
    assert all("<b>" not in ln for ln in text.splitlines() if "<summary>" in ln)  # HTML is escaped
    gantt = text.split("```mermaid", 1)[1].split("```", 1)[0]
    for line in gantt.splitlines()[4:]:
        if line.strip().startswith("section"):
            continue
        name, _, rest = line.strip().partition(" :")
        assert not any(c in name for c in ":#;`\n"), line
    assert "\x1b" not in text and "\x00" not in text


def test_a_file_name_cannot_inject_a_workflow_command_into_the_github_log():
    import io

    from miles.ci.running.execute import TestRun
    from miles.ci.running.progress import Progress

    out = io.StringIO()
    progress = Progress((), out, github=True, streaming=False)
    run = TestRun("tests/e2e/test_a\n::warning::pwned.py", "cpu", "stage-b-cpu", "cpu", "1/1", 1.0, 60.0)
    progress.start(0, run)
    progress.finish(0, _attempt(run.file, "failed", message="x\n::error::also"))
    assert [ln for ln in out.getvalue().splitlines() if ln.startswith("::") and not ln.startswith("::group::")
            and not ln.startswith("::endgroup::")] == []  # fmt: skip
