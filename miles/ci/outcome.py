"""What happened in one attempt: read from its exit status, its JUnit file and the tail of
its output, and classified so the runner knows whether a retry may help.

Retries are for infrastructure only. An attempt is `infra:<name>` when it failed (not by a
signal, not by timeout), no failing test raised AssertionError, no import failed, nothing
ran out of memory, and one of INFRA_PATTERNS matches the tail of its output or a failing
test's message. Everything else (assertions, import errors, out-of-memory, crashes,
timeouts) is never retried: running it again costs a runner and hides a real failure.
"""

from __future__ import annotations

import re
import signal
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from miles.ci.record import CANCELLED, ERROR, FAILED, PASSED, TIMEOUT, CaseResult

_KIND_AT_END = re.compile(r"^\S+:\d+: ([A-Za-z_][\w.]*)$")
_KIND_E_LINE = re.compile(r"^E\s+([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))\b")
_KIND_PREFIX = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)):")


@dataclass(frozen=True)
class JUnitResult:
    ok: bool
    cases: tuple[CaseResult, ...] = ()
    problem: str = ""
    problem_kind: str = ""  # no-junit | bad-junit


def read_junit(path: Path) -> JUnitResult:
    """The test cases of one pytest JUnit file, or why it cannot be trusted."""
    if not path.is_file():
        return JUnitResult(False, problem="pytest wrote no JUnit file", problem_kind="no-junit")
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        return JUnitResult(False, problem=f"the JUnit file is corrupt ({exc})", problem_kind="bad-junit")
    if root.tag not in ("testsuites", "testsuite"):
        return JUnitResult(
            False,
            problem=f"the JUnit file's root is <{root.tag}>, not <testsuites>",
            problem_kind="bad-junit",
        )
    cases = []
    for case in root.iter("testcase"):
        outcome, message, kind = "passed", "", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or "").strip().splitlines()[0:1]
                message = message[0] if message else ""
                kind = _exception_kind(message, child.text or "") if tag != "skipped" else ""
                break
        try:
            line = int(case.get("line")) if case.get("line") else None
            seconds = float(case.get("time") or 0.0)
        except ValueError:
            return JUnitResult(
                False, problem="the JUnit file has a malformed testcase", problem_kind="bad-junit"
            )
        cases.append(
            CaseResult(
                name=case.get("name", ""),
                classname=case.get("classname", ""),
                file=case.get("file", ""),
                line=line,
                time=seconds,
                outcome=outcome,
                message=message,
                kind=kind,
            )
        )
    return JUnitResult(True, tuple(cases))


def _exception_kind(message: str, text: str) -> str:
    """The exception type pytest reported: from the traceback's last line, an `E` line, or
    the message ("assert ..." messages are AssertionError)."""
    lines = [ln.rstrip() for ln in text.strip().splitlines() if ln.strip()]
    if lines:
        match = _KIND_AT_END.match(lines[-1])
        if match:
            return match.group(1).rsplit(".", 1)[-1]
    for line in reversed(lines):
        match = _KIND_E_LINE.match(line)
        if match:
            return match.group(1).rsplit(".", 1)[-1]
    if message.startswith("assert"):
        return "AssertionError"
    match = _KIND_PREFIX.match(message)
    return match.group(1).rsplit(".", 1)[-1] if match else ""


def signal_name(returncode: int | None) -> str | None:
    """The signal that killed a process with this return code (SIGSEGV, ...), else None."""
    if returncode is None or returncode >= 0:
        return None
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


