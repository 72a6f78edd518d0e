"""Check a parallel layout against every Megatron rule before a GPU is touched.

`validate(layout, world_size, model)` returns a `Verdict` whose violations name every factor
and the nearest single change that makes the whole layout valid ("ep=4 → ep=2 makes
etp·ep·pp = 4 divide world 4"), first the one megatron-core would raise first (the rules and
their order are in `miles.parallel.rules`). What Megatron only warns about, or changes
silently, is in `Verdict.notes`; what the job's environment must hold is `required_env()`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from miles.parallel.fixes import fixes
from miles.parallel.layout import ModelShape, ParallelLayout
from miles.parallel.rules import FALLBACK_MEGATRON_CORE, Context, installed_megatron_core, violated

# Megatron-LM refuses to start tp > 1 or cp > 1 on GPUs before Blackwell (H200, MI350) unless
# the CUDA runtime keeps one hardware queue, so its communication kernels are ordered.
DEVICE_MAX_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


@dataclass(frozen=True)
class Violation:
    rule: str  # id of the rule, e.g. "expert-grid"
    message: str  # names every factor and the world size
    fixes: tuple[str, ...] = ()  # nearest single changes, best first

    def __str__(self) -> str:
        if not self.fixes:
            return self.message
        return f"{self.message}; " + " or ".join(self.fixes)


@dataclass(frozen=True)
class Verdict:
    layout: ParallelLayout
    world_size: int
    model: ModelShape | None
    violations: tuple[Violation, ...] = ()
    notes: tuple[str, ...] = ()  # what Megatron only warns about or silently changes
    megatron_core: str = FALLBACK_MEGATRON_CORE  # the release whose rules were applied

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(v.rule for v in self.violations)

    def summary(self) -> str:
        where = f" for {self.model.name}" if self.model else ""
        head = f"{self.layout.describe()} on {self.world_size} rank(s){where}"
        if self.ok:
            return f"{head}: valid (dp={self.layout.dp(self.world_size)})"
        return f"{head}: " + "; ".join(str(v) for v in self.violations)

    def headline(self) -> str:
        """The verdict in one line: valid, or the first broken rule and its message."""
        where = f" for {self.model.name}" if self.model else ""
        head = f"layout {self.layout.describe()} on {self.world_size} rank(s){where}"
        if self.ok:
            return f"{head}: valid"
        first = self.violations[0]
        more = f" (+{len(self.violations) - 1} more)" if len(self.violations) > 1 else ""
        return f"{head}: INVALID, {first.rule}: {first.message}{more}"


class InvalidParallelism(ValueError):
    """A layout breaks a Megatron rule; `.verdict` holds every violation."""

    def __init__(self, verdict: Verdict, where: str = "") -> None:
        self.verdict = verdict
        prefix = f"{where}: " if where else ""
        super().__init__(prefix + verdict.summary())


def resolve_megatron_core(version: str | None) -> tuple[str, bool]:
    """(the release whose rules apply, whether it was assumed): the named one, else the
    installed one, else the strictest known (0.16.1)."""
    if version:
        return version, False
    installed = installed_megatron_core()
    return (installed, False) if installed else (FALLBACK_MEGATRON_CORE, True)


def validate(
    layout: ParallelLayout,
    world_size: int,
    model: ModelShape | None = None,
    megatron_core: str | None = None,
) -> Verdict:
    """Every rule the layout breaks on `world_size` ranks, first the one megatron-core hits first.

    Without `model` only the rank-grid rules apply. `megatron_core` names the release whose
    rules apply (default: the installed one).
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    version, assumed = resolve_megatron_core(megatron_core)
    context = Context(world_size, model, version)
    violations = tuple(
        Violation(rule.id, message, tuple(fixes(rule, layout, context)))
        for rule, message in violated(layout, context)
    )
    notes = list(_notes(layout, model))
    if assumed:
        notes.append(
            f"megatron-core is not installed: the rules of {version} apply (name one to change that)"
        )
    return Verdict(layout, world_size, model, violations, tuple(notes), version)


def check(
    layout: ParallelLayout,
    world_size: int,
    model: ModelShape | None = None,
    where: str = "",
    megatron_core: str | None = None,
) -> Verdict:
    """`validate`, raising `InvalidParallelism` when the layout is not valid."""
    verdict = validate(layout, world_size, model, megatron_core)
    if not verdict.ok:
        raise InvalidParallelism(verdict, where)
    return verdict


def required_env(layout: ParallelLayout) -> dict[str, str]:
    """Environment the training processes of this layout need on the GPU platforms."""
    if layout.tp > 1 or layout.cp > 1:
        return {DEVICE_MAX_CONNECTIONS: "1"}
    return {}


def env_problems(layout: ParallelLayout, env: Mapping[str, str]) -> list[str]:
    """What `env` (a launch environment) lacks of `required_env(layout)`, one line each."""
    out = []
    for key, wanted in required_env(layout).items():
        found = env.get(key)
        if found != wanted:
            shown = "unset" if found is None else f"{key}={found}"
            out.append(
                f"{layout.describe()} needs {key}={wanted} in the launch environment (tp > 1 or cp > 1: "
                f"Megatron-LM refuses to start otherwise on H200 and MI350), found {shown}"
            )
    return out


def _notes(c: ParallelLayout, m: ModelShape | None) -> Iterator[str]:
    if c.sp and c.tp == 1:
        yield "sequence parallel with tp=1: Megatron-LM turns it off with a warning, so this layout runs without it"
    if c.ep > 1 and c.tp > 1 and not c.effective_sp and m is None:
        yield "megatron-core warns that training with ep > 1 and tp > 1 should use sequence parallel"
    if c.cp_comm_type is not None and c.cp == 1:
        yield f"cp_comm_type {c.cp_comm_type} has no effect with cp=1"
    if required_env(c):
        yield f"the launch environment needs {DEVICE_MAX_CONNECTIONS}=1 (tp > 1 or cp > 1)"
