"""What a `register_ci_gate(...)` declaration means once defaults are filled in.

The CI's discovery reads the literal arguments (its GateDeclaration); this module
turns one into a `GateSpec`: the band each side of the baseline (the declared constraint
merged over the metric's defaults), which steps are checked, and the coordinates under
which values are stored. A coordinate is (metric, steps key, constraint key, step); the
history of one coordinate for one (test, backend, suite) is what a new value is compared
with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

CONSTRAINT_KEYS = ("rel_up", "abs_floor_up", "rel_down", "abs_floor_down")
LAST_STEP = -1  # the coordinate step of steps="last": the final logged value, whatever its step


@dataclass(frozen=True)
class Band:
    """Allowed distance from the baseline: max(rel * |ref|, abs_floor) on each side."""

    rel_up: float
    abs_floor_up: float
    rel_down: float
    abs_floor_down: float

    def half_widths(self, ref: float) -> tuple[float, float]:
        """(below, above) distances from `ref` that still pass, before any noise widening."""
        below = max(self.rel_down * abs(ref), self.abs_floor_down)
        above = max(self.rel_up * abs(ref), self.abs_floor_up)
        return below, above

    def to_json(self) -> dict[str, float]:
        return {key: getattr(self, key) for key in CONSTRAINT_KEYS}


# Bands for the standard metrics, so `register_ci_gate(metric_key="train/grad_norm")` is a
# complete gate. Each floor is the metric's natural noise near zero; each rel is how far a
# healthy run of an unchanged recipe strays from the median of its history.
DEFAULT_BANDS: Mapping[str, Band] = {
    # Gradient norm: noisy step to step; a doubling or halving is a different optimisation.
    "train/grad_norm": Band(rel_up=0.5, abs_floor_up=1e-3, rel_down=0.5, abs_floor_down=1e-3),
    # PPO KL between the policy before and after an update: near zero and noisy in sign.
    # Tripling (or swinging twice its size the other way) means the step size changed.
    "train/ppo_kl": Band(rel_up=2.0, abs_floor_up=1e-3, rel_down=2.0, abs_floor_down=1e-3),
    # Trainer vs rollout log-probabilities: only precision noise is healthy. A fall is
    # harmless, a rise means the two engines no longer compute the same policy.
    "train/train_rollout_logprob_abs_diff": Band(
        rel_up=0.5, abs_floor_up=0.01, rel_down=1.0, abs_floor_down=0.01
    ),
    "train/train_rollout_kl": Band(rel_up=1.0, abs_floor_up=1e-3, rel_down=1.0, abs_floor_down=1e-3),
    # Reward: a collapse is the failure that matters; a rise is checked loosely.
    "rollout/raw_reward": Band(rel_up=0.5, abs_floor_up=0.1, rel_down=0.25, abs_floor_down=0.05),
}
# Any other metric (a test's own, e.g. "ci/r3_mismatch_fraction"): half its value either way,
# and never tighter than 0.001, which suits the rates and fractions tests usually gate.
GENERIC_BAND = Band(rel_up=0.5, abs_floor_up=1e-3, rel_down=0.5, abs_floor_down=1e-3)


class Declaration(Protocol):
    """What a gate declaration carries (the CI registry's GateDeclaration has these)."""

    file: str
    line: int
    metric_key: str
    steps: str | tuple[int, ...]
    constraint: tuple[tuple[str, float], ...]
    enforce: bool


@dataclass(frozen=True, order=True)
class Coordinate:
    metric: str
    steps_key: str
    constraint_key: str
    step: int

    def label(self) -> str:
        step = "last" if self.step == LAST_STEP else f"step {self.step}"
        return f"{self.metric} @ {step}"


@dataclass(frozen=True)
class GateSpec:
    metric: str
    steps: str | tuple[int, ...]
    band: Band
    enforce: bool
    constraint_key: str
    file: str = ""
    line: int = 0

    @property
    def steps_key(self) -> str:
        return self.steps if isinstance(self.steps, str) else ",".join(str(s) for s in self.steps)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}" if self.file else self.metric

    def coordinate(self, step: int) -> Coordinate:
        return Coordinate(self.metric, self.steps_key, self.constraint_key, step)


MAX_METRIC_KEY = 200


def metric_key_problem(key: object) -> str | None:
    """Why `key` cannot name a gated metric, or None. A key is stored, printed and matched
    against training records, so it is printable text (no control character, newline or
    lone surrogate, which no store can encode) of at most MAX_METRIC_KEY characters."""
    if not isinstance(key, str) or not key.strip():
        return f"metric_key={key!r} must be a non-empty string such as 'train/grad_norm'"
    if len(key) > MAX_METRIC_KEY:
        return f"metric_key of {len(key)} characters is longer than {MAX_METRIC_KEY}; name the metric shortly"
    if not key.isprintable() or key != key.strip():
        shown = key.encode("unicode_escape", "backslashreplace").decode("ascii")
        return (
            f"metric_key='{shown}' must be printable text without control characters, lone surrogates "
            "or surrounding spaces (the stores and the reports hold it as is)"
        )
    return None


def constraint_key(constraint: Mapping[str, float]) -> str:
    """Canonical text of the constraint as declared ("{}" for the defaults).

    Keyed as declared rather than as merged so that retuning the shipped defaults keeps the
    history, while a test that declares a different band starts a history of its own.
    """
    return json.dumps({k: float(constraint[k]) for k in sorted(constraint)}, separators=(",", ":"))


def default_band(metric: str) -> Band:
    return DEFAULT_BANDS.get(metric, GENERIC_BAND)


def gate_spec(decl: Declaration) -> GateSpec:
    """The full gate a declaration describes: its constraint merged over the metric's defaults."""
    declared = dict(decl.constraint)
    base = default_band(decl.metric_key)
    merged = {key: float(declared.get(key, getattr(base, key))) for key in CONSTRAINT_KEYS}
    steps = decl.steps if isinstance(decl.steps, str) else tuple(sorted(set(decl.steps)))
    return GateSpec(
        metric=decl.metric_key,
        steps=steps,
        band=Band(**merged),
        enforce=bool(decl.enforce),
        constraint_key=constraint_key(declared),
        file=decl.file,
        line=decl.line,
    )
