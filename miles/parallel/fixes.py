"""The nearest single changes that clear a violated rule, each re-checked against every rule.

Candidates for a parallel degree are the divisors of the world size (no valid layout uses
another value), so the search costs O(divisors of W) layouts, not O(W). Each offered fix is
validated as a whole: one that clears its rule but breaks another (or leaves another broken)
says which rule and why.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

from miles.parallel.layout import CP_COMM_TYPES, ModelShape, ParallelLayout
from miles.parallel.numbers import divisors
from miles.parallel.rules import Context, Rule, stage_sizes, violated

MAX_FIXES = 2
_GRID_FACTORS = ("tp", "pp", "cp", "ep", "etp")


def fixes(rule: Rule, layout: ParallelLayout, context: Context) -> Iterator[str]:
    """Single-factor changes that clear `rule`, best first: ones that make the whole layout
    valid before ones that leave it invalid, then the smallest change."""
    found = []
    for order, name in enumerate(rule.factors):
        for value in _candidates(name, layout, context):
            changed = _with(layout, name, value)
            if changed is None or rule.check(changed, context):
                continue
            rest = next(violated(changed, context), None)
            spread = _imbalance(changed, context.model) if rest is None else 0
            found.append(
                (rest is not None, _distance(name, layout, value), spread, order, name, value, changed, rest)
            )
    found.sort(key=lambda f: f[:4])
    for _, _, _, _, name, value, changed, rest in found[:MAX_FIXES]:
        if rule.outcome is not None:
            outcome = rule.outcome(changed, context)
        else:
            outcome = f"clears {rule.id}" if rest else "makes the layout valid"
        if rest is not None:
            other, message = rest
            outcome += f", but the layout would still be invalid ({other.id}: {message})"
        yield f"{_show(name, layout)} → {name}={_show_value(name, value)} {outcome}"


def _candidates(name: str, c: ParallelLayout, x: Context) -> list:
    if name == "sp":
        return [not c.sp]
    if name == "cp_comm_type":
        return [None, *CP_COMM_TYPES]
    if name in ("first_stage_layers", "last_stage_layers"):
        top = x.model.num_layers if x.model else 0
        return [None, *range(1, top + 1)]
    if name == "vpp":  # one virtual stage per rank is no virtual pipeline (None)
        return [None, *(d for d in (divisors(x.model.num_layers) if x.model else ()) if d > 1)]
    if name in _GRID_FACTORS:
        return divisors(x.world)
    raise ValueError(f"no fix candidates for {name}")


def _with(c: ParallelLayout, name: str, value) -> ParallelLayout | None:
    if value == _current(c, name):
        return None
    changed = replace(c, **{name: value})
    return None if changed == c else changed


def _current(c: ParallelLayout, name: str):
    return c.expert_tp if name == "etp" else getattr(c, name)


def _imbalance(layout: ParallelLayout, model: ModelShape | None) -> int:
    """How unevenly a valid layout spreads layers over pipeline stages (0 = evenly)."""
    if model is None:
        return 0
    sizes = stage_sizes(layout, model)
    return max(sizes) - min(sizes)


def _distance(name: str, c: ParallelLayout, value) -> float:
    if name == "sp":
        return 1.0
    if name == "cp_comm_type":
        return 0.5  # a communication choice keeps every degree
    current = _current(c, name)
    if current is None or value is None:
        # Setting or clearing an explicit stage size or vpp keeps every degree, so it ranks
        # just before halving or doubling one.
        return 0.9
    return abs(math.log2(value) - math.log2(current)) + (0.01 if value > current else 0.0)


def _show(name: str, c: ParallelLayout) -> str:
    return f"{name}={_show_value(name, _current(c, name))}"


def _show_value(name: str, value) -> str:
    if name == "sp":
        return "on" if value else "off"
    return "unset" if value is None else str(value)
