"""The CI catalog: backends, hardware, labels, lanes and suites, loaded from catalog.toml.

Everything that needs to know where tests can run (the noxfile, workflows' shard
matrices, discovery, the runner, the audit) reads these frozen records; nothing else
keeps a list of suites.
"""

from __future__ import annotations

import difflib
import math
import re
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

CATALOG_PATH = Path(__file__).resolve().parents[1] / "catalog.toml"  # miles/ci/catalog.toml
CATALOG_SCHEMA = 1  # the `schema = N` this miles reads
JOBS_PER_CORE = "cores"  # a lane's `jobs`: one runner process per CPU core of the machine
MAX_JOBS = 64

CADENCES = ("regular", "nightly", "weekly", "release")
GATE_MODES = ("shadow", "enforce")
CONSUMER_KINDS = ("workflow", "external")
MAX_EST_TIME = 86_400.0  # a day: the longest est_time a registration (or an implicit one) may state
MAX_SHARDS = 64  # shards of one suite: more runners than any pool has, and a bound on planning

_SUITE_NAME = re.compile(
    r"^(?P<nightly>nightly-)?stage-(?P<tier>[abc])-(?:cpu|(?P<gpus>[1-9][0-9]*)-gpu-(?P<hw>[a-z0-9]+))$"
)


class CatalogError(ValueError):
    """The catalog file breaks one or more of its own rules."""

    def __init__(self, path: Path, problems: list[str]):
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{path}: {len(problems)} problem(s):\n{lines}")


class UnknownName(KeyError):
    """A suite, lane or label that the catalog does not define."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the sentence readable
        return str(self.args[0])


@dataclass(frozen=True)
class Backend:
    name: str
    description: str


@dataclass(frozen=True)
class Hardware:
    name: str
    backend: str
    description: str


@dataclass(frozen=True)
class Lane:
    name: str
    backend: str
    description: str
    python: str
    cadence: str
    gate_mode: str
    max_attempts: int
    jobs: int | str = 1  # files run at once, each by a runner process of its own; "cores": one per core
    fast_fail: bool = True  # False: a failing file does not stop the lane, every file runs


@dataclass(frozen=True)
class Consumer:
    kind: str  # "workflow" (a file in .github/workflows) or "external" (a job elsewhere)
    name: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class Suite:
    name: str
    backend: str
    gpus: int
    lane: str
    cadence: str
    shards: int | None
    budget_s: float | None
    runner_labels: tuple[str, ...]
    consumers: tuple[Consumer, ...]
    description: str
    # Why the suite has no enabled test yet (`empty = "..."`); a suite without one whose tests
    # are all missing or disabled fails its lane instead of passing with nothing run.
    empty: str | None = None

    @property
    def tier(self) -> str:
        match = _SUITE_NAME.match(self.name)
        return match["tier"] if match else ""

    @property
    def hardware(self) -> str | None:
        match = _SUITE_NAME.match(self.name)
        return match["hw"] if match else None

    @property
    def is_gpu(self) -> bool:
        return self.gpus > 0


@dataclass(frozen=True)
class ImplicitDir:
    """A directory whose test files need no register_*_ci call: one without runs in `suite`."""

    directory: str  # posix, relative to the project root, no trailing slash
    suite: str
    est_time: float

    def holds(self, rel: str) -> bool:
        return rel.startswith(self.directory + "/")


@dataclass(frozen=True)
class Catalog:
    path: Path
    backends: Mapping[str, Backend]
    hardware: Mapping[str, Hardware]
    labels: Mapping[str, str]
    lanes: Mapping[str, Lane]
    suites: Mapping[str, Suite]
    implicit: Mapping[str, ImplicitDir] = dataclass_field(default_factory=lambda: MappingProxyType({}))
    # workflow file in .github/workflows -> the cadence its scheduled runs use
    schedules: Mapping[str, str] = dataclass_field(default_factory=lambda: MappingProxyType({}))

    def implicit_for(self, rel: str) -> ImplicitDir | None:
        """The implicit registration of the test file at `rel` (posix, relative to the project
        root) when it registers nothing itself; the innermost declared directory wins."""
        holding = [d for d in self.implicit.values() if d.holds(rel)]
        return max(holding, key=lambda d: len(d.directory), default=None)

    def scheduled_runs(self, suite: str) -> tuple[tuple[str, str], ...]:
        """(workflow, cadence) of the scheduled workflows that run `suite`."""
        return tuple(
            (c.name, self.schedules[c.name])
            for c in self.suites[suite].consumers
            if c.kind == "workflow" and c.name in self.schedules
        )

    def suites_for_backend(self, backend: str) -> tuple[Suite, ...]:
        return tuple(s for s in self.suites.values() if s.backend == backend)

    def suites_of_lane(self, lane: str) -> tuple[Suite, ...]:
        return tuple(s for s in self.suites.values() if s.lane == lane)

    def lane(self, name: str) -> Lane:
        if name not in self.lanes:
            raise UnknownName(unknown_name_message("lane", name, self.lanes))
        return self.lanes[name]

    def suite(self, name: str, backend: str | None = None) -> Suite:
        """The suite called `name`; with `backend`, it must also belong to that backend."""
        suite = self.suites.get(name)
        if suite is not None and (backend is None or suite.backend == backend):
            return suite
        pool = self.suites if backend is None else {s.name: s for s in self.suites_for_backend(backend)}
        where = "" if backend is None else f" for {backend}"
        extra = ""
        if suite is not None:
            extra = f" (it belongs to {suite.backend})"
        raise UnknownName(unknown_name_message("suite", name, pool, where=where, extra=extra))

    def check_label(self, name: str) -> str:
        if name not in self.labels:
            raise UnknownName(unknown_name_message("label", name, self.labels))
        return name


def unknown_name_message(
    kind: str, name: str, known: Iterable[str], *, where: str = "", extra: str = ""
) -> str:
    """ "<kind> '<name>' is not in the catalog…; did you mean …? known: …" for any closed list."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    hint = f"; did you mean '{close[0]}'?" if close else ";"
    return f"{kind} '{name}' is not in the catalog{where}{extra}{hint} known: {compress_names(known)}"


