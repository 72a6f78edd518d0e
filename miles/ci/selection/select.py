"""Which registrations a run executes: the scope (lane, backend, suites) and the admission
rules (disabled, cadence, PR labels).

Admission, for a registration of a suite in scope:
- `disabled=` keeps it out (it is still reported, with its reason);
- `nightly=True` admits it to nightly, weekly and release runs only;
- a GPU registration runs when the PR labels request one of its labels (`run-ci-<label>`)
  or a broad scope covers it (`run-ci-all`, or a nightly/weekly/release cadence); with no
  PR labels given at all (a person running a lane by hand) every label is admitted;
- CPU registrations always run.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.ci.registry.catalog import CADENCES, Catalog, Lane, Suite, UnknownName
from miles.ci.registry.discover import Discovery
from miles.ci.registry.registration import Registration
from miles.ci.reports.record import Exclusion
from miles.ci.selection.policy import LabelSet


class ScopeError(ValueError):
    """The requested lane, backend and suites do not fit together."""


@dataclass(frozen=True)
class Scope:
    lane: Lane | None
    backend: str
    suites: tuple[Suite, ...]
    narrowed: bool = False  # --suite picked some of the lane's suites

    @property
    def name(self) -> str:
        """What reports and directories are named after: the whole lane, else the one suite
        (so two suites of one lane run on one machine do not share a report directory)."""
        if self.lane is not None and not self.narrowed:
            return self.lane.name
        if len(self.suites) == 1:
            return self.suites[0].name
        return self.lane.name if self.lane is not None else self.backend

    def lane_of(self, suite: Suite) -> str:
        return self.lane.name if self.lane is not None else suite.lane


@dataclass(frozen=True)
class Selection:
    scope: Scope
    cadence: str
    labels: LabelSet | None
    selected: tuple[Registration, ...]
    excluded: tuple[Exclusion, ...]

    def of_suite(self, suite: str) -> tuple[Registration, ...]:
        return tuple(r for r in self.selected if r.suite == suite)


def resolve_scope(
    catalog: Catalog,
    *,
    lane: str | None = None,
    backend: str | None = None,
    suites: tuple[str, ...] | list[str] = (),
) -> Scope:
    """The lane, backend and suites a run covers; raises UnknownName or ScopeError."""
    if backend is not None and backend not in catalog.backends:
        raise UnknownName(f"backend '{backend}' is not in the catalog; known: {', '.join(catalog.backends)}")
    if lane is not None:
        lane_rec = catalog.lane(lane)
        if backend is not None and backend != lane_rec.backend:
            raise ScopeError(f"lane '{lane}' runs {lane_rec.backend}, not {backend}; drop --backend")
        lane_suites = catalog.suites_of_lane(lane_rec.name)
        chosen = lane_suites
        if suites:
            names = {s.name for s in lane_suites}
            chosen = []
            for name in suites:
                suite = catalog.suite(name, lane_rec.backend)
                if suite.name not in names:
                    raise ScopeError(
                        f"suite '{name}' is run by lane '{suite.lane}', not '{lane}'; "
                        f"lane '{lane}' runs: {', '.join(sorted(names))}"
                    )
                chosen.append(suite)
        return Scope(lane_rec, lane_rec.backend, _unique(chosen), narrowed=bool(suites))
    if suites:
        chosen = [catalog.suite(name, backend) for name in suites]
        backends = {s.backend for s in chosen}
        if len(backends) > 1:
            raise ScopeError(
                f"suites {', '.join(suites)} span backends {sorted(backends)}; run one backend at a time"
            )
        return Scope(None, chosen[0].backend, _unique(chosen))
    if backend is not None:
        return Scope(None, backend, catalog.suites_for_backend(backend))
    raise ScopeError("say what to run: --lane <lane>, or --suite <suite> (optionally with --backend)")


def _unique(suites) -> tuple[Suite, ...]:
    seen: dict[str, Suite] = {}
    for s in suites:
        seen.setdefault(s.name, s)
    return tuple(seen.values())


def default_cadence(scope: Scope) -> str:
    """The lane's cadence; without a lane, the least frequent of the suites' cadences."""
    if scope.lane is not None:
        return scope.lane.cadence
    return max((s.cadence for s in scope.suites), key=CADENCES.index, default=CADENCES[0])


def exclusion(reg: Registration, suite: Suite, cadence: str, labels: LabelSet | None) -> Exclusion | None:
    """Why this run does not execute `reg`, or None when it does."""
    if reg.disabled is not None:
        return Exclusion(reg.file, reg.suite, "disabled", reg.disabled)
    if reg.nightly and cadence == "regular":
        return Exclusion(
            reg.file, reg.suite, "nightly", "nightly=True: runs on nightly, weekly and release cadences"
        )
    if reg.backend != "cpu" or suite.is_gpu:
        if labels is not None and cadence == "regular" and not labels.admits(reg.labels):
            wanted = ", ".join(f"run-ci-{x}" for x in reg.labels)
            return Exclusion(
                reg.file, reg.suite, "labels", f"not requested: needs one of {wanted} or run-ci-all"
            )
    return None


def select(discovery: Discovery, scope: Scope, *, cadence: str, labels: LabelSet | None) -> Selection:
    """Split the scope's registrations into those that run and those that do not (and why)."""
    by_name = {s.name: s for s in scope.suites}
    selected, excluded = [], []
    for reg in discovery.registrations:
        suite = by_name.get(reg.suite)
        if reg.backend != scope.backend or suite is None:
            continue
        why = exclusion(reg, suite, cadence, labels)
        if why is None:
            selected.append(reg)
        else:
            excluded.append(why)
    return Selection(scope, cadence, labels, tuple(selected), tuple(excluded))
