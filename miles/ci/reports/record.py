"""The run record: one frozen `Attempt` per execution of a test file, and the `RunRecord` of a
whole invocation of the runner.

Records flow one way: the executor produces attempts, the runner collects them into a run
record, and the renderers (miles.ci.reports.report), the duration store and calibration only read
them. JSON round-trips exactly, so a stored `run.json` is as good as the live record.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SCHEMA = 3  # 2: attempts name the processes they stopped; `flaky`; `complete`. 3: `phases`

# Attempt statuses. `error` means the runner could not tell what happened (no or corrupt
# JUnit); `skipped` means the test was selected but not started (fast-fail); `flaky` is a
# passing attempt that follows a failed one (an infrastructure failure, retried).
PASSED, FAILED, TIMEOUT, CANCELLED, SKIPPED, ERROR, FLAKY = (
    "passed",
    "failed",
    "timeout",
    "cancelled",
    "skipped",
    "error",
    "flaky",
)
STATUSES = (PASSED, FLAKY, FAILED, TIMEOUT, CANCELLED, SKIPPED, ERROR)
BAD_STATUSES = frozenset({FAILED, TIMEOUT, CANCELLED, ERROR})


@dataclass(frozen=True)
class CaseResult:
    """One pytest test case of an attempt, as its JUnit file reported it."""

    name: str
    classname: str
    file: str
    line: int | None
    time: float
    outcome: str  # passed | failed | error | skipped
    message: str = ""  # first line of the failure, error or skip reason
    kind: str = ""  # exception type pytest named (AssertionError, ImportError, ...)
    chain: str = ""  # the failure's exceptions, chained ones included (outcome.exception_chain)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CaseResult:
        return cls(**data)


@dataclass(frozen=True)
class Attempt:
    """One execution of one test file; a retried file has one record per attempt."""

    file: str
    backend: str
    suite: str
    lane: str
    shard: str  # "k/N"
    attempt: int  # 1-based
    status: str  # one of STATUSES
    exit_code: int | None  # None when the process never ran or died of a signal
    signal: str | None  # e.g. "SIGSEGV" when the process died of a signal
    elapsed: float  # seconds, wall clock
    est_time: float
    retry_reason: str | None  # why this attempt follows a failed one (None on the first)
    classification: str  # passed, assertion, import-error, oom, crash, timeout, infra:<pattern>, ...
    # GateVerdict.to_json() of each declared gate (metric, status, message, ...), filled by the
    # gate step: JSON from the start, so a record read back from run.json equals the live one
    gate_verdicts: tuple[dict, ...] = ()
    commit: str = ""
    output_tail: str = ""
    record_dir: str = ""  # MILES_CI_GATE_RECORD_DIR of this attempt
    started_at: float = 0.0  # unix time
    timeout: float = 0.0  # the limit this attempt ran under, seconds
    message: str = ""  # one line a person reads first: why it failed, or why it did not run
    cases: tuple[CaseResult, ...] = ()
    killed: tuple[str, ...] = ()  # processes the runner stopped ("pid 12 (sleep 600)")
    # seconds per phase (miles.ci.reports.phases.COLUMNS), as the attempt's processes recorded them
    phases: tuple[tuple[str, float], ...] = ()
    # CPU seconds (user + system) of the attempt's processes that ended and were reaped: the
    # work a file costs, which a busy machine stretches far less than its wall time
    cpu: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status not in BAD_STATUSES

    @property
    def finished_at(self) -> float:
        return self.started_at + self.elapsed

    def replace(self, **changes: Any) -> Attempt:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["gate_verdicts"] = [dict(v) for v in self.gate_verdicts]
        data["cases"] = [c.to_json() for c in self.cases]
        data["killed"] = list(self.killed)
        data["phases"] = dict(self.phases)
        return data

    @classmethod
    def from_json(cls, data: dict) -> Attempt:
        data = dict(data)
        data["gate_verdicts"] = tuple(data.get("gate_verdicts", ()))
        data["cases"] = tuple(CaseResult.from_json(c) for c in data.get("cases", ()))
        data["killed"] = tuple(data.get("killed", ()))
        data["phases"] = tuple((str(k), float(v)) for k, v in dict(data.get("phases") or {}).items())
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Exclusion:
    """A registration of the selected suites that this run does not execute, and why."""

    file: str
    suite: str
    kind: str  # disabled | nightly | labels
    reason: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Exclusion:
        return cls(**data)


@dataclass(frozen=True)
class RunRecord:
    """Everything one invocation of the runner did, in the order it did it."""

    lane: str
    backend: str
    suites: tuple[str, ...]
    shard: str  # "k/N", or "all" when every shard ran in this invocation
    cadence: str
    labels: tuple[str, ...] | None  # None: no PR labels given, every labelled test admitted
    commit: str
    started_at: float
    finished_at: float
    attempts: tuple[Attempt, ...]
    excluded: tuple[Exclusion, ...] = ()
    cancelled_by: str | None = None  # signal name when the run itself was cancelled
    report_dir: str = ""
    complete: bool = True  # False in the reports written while the run is still going
    # the plan's predicted wall time (its jobs side by side, or its shards one after another);
    # None in records written before it was kept
    predicted: float | None = None

    @property
    def flaky(self) -> tuple[Attempt, ...]:
        return tuple(a for a in self.final_attempts if a.status == FLAKY)

    @property
    def final_attempts(self) -> tuple[Attempt, ...]:
        """The last attempt of every (suite, file), in the order the files first ran."""
        last: dict[tuple[str, str], Attempt] = {}
        for a in self.attempts:
            last[(a.suite, a.file)] = a
        return tuple(last.values())

    @property
    def retried(self) -> tuple[Attempt, ...]:
        return tuple(a for a in self.attempts if a.attempt > 1)

    @property
    def passed(self) -> bool:
        return self.complete and self.cancelled_by is None and all(a.ok for a in self.final_attempts)

    @property
    def exit_code(self) -> int:
        return 0 if self.passed else 1

    def counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        for a in self.final_attempts:
            counts[a.status] += 1
        counts["disabled"] = sum(1 for e in self.excluded if e.kind == "disabled")
        counts["retried"] = len({(a.suite, a.file) for a in self.retried})
        return counts

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "lane": self.lane,
            "backend": self.backend,
            "suites": list(self.suites),
            "shard": self.shard,
            "cadence": self.cadence,
            "labels": None if self.labels is None else list(self.labels),
            "commit": self.commit,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "cancelled_by": self.cancelled_by,
            "report_dir": self.report_dir,
            "complete": self.complete,
            "predicted": self.predicted,
            "passed": self.passed,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "attempts": [a.to_json() for a in self.attempts],
            "excluded": [e.to_json() for e in self.excluded],
        }

    @classmethod
    def from_json(cls, data: dict) -> RunRecord:
        labels = data.get("labels")
        return cls(
            lane=data["lane"],
            backend=data["backend"],
            suites=tuple(data["suites"]),
            shard=data["shard"],
            cadence=data["cadence"],
            labels=None if labels is None else tuple(labels),
            commit=data.get("commit", ""),
            started_at=data["started_at"],
            finished_at=data["finished_at"],
            attempts=tuple(Attempt.from_json(a) for a in data["attempts"]),
            excluded=tuple(Exclusion.from_json(e) for e in data.get("excluded", ())),
            cancelled_by=data.get("cancelled_by"),
            report_dir=data.get("report_dir", ""),
            complete=data.get("complete", True),
            predicted=data.get("predicted"),
        )