def compress_names(names: Iterable[str]) -> str:
    """Join names, folding ones that differ only in one number: a-{2,4,8}-b."""
    groups: dict[tuple[str, str], list[str]] = {}
    order: list[tuple[str, str]] = []
    for name in names:
        match = re.search(r"(?<=-)\d+(?=-)", name)
        key = (name[: match.start()], name[match.end() :]) if match else (name, "")
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(match.group(0) if match else "")
    parts = []
    for prefix, suffix in order:
        numbers = groups[(prefix, suffix)]
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]}{suffix}")
        else:
            ordered = sorted(numbers, key=int)
            parts.append(f"{prefix}{{{','.join(ordered)}}}{suffix}")
    return ", ".join(parts)


@lru_cache(maxsize=8)
def load_catalog(path: Path | str | None = None) -> Catalog:
    """Read and validate the catalog; raises CatalogError listing every broken rule."""
    path = Path(path) if path is not None else CATALOG_PATH
    try:
        with open(path, "rb") as fh:
            raw = tomllib.load(fh)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(path, [f"not valid TOML: {exc}"]) from None
    except OSError as exc:
        raise CatalogError(path, [f"cannot read it: {exc.strerror or exc}"]) from None
    problems: list[str] = []
    catalog = _build(path, raw, problems)
    problems.extend(validate_catalog(catalog))
    if problems:
        raise CatalogError(path, problems)
    return catalog