# Infrastructure failures worth one more attempt, matched on the output tail. Keep this
# list short and specific: a pattern that matches a real bug turns it into a flake.
INFRA_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "nccl-init",
        re.compile(
            r"(?:NCCL|RCCL) error[^\n]*(?:unhandled system error|remote process exited|socket|bootstrap)"
            r"|nccl(?:System|Remote|Internal)Error|(?:NCCL|RCCL) (?:WARN|INFO)[^\n]*Bootstrap[^\n]*(?:fail|error)"
            r"|Failed to initiali[sz]e (?:NCCL|RCCL)",
            re.IGNORECASE,
        ),
    ),
    (
        "cuda-802",
        re.compile(r"CUDA error[^\n]*(?:\b802\b|system not yet initiali[sz]ed)|cudaErrorSystemNotReady"),
    ),
    ("hip-runtime", re.compile(r"\bHIP error\b|\bhipError[A-Z]\w*|HSA_STATUS_ERROR\w*")),
    (
        "local-port-refused",
        re.compile(
            r"^(?=[^\n]*(?:127\.0\.0\.1|localhost|\[?::1\]?:\d))[^\n]*"
            r"(?:Connection refused|ECONNREFUSED|Errno 111)[^\n]*$",
            re.IGNORECASE | re.MULTILINE,
        ),
    ),
    ("disk-full", re.compile(r"No space left on device|\bENOSPC\b|\[Errno 28\]")),
)
# Never retried, and checked first: the same error would come back.
OOM_PATTERN = re.compile(
    r"out of memory|OutOfMemoryError|\bMemoryError\b|hipErrorOutOfMemory|cudaErrorMemoryAllocation",
    re.IGNORECASE,
)
IMPORT_PATTERN = re.compile(r"ImportError while importing test module|\b(?:ModuleNotFound|Import)Error\b")
CRASH_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT"})
PYTEST_EXIT = {2: "interrupted or collection failed", 3: "pytest internal error", 4: "pytest usage error"}


def is_retryable(classification: str) -> bool:
    return classification.startswith("infra:")


def classify_attempt(
    *,
    returncode: int | None,
    timed_out: bool,
    cancelled_by: str | None,
    junit: JUnitResult,
    tail: str,
    timeout: float,
    est_time: float,
) -> tuple[str, str, str]:
    """(status, classification, one-line message) of a finished attempt."""
    if cancelled_by:
        return CANCELLED, "cancelled", f"stopped: the run was cancelled by {cancelled_by}"
    if timed_out:
        return (
            TIMEOUT,
            "timeout",
            f"timed out after {timeout:g}s (est_time {est_time:g}s x 1.25, or the floor)",
        )
    sig = signal_name(returncode)
    if sig is not None:
        if sig in CRASH_SIGNALS:
            return FAILED, "crash", f"crashed with {sig}"
        if sig == "SIGKILL":
            return (
                FAILED,
                "killed",
                "killed by SIGKILL from outside the runner (often the kernel's OOM killer)",
            )
        return FAILED, "killed", f"killed by {sig} from outside the runner"
    if not junit.ok:
        return ERROR, junit.problem_kind, f"{junit.problem} (exit code {returncode}); see the output tail"
    failing = [c for c in junit.cases if c.outcome in ("failed", "error")]
    if returncode == 0 and not failing:
        return PASSED, "passed", ""
    if returncode == 5:
        return FAILED, "no-tests", "pytest collected no tests from this file"
    text = tail + "\n" + "\n".join(f"{c.kind}: {c.message}" for c in failing)
    first = failing[0] if failing else None
    where = f"{first.classname}::{first.name}: " if first else ""
    detail = (
        f"{where}{first.message}" if first else PYTEST_EXIT.get(returncode or 0, f"exit code {returncode}")
    )
    if OOM_PATTERN.search(text):
        return FAILED, "oom", f"out of memory: {detail}"
    if any(c.kind in ("ImportError", "ModuleNotFoundError") for c in failing) or IMPORT_PATTERN.search(text):
        return FAILED, "import-error", detail
    if any(c.kind == "AssertionError" for c in failing):
        return FAILED, "assertion", detail
    for name, pattern in INFRA_PATTERNS:
        if pattern.search(text):
            return FAILED, f"infra:{name}", f"infrastructure ({name}): {detail}"
    return FAILED, "test-failure", detail
