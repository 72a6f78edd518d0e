"""The statistical gate: compare a run's metric values with their trusted history.

Per coordinate the baseline is the median of the last K trusted values of the same
(test, backend, suite, coordinate). The value passes when it lies within the band around
it: `max(rel * |ref|, abs_floor)` below and above, widened to `mad_k` robust standard
deviations (1.4826 * MAD) when the history itself is that noisy. With fewer than
`min_history` values the check is INACTIVE (cold start, not a failure). A non-finite
value, or a declared metric or step the run never logged, is an ERROR. A run is trusted
iff no check FAILs or ERRORs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from miles.metrics.capture import encode_value
from miles.metrics.records import MetricSeries
from miles.metrics.spec import LAST_STEP, Band, Coordinate, GateSpec

PASS, FAIL, INACTIVE, ERROR = "PASS", "FAIL", "INACTIVE", "ERROR"
_SEVERITY = {INACTIVE: 0, PASS: 1, FAIL: 2, ERROR: 3}
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this is its standard deviation


@dataclass(frozen=True)
class GatePolicy:
    k: int = 20  # trusted history values the baseline is the median of
    min_history: int = 5  # below this the check is INACTIVE
    mad_k: float = 3.0  # noise widening in robust standard deviations; 0 turns it off

    def __post_init__(self) -> None:
        if self.k < 1 or self.min_history < 1 or self.min_history > self.k or self.mad_k < 0:
            raise ValueError(
                f"gate policy k={self.k}, min_history={self.min_history}, mad_k={self.mad_k}: "
                "need 1 <= min_history <= k and mad_k >= 0"
            )


@dataclass(frozen=True)
class Check:
    """One coordinate of one gate: the value, the band it was held to, and the result."""

    coordinate: Coordinate
    status: str
    value: float | None = None
    ref: float | None = None
    low: float | None = None
    high: float | None = None
    history: int = 0
    step: int | None = None  # the step the value was logged at (for steps="last")
    message: str = ""

    def to_json(self) -> dict:
        return {
            "metric": self.coordinate.metric,
            "steps_key": self.coordinate.steps_key,
            "constraint_key": self.coordinate.constraint_key,
            "step": self.coordinate.step,
            "logged_step": self.step,
            "status": self.status,
            "value": None if self.value is None else encode_value(self.value),
            "ref": self.ref,
            "low": self.low,
            "high": self.high,
            "history": self.history,
            "message": self.message,
        }


@dataclass(frozen=True)
class GateVerdict:
    """The result of one declared gate: the worst of its checks."""

    metric: str
    steps_key: str
    status: str
    enforce: bool
    message: str
    checks: tuple[Check, ...] = field(default=())
    where: str = ""

    @property
    def failed(self) -> bool:
        return self.status in (FAIL, ERROR)

    def summary(self) -> str:
        mode = "enforce" if self.enforce else "shadow"
        return f"{self.status:<8} {self.metric} [{self.steps_key}] ({mode}): {self.message}"

    def to_json(self) -> dict:
        return {
            "metric": self.metric,
            "steps": self.steps_key,
            "status": self.status,
            "enforce": self.enforce,
            "message": self.message,
            "where": self.where,
            "checks": [c.to_json() for c in self.checks],
        }


def observed_values(
    spec: GateSpec, series: MetricSeries | None
) -> tuple[list[tuple[Coordinate, int, float]], str]:
    """(coordinate, logged step, value) for each step the gate checks, and an error text.

    The error is non-empty when the metric never appeared or a declared step is missing.
    """
    if series is None or not series.points:
        return [], f"declared metric '{spec.metric}' was never logged by the run ({spec.where})"
    if spec.steps == "last":
        step, value = series.last()
        return [(spec.coordinate(LAST_STEP), step, value)], ""
    if spec.steps == "all":
        return [(spec.coordinate(step), step, value) for step, value in series.points], ""
    found, missing = [], []
    for step in spec.steps:
        value = series.at(step)
        if value is None:
            missing.append(step)
        else:
            found.append((spec.coordinate(step), step, value))
    error = ""
    if missing:
        logged = series.steps
        shown = f"{logged[0]}..{logged[-1]}" if len(logged) > 1 else str(logged[0])
        error = (
            f"'{spec.metric}' has no value at step(s) {missing}; the run logged steps {shown} ({spec.where})"
        )
    return found, error


def check_value(
    coordinate: Coordinate,
    value: float,
    history: Sequence[float],
    band: Band,
    policy: GatePolicy,
    *,
    step: int | None = None,
) -> Check:
    """Hold one value to the band around the median of its (newest-first) history."""
    history = [h for h in history[: policy.k] if math.isfinite(h)]
    if not math.isfinite(value):
        return Check(coordinate, ERROR, value, history=len(history), step=step, message=f"value is {value}")
    if len(history) < policy.min_history:
        return Check(
            coordinate,
            INACTIVE,
            value,
            history=len(history),
            step=step,
            message=f"cold start: {len(history)} trusted value(s), needs {policy.min_history}",
        )
    ref = statistics.median(history)
    below, above = band.half_widths(ref)
    noise = policy.mad_k * MAD_TO_SIGMA * statistics.median(abs(h - ref) for h in history)
    low, high = ref - max(below, noise), ref + max(above, noise)
    inside = low <= value <= high
    where = "inside" if inside else ("below" if value < low else "above")
    message = f"{value:.6g} is {where} [{low:.6g}, {high:.6g}] around median {ref:.6g} of {len(history)}"
    return Check(coordinate, PASS if inside else FAIL, value, ref, low, high, len(history), step, message)


def evaluate(
    spec: GateSpec,
    series: MetricSeries | None,
    history: Mapping[Coordinate, Sequence[float]],
    policy: GatePolicy,
    *,
    enforce: bool,
    history_note: str = "",
) -> GateVerdict:
    """Run one gate over a run's series. `history` maps coordinates to newest-first values.

    `history_note`, when set, says the history could not be read: value checks are then
    INACTIVE with that note, while missing or non-finite values are still ERRORs.
    """
    observed, error = observed_values(spec, series)
    checks = []
    for coordinate, step, value in observed:
        if history_note and math.isfinite(value):
            checks.append(Check(coordinate, INACTIVE, value, step=step, message=history_note))
        else:
            checks.append(
                check_value(coordinate, value, history.get(coordinate, ()), spec.band, policy, step=step)
            )
    return verdict_of(spec, checks, error, enforce=enforce)


def verdict_of(spec: GateSpec, checks: Iterable[Check], error: str, *, enforce: bool) -> GateVerdict:
    checks = tuple(checks)
    if error:
        return GateVerdict(spec.metric, spec.steps_key, ERROR, enforce, error, checks, spec.where)
    if not checks:
        return GateVerdict(spec.metric, spec.steps_key, ERROR, enforce, "no value to check", (), spec.where)
    worst = max(checks, key=lambda c: _SEVERITY[c.status])
    message = worst.message
    if len(checks) > 1:
        counts = {s: sum(c.status == s for c in checks) for s in (PASS, FAIL, INACTIVE, ERROR)}
        tally = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        message = f"{tally}; worst at {worst.coordinate.label()}: {worst.message}"
    return GateVerdict(spec.metric, spec.steps_key, worst.status, enforce, message, checks, spec.where)


def error_verdict(spec: GateSpec, message: str, *, enforce: bool) -> GateVerdict:
    return GateVerdict(spec.metric, spec.steps_key, ERROR, enforce, message, (), spec.where)


def is_trusted(verdicts: Iterable[GateVerdict]) -> bool:
    """A run is trusted iff no check failed or errored (INACTIVE ones do not count against it)."""
    return not any(v.failed for v in verdicts)