def _build(path: Path, raw: dict, problems: list[str]) -> Catalog:
    schema = raw.get("schema")
    if schema is None:
        problems.append(f"missing `schema = {CATALOG_SCHEMA}` at the top")
    elif schema != CATALOG_SCHEMA or isinstance(schema, bool):
        problems.append(f"schema = {schema!r}: this miles reads catalog schema {CATALOG_SCHEMA}")

    def table(name: str) -> dict:
        value = raw.get(name, {})
        if not isinstance(value, dict):
            problems.append(f"[{name}] must be a table")
            return {}
        entries = {}
        for key, entry in value.items():
            if name not in ("labels", "schedules") and not isinstance(entry, dict):
                where = f'[{name}."{key}"]' if name == "suites" else f"[{name}.{key}]"
                problems.append(f"{where} must be a table, not {type(entry).__name__} {entry!r:.40}")
                continue
            entries[key] = entry
        return entries

    def field(where: str, entry: dict, key: str, kind: type, fallback):
        """A required field; reports it missing or mistyped and returns `fallback`."""
        if key not in entry:
            problems.append(f"{where}: missing `{key}`")
            return fallback
        value = entry[key]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            problems.append(f"{where}: `{key}` = {value!r} should be a {kind.__name__}")
            return fallback
        return value

    backends = {
        name: Backend(name, field(f"[backends.{name}]", entry, "description", str, ""))
        for name, entry in table("backends").items()
    }
    hardware = {
        name: Hardware(
            name,
            field(f"[hardware.{name}]", entry, "backend", str, ""),
            field(f"[hardware.{name}]", entry, "description", str, ""),
        )
        for name, entry in table("hardware").items()
    }
    labels = {}
    for name, description in table("labels").items():
        if not isinstance(description, str) or not description.strip():
            problems.append(f"[labels] `{name}` needs a one-line description")
        labels[name] = description if isinstance(description, str) else ""

    lanes = {}
    for name, entry in table("lanes").items():
        where = f"[lanes.{name}]"
        lanes[name] = Lane(
            name=name,
            backend=field(where, entry, "backend", str, ""),
            description=field(where, entry, "description", str, ""),
            python=field(where, entry, "python", str, ""),
            cadence=field(where, entry, "cadence", str, ""),
            gate_mode=field(where, entry, "gate_mode", str, ""),
            max_attempts=field(where, entry, "max_attempts", int, 0),
            jobs=entry.get("jobs", 1),
            fast_fail=entry.get("fast_fail", True),
        )

    suites = {}
    for name, entry in table("suites").items():
        where = f'[suites."{name}"]'
        consumers = []
        for text in field(where, entry, "consumers", list, []):
            kind, _, target = str(text).partition(":")
            if kind not in CONSUMER_KINDS or not target.strip():
                problems.append(f"{where}: consumer {text!r} must be 'workflow:<file>' or 'external:<job>'")
                continue
            consumers.append(Consumer(kind, target.strip()))
        shards = entry.get("shards")
        budget = entry.get("budget_s")
        suites[name] = Suite(
            name=name,
            backend=field(where, entry, "backend", str, ""),
            gpus=field(where, entry, "gpus", int, -1),
            lane=field(where, entry, "lane", str, ""),
            cadence=field(where, entry, "cadence", str, ""),
            shards=shards if isinstance(shards, int) and not isinstance(shards, bool) else None,
            budget_s=float(budget)
            if isinstance(budget, int | float) and not isinstance(budget, bool)
            else None,
            runner_labels=tuple(field(where, entry, "runner_labels", list, [])),
            consumers=tuple(consumers),
            description=field(where, entry, "description", str, ""),
            empty=_empty_reason(where, entry, problems),
        )
    implicit = {}
    for directory, entry in table("implicit").items():
        where = f'[implicit."{directory}"]'
        est_time = entry.get("est_time")
        if not isinstance(est_time, int | float) or isinstance(est_time, bool):
            problems.append(f"{where}: `est_time` = {est_time!r} should be a number of seconds")
            est_time = 0.0
        implicit[directory] = ImplicitDir(directory, field(where, entry, "suite", str, ""), float(est_time))
    schedules = {}
    for workflow, cadence in table("schedules").items():
        if not isinstance(cadence, str):
            problems.append(f'[schedules] "{workflow}" = {cadence!r} should be a cadence name')
            continue
        schedules[workflow] = cadence
    return Catalog(
        path=path,
        backends=MappingProxyType(backends),
        hardware=MappingProxyType(hardware),
        labels=MappingProxyType(labels),
        lanes=MappingProxyType(lanes),
        suites=MappingProxyType(suites),
        implicit=MappingProxyType(implicit),
        schedules=MappingProxyType(schedules),
    )


