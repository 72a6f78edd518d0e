"""Planning a run: which tests of which suites run in this shard, with what timeouts.

Planning reads only the catalog and the tests' syntax trees, so `--plan` works on any
machine with nothing heavy installed. `build_plan()` computes everything the run will do;
`format_plan()` prints it as people read it.
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from miles.ci.registry.catalog import JOBS_PER_CORE, MAX_JOBS, MAX_SHARDS, Catalog, Suite
from miles.ci.registry.discover import Discovery
from miles.ci.registry.registration import GateDeclaration, Problem, Registration
from miles.ci.reports.report import REPORT_FILES
from miles.ci.running.execute import Settings, TestRun, format_command, pytest_command
from miles.ci.selection.policy import CiEvent, effective_cadence, history_decision, parse_labels
from miles.ci.selection.select import Scope, Selection, default_cadence, resolve_scope, select
from miles.ci.selection.shard import Job, Partition, balanced_partition, lower_bound, shards_for_budget
from miles.text import printable

DEFAULT_TIMEOUT_FLOOR = 60.0  # seconds; short tests still get time to import torch
DEFAULT_GRACE = 10.0  # seconds between SIGTERM and SIGKILL
# est_time is what a file takes (miles.ci.reports.calibrate writes the p90 of its passed runs, no
# margin; a GPU file never measured states the seed's or an estimate), so the plan predicts the
# lane's wall time; the headroom against a slow machine is the timeout's alone: three times that,
# counted at the load (below).
TIMEOUT_FACTOR = 3.0
# A file's timeout stretches while the load average exceeds the cores (execute.LoadClock), up to
# this many times its limit in wall time: a shared 2-core machine runs a file several times slower
# than a quiet one, and that is not a hang.
LOAD_STRETCH = 10.0
# Bounds of the numbers a person passes: beyond them a run hangs on one signal (an infinite
# grace), never times out (a NaN floor) or plans millions of empty shards.
MAX_TIMEOUT_FLOOR = 86_400.0  # a day, the longest est_time a registration may state
MAX_GRACE = 600.0
MAX_ATTEMPTS = 10


class PlanError(ValueError):
    """The run cannot be planned from this input (exit 2)."""


class EmptySuite(RuntimeError):
    """A suite of the run has no enabled test and the catalog does not declare it empty: the
    lane fails (exit 1) instead of passing with nothing run."""


@dataclass(frozen=True)
class RefusedTest:
    """A registration problem of one of the run's suites, charged to its own test file: the run
    reports it as that file's failed row and runs the rest of the suite."""

    file: str
    line: int
    suite: str
    lane: str
    message: str

    def record(self, backend: str, commit: str):
        """Its failed attempt: the registration never ran, and says why."""
        run = TestRun(self.file, backend, self.suite, self.lane, "1/1", 0.0, 0.0, commit=commit)
        text = printable(f"{self.file}:{self.line}: {self.message}")
        return run.record("failed", "registration", message=f"registration refused: {text}", output_tail=text)


@dataclass(frozen=True)
class RunOptions:
    root: Path = Path(".")
    lane: str | None = None
    backend: str | None = None
    suites: tuple[str, ...] = ()
    cadence: str | None = None
    labels: str | None = None  # raw PR labels; None = not given (every label admitted)
    shard: str | None = None  # "k/N" or "k/auto"
    shards: str | None = None  # "N" or "auto": how many shards the plan splits each suite into
    max_attempts: int | None = None  # default: the lane's
    continue_on_error: bool = False
    timeout_floor: float = DEFAULT_TIMEOUT_FLOOR
    grace: float = DEFAULT_GRACE
    report_dir: Path | None = None
    stream: bool | None = None  # echo test output live; default: on under GitHub Actions
    pytest_args: tuple[str, ...] = ()
    jobs: str | None = None  # "N" or "cores": files at once; default: the lane's `jobs` (a --lane run)
    # the claims folder of the run with jobs this invocation is one job of (miles.ci.running.claims):
    # it walks the run's whole queue and runs the files it takes
    claims: Path | None = None


@dataclass(frozen=True)
class PlannedTest:
    registration: Registration
    lane: str
    shard: int
    n_shards: int
    timeout: float
    gates: tuple[GateDeclaration, ...] = ()  # the file's register_ci_gate(...) declarations

    @property
    def shard_label(self) -> str:
        return f"{self.shard}/{self.n_shards}"


