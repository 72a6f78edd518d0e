"""What happened in one attempt: read from its exit status and its JUnit file, and
classified so the runner knows whether a retry may help.

Retries are for infrastructure only, and the evidence is each failing test's own
exception: its type, its message and the exceptions chained to it (the `E` lines of the
JUnit failure), never the rest of the output, where another test's warning, a test id or
another rank's message can say anything. An attempt is `infra:<name>` only when every
failing test is: no AssertionError, import error or out-of-memory anywhere in its chain,
its exception not a programming error (KeyError, TypeError, ...), and one of INFRA_PATTERNS
in its chain (or a ConnectionRefusedError). Everything else, and every crash, timeout or
missing JUnit, is never retried: running it again costs a runner and hides a real failure.
"""

from __future__ import annotations

import os
import re
import signal
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from miles.ci.reports.record import CANCELLED, ERROR, FAILED, PASSED, TIMEOUT, CaseResult
from miles.files import FileRefused, read_regular

_KIND_AT_END = re.compile(r"^\S+:\d+: ([A-Za-z_][\w.]*)$")
_KIND_E_LINE = re.compile(r"^E\s+([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))\b")
_KIND_PREFIX = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception)):")
_E_LINE = re.compile(r"^E\s{1,8}(.*)$")
_CHAIN_LIMIT = 4000


@dataclass(frozen=True)
class JUnitResult:
    ok: bool
    cases: tuple[CaseResult, ...] = ()
    problem: str = ""
    problem_kind: str = ""  # no-junit | bad-junit


MAX_JUNIT_BYTES = 64 << 20


def read_junit(path: Path) -> JUnitResult:
    """The test cases of one pytest JUnit file, or why it cannot be trusted. The file is the
    test's to write, so only a regular file (not a link, FIFO or device) of at most
    MAX_JUNIT_BYTES is read."""
    if not os.path.lexists(path):
        return JUnitResult(False, problem="pytest wrote no JUnit file", problem_kind="no-junit")
    try:
        root = ET.fromstring(read_regular(path, MAX_JUNIT_BYTES, follow=False, what="the JUnit file"))
    except FileRefused as exc:
        return JUnitResult(False, problem=str(exc), problem_kind="bad-junit")
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
        outcome, message, kind, chain = "passed", "", "", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (child.get("message") or "").strip().splitlines()[0:1]
                message = message[0] if message else ""
                if tag != "skipped":
                    kind = _exception_kind(message, child.text or "")
                    chain = exception_chain(child.text or "")
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
                chain=chain,
            )
        )
    return JUnitResult(True, tuple(cases))


def exception_chain(text: str) -> str:
    """The exceptions of a pytest failure, as text: the `E` lines (each exception's message,
    chained ones included) and the `path:line: Type` line that ends each traceback. Source
    lines, locals and captured output are left out."""
    kept = []
    for line in text.splitlines():
        match = _E_LINE.match(line)
        if match:
            kept.append(match.group(1))
        elif _KIND_AT_END.match(line.strip()):
            kept.append(line.strip().rsplit(": ", 1)[-1])
    return "\n".join(kept)[-_CHAIN_LIMIT:]


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
        re.compile(
            r"CUDA error[^\n]*(?:\b802\b|system not yet initiali[sz]ed)|cudaErrorSystemNotReady"
            r"|\bError 802\b|system not yet initiali[sz]ed"
        ),
    ),
    ("hip-runtime", re.compile(r"\bHIP error\b|\bhipError[A-Z]\w*|HSA_STATUS_ERROR\w*")),
    ("connection-refused", re.compile(r"Connection refused|\bECONNREFUSED\b|\[Errno 111\]", re.IGNORECASE)),
    ("disk-full", re.compile(r"No space left on device|\bENOSPC\b|\[Errno 28\]")),
)
# A failing test whose own exception is one of these is a bug in the code, whatever its
# message says (a KeyError('ENOSPC') is a lookup, not a full disk).
PROGRAMMING_ERRORS = frozenset(
    """KeyError IndexError LookupError AttributeError TypeError NameError UnboundLocalError
    ZeroDivisionError NotImplementedError SyntaxError IndentationError RecursionError
    AssertionError ImportError ModuleNotFoundError""".split()
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


def classify_case(case: CaseResult) -> str:
    """oom | import-error | assertion | infra:<name> | test-failure, from the case's own
    exception chain only."""
    text = f"{case.kind}: {case.message}\n{case.chain}"
    if OOM_PATTERN.search(text):
        return "oom"
    if case.kind in ("ImportError", "ModuleNotFoundError") or IMPORT_PATTERN.search(case.message):
        return "import-error"
    if case.kind == "AssertionError" or re.search(r"\bAssertionError\b", text):
        return "assertion"  # even beside another rank's NCCL error: the real failure is here
    if case.kind in PROGRAMMING_ERRORS:
        return "test-failure"
    for name, pattern in INFRA_PATTERNS:
        if pattern.search(text):
            return f"infra:{name}"
    if case.kind == "ConnectionRefusedError":
        return "infra:connection-refused"
    return "test-failure"


# When the failing tests disagree, the most telling class wins; infra only if all are.
_PRECEDENCE = ("oom", "import-error", "assertion", "test-failure")


def classify_attempt(
    *,
    returncode: int | None,
    timed_out: bool,
    cancelled_by: str | None,
    junit: JUnitResult,
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
            f"timed out after {timeout:g}s counted at the machine's load (its est_time: {est_time:g}s): a hung "
            "test, or one slower than its est_time says; `python -m miles.ci calibrate --write` sets est_time "
            "from its measured runs",
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
    if not failing:
        return FAILED, "test-failure", PYTEST_EXIT.get(returncode or 0, f"exit code {returncode}")
    verdicts = [classify_case(c) for c in failing]
    chosen = next((v for v in _PRECEDENCE if v in verdicts), verdicts[0])
    first = failing[verdicts.index(chosen)]
    detail = f"{first.classname}::{first.name}: {first.message}"
    if chosen == "oom":
        return FAILED, "oom", f"out of memory: {detail}"
    if chosen.startswith("infra:"):
        return FAILED, chosen, f"infrastructure ({chosen[6:]}): {detail}"
    return FAILED, chosen, detail