def _empty_reason(where: str, entry: dict, problems: list[str]) -> str | None:
    """A suite's `empty` declaration: a reason held to the rules of a `disabled=` reason."""
    if "empty" not in entry:
        return None
    from miles.ci.registry.reasons import disabled_reason_problem

    value = entry["empty"]
    if not isinstance(value, str):
        problems.append(f"{where}: `empty` = {value!r} should be a sentence saying why the suite has no test")
        return None
    problem = disabled_reason_problem(value)
    if problem:
        problems.append(f"{where}: `empty`: {problem.replace('disabled=', 'empty = ', 1)}")
    return value


def validate_catalog(catalog: Catalog) -> list[str]:
    """Every rule the catalog must satisfy, as a list of readable problems."""
    problems = []
    for name, kind in (("backends", "backend"), ("lanes", "lane"), ("suites", "suite")):
        if not getattr(catalog, name):
            problems.append(
                f"the catalog defines no {name}: every lane runs suites of a backend; add a [{name}.<{kind}>]"
            )
    for hw in catalog.hardware.values():
        if hw.backend not in catalog.backends:
            problems.append(f"[hardware.{hw.name}]: backend '{hw.backend}' is not a known backend")
    for lane in catalog.lanes.values():
        where = f"[lanes.{lane.name}]"
        if lane.backend not in catalog.backends:
            problems.append(f"{where}: backend '{lane.backend}' is not one of {sorted(catalog.backends)}")
        if lane.cadence not in CADENCES:
            problems.append(f"{where}: cadence '{lane.cadence}' is not one of {list(CADENCES)}")
        if lane.gate_mode not in GATE_MODES:
            problems.append(f"{where}: gate_mode '{lane.gate_mode}' is not one of {list(GATE_MODES)}")
        if lane.max_attempts < 1:
            problems.append(f"{where}: max_attempts must be >= 1")
        if lane.jobs != JOBS_PER_CORE and not (isinstance(lane.jobs, int) and not isinstance(lane.jobs, bool)
                                               and 1 <= lane.jobs <= MAX_JOBS):  # fmt: skip
            problems.append(f'{where}: jobs = {lane.jobs!r} must be 1 to {MAX_JOBS} or "{JOBS_PER_CORE}"')
        if not isinstance(lane.fast_fail, bool):
            problems.append(f"{where}: fast_fail = {lane.fast_fail!r} must be true or false")
        if not catalog.suites_of_lane(lane.name):
            problems.append(f"{where}: no suite names this lane; remove it or point a suite at it")
    for suite in catalog.suites.values():
        problems.extend(_suite_problems(catalog, suite))
    for implicit in catalog.implicit.values():
        problems.extend(_implicit_problems(catalog, implicit))
    consumers = {c.name for s in catalog.suites.values() for c in s.consumers if c.kind == "workflow"}
    for workflow, cadence in catalog.schedules.items():
        if cadence not in CADENCES:
            problems.append(f"[schedules] \"{workflow}\": cadence '{cadence}' is not one of {list(CADENCES)}")
        if workflow not in consumers:
            problems.append(
                f'[schedules] "{workflow}" runs no suite: name it among the consumers of the suites it runs'
            )
    return problems


