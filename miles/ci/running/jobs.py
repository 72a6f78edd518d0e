"""A run with several jobs: runner processes side by side, taking files from one queue.

`python -m miles.ci run --jobs N` (or a lane whose catalog entry says `jobs`) starts N runners
side by side. Each walks the run's whole list of files (each suite's in turn, longest first in a
run that goes on after a failure) and runs a file only once it has taken it from the run's
claims folder (miles.ci.running.claims), so a job that finishes a file takes the next one nobody
has taken: no job idles while another still has a fixed share to work through. Each is a whole
runner: its own containment and child subreaper, retries, gates, durations and reports (in the
run's attempts/job-<j>/), so nothing one job does can sweep the other's processes. A job that
fails a file in a fast-fail run takes every file left and records it skipped, so the others
stop too. This process prints the plan, relays each job's progress lines prefixed with `[j/N]`,
passes SIGTERM/SIGINT on, and merges the jobs' records into the run's reports: each file from
the record of the job that took it; the files of a job that ended without a record, and those
no job took, as not finished. The jobs share the run's tiny-checkpoint cache.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO

from miles.ci.reports.record import CANCELLED, RunRecord
from miles.ci.running.claims import claim_name, owners
from miles.ci.running.execute import POLL_S, CancelToken
from miles.ci.running.plan import RunOptions, RunPlan, test_run
from miles.files import Folder, read_regular

MAX_RECORD_BYTES = 256 << 20
MAX_LINE_BYTES = 64 << 10  # a longer line (one without a newline, however long) is relayed in pieces
CLAIMS = "claims"  # the run's claims folder, in its attempts/ folder


def job_argv(options: RunOptions, plan: RunPlan, job: int, report_dir: Path, claims: Path) -> list[str]:
    """The command line of job `job` (1-based): this run's options, taking files from `claims`."""
    argv = [sys.executable, "-m", "miles.ci", "run", "--root", str(plan.settings.root)]
    if options.lane:
        argv += ["--lane", options.lane]
    if options.backend:
        argv += ["--backend", options.backend]
    for suite in options.suites:
        argv += ["--suite", suite]
    for flag, value in (("--cadence", options.cadence), ("--labels", options.labels)):
        if value is not None:
            argv += [flag, value]
    argv += ["--max-attempts", str(plan.max_attempts), "--timeout-floor", repr(options.timeout_floor)]
    argv += ["--grace", repr(options.grace), "--jobs", "1", "--claims", str(claims)]
    argv += ["--report-dir", str(report_dir), "--job-of", f"{job}/{plan.jobs}"]
    argv += ["--stream" if plan.settings.echo is not None else "--no-stream"]
    argv += ["--continue-on-error"] if plan.continue_on_error else []
    for arg in options.pytest_args:
        argv += [f"--pytest-arg={arg}"]
    return argv


def run_jobs(
    options: RunOptions, plan: RunPlan, attempts: Folder, cancel: CancelToken, out: IO[str]
) -> RunRecord:
    """Start the plan's jobs, relay their output, wait for them and merge their records."""
    started = time.time()
    env = {k: v for k, v in plan.settings.base_env.items() if k != "GITHUB_STEP_SUMMARY"}  # the run's own
    lock = threading.Lock()
    procs, readers, folders = [], [], []
    attempts.subfolder(CLAIMS, exclusive=True).close()
    claims = attempts.path / CLAIMS
    for job in range(1, plan.jobs + 1):
        folder = attempts.path / f"job-{job}"
        folders.append(folder)
        proc = subprocess.Popen(
            job_argv(options, plan, job, folder, claims),
            cwd=plan.settings.root,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a signal reaches a job through this process, once
        )
        reader = threading.Thread(
            target=_relay, args=(proc.stdout, f"[{job}/{plan.jobs}] ", out, lock), daemon=True
        )
        reader.start()
        procs.append(proc)
        readers.append(reader)
    _wait(procs, cancel)
    for reader in readers:
        reader.join(timeout=5)
    return merge(plan, [_record(f / "run.json") for f in folders], procs, started, cancel, owners(claims))


def _relay(stream: IO[bytes], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for raw in iter(lambda: stream.readline(MAX_LINE_BYTES), b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _wait(procs: list[subprocess.Popen], cancel: CancelToken) -> None:
    """Until every job has ended; each signal the run gets is passed on to every job once."""
    passed = 0
    while any(p.poll() is None for p in procs):
        if cancel.count > passed:
            passed = cancel.count
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.kill(proc.pid, cancel.signal or signal.SIGTERM)
                    except ProcessLookupError:
                        pass
        time.sleep(POLL_S)


def _record(path: Path) -> RunRecord | None:
    import json

    try:
        return RunRecord.from_json(json.loads(read_regular(path, MAX_RECORD_BYTES, follow=False)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def merge(
    plan: RunPlan,
    records: list[RunRecord | None],
    procs: list[subprocess.Popen],
    started: float,
    cancel: CancelToken,
    taken: Mapping[str, int],
) -> RunRecord:
    """One record of the run: each file's attempts from the record of the job that took it
    (`taken`: claim name -> job, miles.ci.running.claims.owners), in the order they started; a
    file whose job left no record, or that no job took, as not finished."""
    attempts, excluded, complete = [], (), True
    refused = {(r.suite, r.file) for r in plan.refused}
    for job, record in enumerate(records, start=1):
        if record is None:
            complete = False
            continue
        # a job's record may hold the rest of the queue as not started (a report written while it
        # ran): those rows are the taker's, not this job's
        attempts += [
            a for a in record.attempts
            if taken.get(claim_name(a.suite, a.file)) == job or (job == 1 and (a.suite, a.file) in refused)
        ]  # fmt: skip
        excluded = excluded or record.excluded
        complete = complete and record.complete
    recorded = {(a.suite, a.file) for a in attempts}
    dead = [
        f"job {j}/{plan.jobs} (exit code {p.returncode})"
        for j, (r, p) in enumerate(zip(records, procs, strict=True), 1)
        if r is None
    ]
    for test in plan.tests:
        reg = test.registration
        if (reg.suite, reg.file) in recorded:
            continue
        complete = False
        job = taken.get(claim_name(reg.suite, reg.file))
        if job:
            reason = f"not finished: job {job}/{plan.jobs} took it and ended (exit code {procs[job - 1].returncode}) without a report"
        else:
            reason = f"not finished: no job took it; {', '.join(dead) or 'every job'} ended without a report"
        attempts.append(test_run(plan, test, 1, None, "").record(CANCELLED, "cancelled", message=reason))
    first = next((r for r in records if r is not None), None)
    sel = plan.selection
    return RunRecord(
        lane=first.lane if first else (sel.scope.lane.name if sel.scope.lane else ""),
        backend=sel.scope.backend,
        suites=tuple(sp.suite.name for sp in plan.suites),
        shard=plan.shard,
        cadence=sel.cadence,
        labels=None if sel.labels is None else sel.labels.raw,
        commit=first.commit if first else "",
        started_at=started,
        finished_at=time.time(),
        attempts=tuple(sorted(attempts, key=lambda a: a.started_at)),
        excluded=excluded or sel.excluded,
        cancelled_by=cancel.name or next((r.cancelled_by for r in records if r and r.cancelled_by), None),
        report_dir=str(plan.report_dir),
        complete=complete,
        predicted=plan.predicted_wall,
    )