@dataclass(frozen=True)
class SuitePlan:
    suite: Suite
    n_shards: int
    how: str  # where the shard count came from
    partition: Partition
    run_shards: tuple[int, ...]  # 1-based shards this invocation runs


@dataclass(frozen=True)
class RunPlan:
    selection: Selection
    suites: tuple[SuitePlan, ...]
    tests: tuple[PlannedTest, ...]  # what this invocation runs, in order
    shard: str  # "k/N", or "all"
    report_dir: Path
    max_attempts: int
    continue_on_error: bool
    settings: Settings = field(repr=False)
    timeout_floor: float = DEFAULT_TIMEOUT_FLOOR
    store_history: bool = False  # passing gated attempts are stored as trusted history
    history_reason: str = ""  # why (policy.history_decision)
    warnings: tuple[Problem, ...] = ()  # registration problems of other suites: not this run's
    jobs: int = 1  # runner processes side by side, taking files from one queue (miles.ci.running.claims)
    refused: tuple[RefusedTest, ...] = ()  # this run's suites' problems, each a failed row of its file

    @property
    def predicted_wall(self) -> float:
        """The run's predicted wall time from the est_times: its shards one after another, or with
        jobs, the last job to finish when each takes the queue's next file as it frees."""
        return predicted_wall(self, [sp.partition.loads for sp in self.suites])


def predicted_wall(plan: RunPlan, loads: list[tuple[float, ...]]) -> float:
    """`plan.predicted_wall` from each suite's shard loads (read once: they are computed)."""
    if plan.jobs > 1:
        return max(job_loads(plan))
    return sum(
        shard_loads[k - 1] for sp, shard_loads in zip(plan.suites, loads, strict=True) for k in sp.run_shards
    )


def job_loads(plan: RunPlan) -> list[float]:
    """Each job's predicted busy seconds when the jobs take the queue's files as they run them:
    the job that frees first (the earliest-numbered on a tie) takes the next file of its own walk
    (miles.ci.running.claims.walk) that no job has taken."""
    from miles.ci.running.claims import walk

    walks = [walk(plan.tests, j + 1, both_ends=plan.continue_on_error) for j in range(plan.jobs)]
    at, free, taken = [0] * plan.jobs, [0.0] * plan.jobs, set()
    while len(taken) < len(plan.tests):
        j = min(range(plan.jobs), key=lambda i: (free[i], i))
        while id(walks[j][at[j]]) in taken:
            at[j] += 1
        test = walks[j][at[j]]
        taken.add(id(test))
        free[j] += test.registration.est_time
    return free


def queue_order(tests: list[PlannedTest], longest_first: bool) -> list[PlannedTest]:
    """A suite's files in the order a run takes them: longest first (the longest cannot end up
    alone at the end of a run that goes on after failures), else shortest first (quick feedback,
    and a fast-fail run spares the expensive files); ties by name."""
    sign = -1 if longest_first else 1
    return sorted(tests, key=lambda t: (sign * t.registration.est_time, t.registration.file))


def resolve_jobs(options: RunOptions, scope: Scope) -> int:
    """How many jobs the run uses: --jobs, else the lane's `jobs` in a run of a lane; 1 with an
    explicit shard (a CI matrix splits the suite already), where --jobs is refused."""
    asked = (
        options.jobs
        if options.jobs is not None
        else (scope.lane.jobs if scope.lane and not scope.narrowed else 1)
    )
    if str(asked) == JOBS_PER_CORE:
        jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    else:
        try:
            jobs = int(asked)
        except ValueError:
            raise PlanError(f'--jobs {asked!r} must be a number or "{JOBS_PER_CORE}"') from None
        if not 1 <= jobs <= MAX_JOBS:
            raise PlanError(f"--jobs {jobs} must be between 1 and {MAX_JOBS}")
    if options.shard is not None or options.shards is not None:
        if options.jobs is not None and jobs > 1:
            raise PlanError(
                "--jobs runs a whole run's shards side by side; it cannot be given with --shard/--shards"
            )
        return 1
    return min(jobs, MAX_JOBS)


THREADS_ENV = "OMP_NUM_THREADS"