def _implicit_problems(catalog: Catalog, implicit: ImplicitDir) -> list[str]:
    where = f'[implicit."{implicit.directory}"]'
    problems = []
    parts = implicit.directory.split("/")
    if (
        implicit.directory.startswith("/")
        or "\\" in implicit.directory
        or any(p in ("", ".", "..") for p in parts)
    ):
        problems.append(
            f"{where}: the directory must be a plain path relative to the project root, such as "
            '"tests/unit" (no leading or trailing slash, no "." or ".." parts, forward slashes)'
        )
    suite = catalog.suites.get(implicit.suite)
    if suite is None:
        problems.append(f"{where}: {unknown_name_message('suite', implicit.suite, catalog.suites)}")
    elif suite.is_gpu:
        problems.append(
            f"{where}: suite '{suite.name}' is a GPU suite; a GPU registration needs labels, which an "
            "implicit one cannot carry: name a cpu suite, or register the files explicitly"
        )
    if not (math.isfinite(implicit.est_time) and 0 < implicit.est_time <= MAX_EST_TIME):
        problems.append(
            f"{where}: est_time must be a number of seconds > 0 and at most {MAX_EST_TIME:g}, not {implicit.est_time:g}"
        )
    return problems


def _suite_problems(catalog: Catalog, suite: Suite) -> list[str]:
    where = f'[suites."{suite.name}"]'
    problems = []
    match = _SUITE_NAME.match(suite.name)
    if not match:
        problems.append(
            f"{where}: name must look like stage-<a|b|c>-cpu or [nightly-]stage-<a|b|c>-<N>-gpu-<hardware>"
        )
    if suite.backend not in catalog.backends:
        problems.append(f"{where}: backend '{suite.backend}' is not one of {sorted(catalog.backends)}")
    if match:
        if match["gpus"] is None:
            if suite.backend != "cpu" or suite.gpus != 0:
                problems.append(f"{where}: a -cpu suite must have backend 'cpu' and gpus = 0")
        else:
            if int(match["gpus"]) != suite.gpus:
                problems.append(
                    f"{where}: the name says {match['gpus']} GPUs but gpus = {suite.gpus}; make them agree"
                )
            hw = catalog.hardware.get(match["hw"])
            if hw is None:
                problems.append(
                    f"{where}: hardware '{match['hw']}' is not in [hardware]; known: {sorted(catalog.hardware)}"
                )
            elif hw.backend != suite.backend:
                problems.append(
                    f"{where}: hardware '{hw.name}' is {hw.backend} but the suite's backend is {suite.backend}"
                )
        if match["nightly"] and suite.cadence == "regular":
            problems.append(f"{where}: a nightly- suite cannot have cadence 'regular'")
    if suite.cadence not in CADENCES:
        problems.append(f"{where}: cadence '{suite.cadence}' is not one of {list(CADENCES)}")
    lane = catalog.lanes.get(suite.lane)
    if lane is None:
        problems.append(f"{where}: lane '{suite.lane}' is not in [lanes]; every suite needs a lane")
    elif lane.backend != suite.backend:
        problems.append(f"{where}: lane '{lane.name}' runs {lane.backend} but the suite is {suite.backend}")
    if not suite.consumers:
        problems.append(f"{where}: no consumers; a suite nobody runs silently drops its tests")
    if (suite.shards is None) == (suite.budget_s is None):
        problems.append(f"{where}: set exactly one of `shards` (count) or `budget_s` (seconds per shard)")
    if suite.shards is not None and not 1 <= suite.shards <= MAX_SHARDS:
        problems.append(f"{where}: shards must be between 1 and {MAX_SHARDS}, not {suite.shards}")
    if suite.budget_s is not None and not (math.isfinite(suite.budget_s) and suite.budget_s > 0):
        problems.append(f"{where}: budget_s must be a finite number > 0, not {suite.budget_s!r}")
    if suite.gpus > 0 and not suite.runner_labels:
        problems.append(f"{where}: a GPU suite needs runner_labels")
    return problems