def thread_share(env: Mapping[str, str], jobs: int) -> dict[str, str]:
    """The tests' environment: with several jobs, each test process's share of the CPUs as its
    OpenMP (torch intra-op) threads, unless the environment already says. Each job's test has its
    own session and so, under the kernel's autogroup scheduling, about one job's share of the
    CPUs: two torch threads on one CPU's share spin in OpenMP's barriers (measured on 2 cores,
    beside a busy process: test_train_rollout_parity 132 s with 2 threads, 7.2 s with 1)."""
    out = dict(env)
    if jobs > 1 and THREADS_ENV not in out:
        out[THREADS_ENV] = str(max(1, len(os.sched_getaffinity(0)) // jobs))
    return out


def _warm_wanted(files: int) -> bool:
    from miles.ci.running.warm import wanted

    try:
        return wanted(os.environ, files)
    except ValueError as exc:
        raise PlanError(str(exc)) from None


def timeout_for(est_time: float, floor: float) -> float:
    """The per-file limit: est_time x TIMEOUT_FACTOR, but never below the floor."""
    return max(floor, TIMEOUT_FACTOR * est_time)


def parse_shard(text: str) -> tuple[int, int | None]:
    """ "k/N" -> (k, N); "k/auto" -> (k, None). Raises PlanError."""
    k_text, sep, n_text = text.partition("/")
    try:
        k = int(k_text)
        n = None if n_text == "auto" else int(n_text)
    except ValueError:
        raise PlanError(f"--shard {text!r} must look like k/N (1-based, e.g. 2/3) or k/auto") from None
    if n is not None and not 1 <= n <= MAX_SHARDS:
        raise PlanError(f"--shard {text}: N must be between 1 and {MAX_SHARDS}")
    if not sep or k < 1 or (n is not None and not 1 <= k <= n):
        raise PlanError(f"--shard {text!r}: need 1 <= k <= N")
    return k, n


def parse_shards(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        raise PlanError(f"--shards {text!r} must be a positive number or 'auto'") from None
    if not 1 <= n <= MAX_SHARDS:
        raise PlanError(f"--shards {text} must be between 1 and {MAX_SHARDS}")
    return n


def check_seconds(flag: str, value: float, low: float, high: float) -> float:
    """`value` if it is a finite number of seconds in [low, high]; else PlanError."""
    if not math.isfinite(value):
        raise PlanError(f"{flag} {value:g} must be a finite number of seconds")
    if not low <= value <= high:
        raise PlanError(f"{flag} {value:g} must be between {low:g} and {high:g} seconds")
    return value


def check_options(options: RunOptions) -> None:
    """The numeric options' bounds and a usable --report-dir, before anything is planned."""
    check_seconds("--timeout-floor", options.timeout_floor, 0.0, MAX_TIMEOUT_FLOOR)
    check_seconds("--grace", options.grace, 0.0, MAX_GRACE)
    if options.max_attempts is not None and not 1 <= options.max_attempts <= MAX_ATTEMPTS:
        raise PlanError(f"--max-attempts {options.max_attempts} must be between 1 and {MAX_ATTEMPTS}")
    report_dir = options.report_dir
    if report_dir is not None and report_dir.exists() and not report_dir.is_dir():
        raise PlanError(f"--report-dir {report_dir} exists and is not a directory; name a directory")


def shard_count(suite: Suite, jobs: list[Job], requested: int | None, explicit: bool) -> tuple[int, str]:
    if explicit and requested is not None:
        return requested, "requested"
    if suite.budget_s is not None:
        return shards_for_budget(
            jobs, suite.budget_s, max_shards=MAX_SHARDS
        ), f"auto: budget {suite.budget_s:g}s per shard"
    return suite.shards or 1, "catalog"


def build_plan(options: RunOptions, catalog: Catalog, discovery: Discovery) -> RunPlan:
    """Everything the run will do, computed without running anything."""
    check_options(options)
    scope = resolve_scope(catalog, lane=options.lane, backend=options.backend, suites=options.suites)
    refused = refused_tests(discovery, scope, catalog)
    labels = parse_labels(options.labels, catalog) if options.labels is not None else None
    base_cadence = options.cadence or default_cadence(scope)
    cadence = effective_cadence(base_cadence, labels)
    # from the event and the cadence it asked for: a label widens the tests, never the trust
    store_history, history_reason = history_decision(CiEvent.from_env(os.environ), base_cadence, catalog)
    selection = select(discovery, scope, cadence=cadence, labels=labels)

    n_jobs = resolve_jobs(options, scope)
    queue = n_jobs > 1 or options.claims is not None  # jobs take files from one queue per suite
    k, n_requested, explicit = None, None, False
    if queue:
        n_requested, explicit = 1, True
    elif options.shard is not None:
        k, n_requested = parse_shard(options.shard)
        explicit = n_requested is not None
        if options.shards is not None and parse_shards(options.shards) != n_requested:
            raise PlanError(f"--shard {options.shard} and --shards {options.shards} disagree; give one")
    elif options.shards is not None:
        n_requested = parse_shards(options.shards)
        explicit = n_requested is not None

    check_not_empty(scope, discovery, refused)  # after the input's checks: bad input is exit 2 first
    lane_runs_every_file = scope.lane is not None and not scope.narrowed and not scope.lane.fast_fail
    continue_on_error = (
        options.continue_on_error or bool(labels and labels.bypass_fastfail) or lane_runs_every_file
    )
    suite_plans, tests = [], []
    for suite in scope.suites:
        failing = {r.file for r in refused if r.suite == suite.name}  # their row is the failure
        regs = {r.file: r for r in selection.of_suite(suite.name) if r.file not in failing}
        jobs = [Job(r.file, r.est_time) for r in regs.values()]
        try:
            n, how = shard_count(suite, jobs, n_requested, explicit)
            partition = balanced_partition(jobs, n)
        except ValueError as exc:  # the partition's own checks: one line, exit 2, never a traceback
            raise PlanError(f"suite {suite.name} cannot be sharded: {exc}") from None
        run_shards = tuple(range(1, n + 1)) if k is None else ((k,) if k <= n else ())
        suite_plans.append(SuitePlan(suite, n, how, partition, run_shards))
        if 1 not in run_shards:  # a suite's refused registrations fail its first shard only
            refused = tuple(r for r in refused if r.suite != suite.name)
        for index in run_shards:
            shard_tests = []
            for job in partition.shards[index - 1]:
                reg = regs[job.key]
                limit = timeout_for(reg.est_time, options.timeout_floor)
                gates = discovery.file(reg.file).gates
                shard_tests.append(PlannedTest(reg, scope.lane_of(suite), index, n, limit, gates))
            tests += queue_order(shard_tests, longest_first=queue and continue_on_error)

    if options.shard is not None:
        shard = options.shard
    elif n_jobs > 1 or all(p.n_shards == 1 for p in suite_plans):
        shard = "1/1"
    else:
        shard = "all"
    tag = shard.replace("/", "of")
    root = options.root.resolve()
    report_dir = options.report_dir or Path(".miles") / "reports" / f"{scope.name}-{tag}"
    report_dir = report_dir if report_dir.is_absolute() else root / report_dir
    lane_attempts = (
        scope.lane.max_attempts
        if scope.lane
        else max((catalog.lanes[s.lane].max_attempts for s in scope.suites), default=1)
    )
    max_attempts = options.max_attempts if options.max_attempts is not None else lane_attempts
    stream = options.stream if options.stream is not None else os.environ.get("GITHUB_ACTIONS") == "true"
    settings = Settings(
        base_env=thread_share(os.environ, n_jobs),
        root=root,
        grace=options.grace,
        pytest_args=options.pytest_args,
        echo=sys.stdout if stream else None,
        load_stretch=LOAD_STRETCH,
        warm=scope.backend == "cpu" and _warm_wanted(len(tests)),
    )
    return RunPlan(
        selection,
        tuple(suite_plans),
        tuple(tests),
        shard,
        report_dir,
        max_attempts,
        continue_on_error,
        settings,
        options.timeout_floor,
        store_history,
        history_reason,
        tuple(p for p in discovery.problems if not blocks(p, scope, catalog)),
        n_jobs,
        refused,
    )


def refused_tests(discovery: Discovery, scope: Scope, catalog: Catalog) -> tuple[RefusedTest, ...]:
    """The registration problems of the run's suites, one row per (file, line, suite): a refused
    call in the suite it named (or, for a name no suite has, the run's suite it is closest to),
    a problem of a whole file in each of the run's suites the file registers for."""
    names = [s.name for s in scope.suites]
    out: dict[tuple[str, int, str], RefusedTest] = {}
    for problem in discovery.problems:
        if not blocks(problem, scope, catalog):
            continue
        named = (problem.suite,) if problem.suite is not None else problem.suites
        suites = [s for s in named if s in names] or [_closest(named, names)]
        for suite in suites:
            lane = scope.lane_of(catalog.suites[suite])
            out.setdefault((problem.file, problem.line, suite),
                           RefusedTest(problem.file, problem.line, suite, lane, problem.message))  # fmt: skip
    return tuple(out.values())


def _closest(named: tuple[str, ...], names: list[str]) -> str:
    for name in named:
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.75)
        if close:
            return close[0]
    return names[0]


def check_not_empty(scope: Scope, discovery: Discovery, refused: tuple[RefusedTest, ...]) -> None:
    """EmptySuite when a suite of the run has no enabled registration, no refused one to report,
    and no `empty` reason in the catalog."""
    enabled = {r.suite for r in discovery.registrations if r.enabled and r.backend == scope.backend}
    failing = {r.suite for r in refused}
    empty = [s for s in scope.suites if s.name not in enabled | failing and s.empty is None]
    if empty:
        shown = ", ".join(s.name for s in empty)
        raise EmptySuite(
            f"suite{'s' if len(empty) > 1 else ''} {shown} of {scope.name} {'have' if len(empty) > 1 else 'has'} "
            "no enabled test: register one, or declare the suite empty with its reason in "
            f'miles/ci/catalog.toml ([suites."{empty[0].name}"] empty = "...")'
        )


def blocks(problem: Problem, scope: Scope, catalog: Catalog) -> bool:
    """Whether a registration problem stops a run of `scope`: only a problem in one of its
    own suites does (a refused call's suite, or a suite the file registers for), or one that
    cannot be placed in a suite of its backend. The others are warnings here; `audit
    --strict` (the lint lane) fails on every problem."""
    if scope.backend not in problem.backends:
        return False
    names = {s.name for s in scope.suites}
    named = (problem.suite,) if problem.suite is not None else problem.suites
    if not named:
        return True
    return any(_suite_in_scope(suite, scope, names, catalog) for suite in named)


def _suite_in_scope(suite_name: str, scope: Scope, names: set[str], catalog: Catalog) -> bool:
    """Whether a suite a problem names is one of this run's; a name no suite of the backend
    has counts as the run's when it is a near miss of one of its suites (a typo), or when it
    is close to none at all (it could be anyone's)."""
    suite = catalog.suites.get(suite_name)
    if suite is not None and suite.backend == scope.backend:
        return suite.name in names
    if suite is not None:  # a suite of another backend: this file's problem is not this run's
        return False
    pool = [s.name for s in catalog.suites_for_backend(scope.backend)]
    close = difflib.get_close_matches(suite_name, pool, n=1, cutoff=0.75)
    return close[0] in names if close else True


def attempt_name(test: PlannedTest, attempt: int) -> str:
    """`<suite>/<file slug>-<hash>/<attempt>` under the run's attempts/ folder. The slug is the
    file's path cut to 96 bytes; the hash of the whole path keeps every name unique and short
    (a folder name over 255 bytes cannot be made)."""
    file = test.registration.file
    slug = file.removesuffix(".py").replace("/", "__").encode("utf-8", "surrogateescape")[:96]
    slug = slug.decode("utf-8", "ignore")
    digest = hashlib.sha256(file.encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return f"{test.registration.suite}/{slug}-{digest}/{attempt}"


def attempt_dir(plan: RunPlan, test: PlannedTest, attempt: int) -> Path:
    return plan.report_dir / "attempts" / attempt_name(test, attempt)


def test_run(
    plan: RunPlan, test: PlannedTest, attempt: int, retry_reason: str | None, commit: str
) -> TestRun:
    reg = test.registration
    return TestRun(
        file=reg.file,
        backend=reg.backend,
        suite=reg.suite,
        lane=test.lane,
        shard=test.shard_label,
        est_time=reg.est_time,
        timeout=test.timeout,
        attempt=attempt,
        retry_reason=retry_reason,
        commit=commit,
    )


def _prediction(plan: RunPlan, loads: list[tuple[float, ...]]) -> str:
    wall = predicted_wall(plan, loads)
    if plan.jobs > 1:
        each = ", ".join(f"job {j + 1}: {load:g}s" for j, load in enumerate(job_loads(plan)))
        return (
            f"predicted wall {wall:g}s: {plan.jobs} jobs side by side, each taking the next file of the "
            f"queue above as it frees ({each})"
        )
    return f"predicted wall {wall:g}s: the shards above, one after another"


def format_plan(plan: RunPlan) -> str:
    """The plan as people read it: shards, predicted totals, bounds, timeouts, commands."""
    sel = plan.selection
    labels = "(not given: every label admitted)" if sel.labels is None else str(sel.labels)
    out = [
        f"plan · {sel.scope.name} · backend {sel.scope.backend} · cadence {sel.cadence} · labels {labels} · "
        f"shard {plan.shard} · max attempts {plan.max_attempts} · "
        f"{'continue on error' if plan.continue_on_error else 'fast-fail'}"
        + (f" · {plan.jobs} jobs at once" if plan.jobs > 1 else "")
        + (
            f" · {THREADS_ENV}={plan.settings.base_env[THREADS_ENV]} per test"
            if THREADS_ENV in plan.settings.base_env
            else ""
        ),
        f"metric history is {'stored' if plan.store_history else 'not stored'}: {plan.history_reason}",
        f"timeouts: max(floor {plan.timeout_floor:g}s, {TIMEOUT_FACTOR:g} x est_time), counted at the machine's "
        f"load (up to {plan.settings.load_stretch:g}x in wall time while the load average exceeds the cores)",
    ]
    every_suite_loads = []
    order = {(t.registration.suite, t.registration.file): i for i, t in enumerate(plan.tests)}
    for sp in plan.suites:
        p = sp.partition
        loads = p.loads  # a computed property: read once, not once per shard line
        every_suite_loads.append(loads)
        running = set(sp.run_shards)
        total = sum(loads)
        longest = max((j.weight for s in p.shards for j in s), default=0.0)
        n_tests = sum(len(s) for s in p.shards)
        out.append("")
        makespan = max(loads, default=0.0)
        bound = lower_bound([j.weight for s in p.shards for j in s], sp.n_shards)
        if plan.jobs > 1:
            out.append(
                f"suite {sp.suite.name}: {n_tests} test(s), one queue for {plan.jobs} jobs, total est {total:g}s"
            )
        else:
            out.append(
                f"suite {sp.suite.name}: {n_tests} test(s), {sp.n_shards} shard(s) ({sp.how}), total est {total:g}s"
            )
        if n_tests and plan.jobs == 1:
            out.append(
                f"  lower bound {bound:.0f}s = max(total/N {total / sp.n_shards:.0f}s, longest {longest:g}s); "
                f"predicted makespan {makespan:.0f}s; ratio {makespan / bound if bound > 0 else 1.0:.3f} ({p.method}"
                f"{', optimal' if p.optimal else ''})"
            )
        for index, shard in enumerate(p.shards, start=1):
            here = " ← this run" if index in running else ""
            if plan.jobs > 1:
                first = "longest" if plan.continue_on_error else "shortest"
                out.append(f"  the jobs take them in this order ({first} first):")
            else:
                out.append(
                    f"  shard {index}/{sp.n_shards}: {len(shard)} test(s), predicted {loads[index - 1]:g}s{here}"
                )
            for job in sorted(
                shard, key=lambda j: (order.get((sp.suite.name, j.key), len(order)), j.weight, j.key)
            ):
                limit = timeout_for(job.weight, plan.timeout_floor)
                out.append(f"    est {job.weight:>6g}s  timeout {limit:>6g}s  {job.key}")
        if not sp.run_shards and plan.shard != "all":
            out.append(
                f"  shard {plan.shard} asked, but this suite has {sp.n_shards}: nothing of it runs here"
            )
        for e in (e for e in sel.excluded if e.suite == sp.suite.name):
            out.append(f"  not run ({e.kind}): {e.file}: {e.reason}")
        for r in (r for r in plan.refused if r.suite == sp.suite.name):
            out.append(f"  fails (registration refused): {r.file}:{r.line}: {r.message}")
        if not n_tests and sp.suite.empty:
            out.append(f"  declared empty in the catalog: {sp.suite.empty}")
    if plan.tests:
        out += ["", _prediction(plan, every_suite_loads)]
    if plan.warnings:
        out += ["", f"warning: {len(plan.warnings)} registration problem(s) in other suites (not run here; "
                "`audit --strict` fails on them):"]  # fmt: skip
        out += [f"  {p}" for p in plan.warnings]
    if plan.tests:
        out += ["", "commands (attempt 1; cwd = project root):"]
        for test in plan.tests:
            run = test_run(plan, test, 1, None, "")
            folder = attempt_dir(plan, test, 1)
            junit = folder / "junit.xml"
            env = run.env(folder / "metrics", folder / "phases")
            out.append(f"  {format_command(pytest_command(plan.settings, run.file, junit), env)}")
    elif not plan.refused:
        out += ["", "nothing to run in this shard."]
    out.append(f"reports: {plan.report_dir}/{{{','.join(REPORT_FILES)}}}")
    # file names and reasons are anyone's text: a newline in one must not start a line (a
    # workflow command is any line that starts with '::')
    return "\n".join(printable(line) for line in out) + "\n"
