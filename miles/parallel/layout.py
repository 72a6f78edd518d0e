"""Parallel layouts and every Megatron rule that rejects one, checked before a GPU is touched.

A layout is a frozen `ParallelConfig` (tp, pp, cp, ep, etp, sequence parallel, optional
first/last pipeline stage sizes); `validate(config, world_size, model)` returns a `Verdict`
whose violations name every factor and the nearest single change that makes the whole layout
valid ("ep=4 → ep=2 makes etp·ep·pp = 4 divide world 4").

The rules are checked in the order megatron-core meets them when a run starts: the rank grids
(`parallel_state.initialize_model_parallel`), then the model config (`TransformerConfig`),
the pipeline split (`get_num_layers_to_build`) and the MoE layer. So the first violation here
is the error megatron-core would raise; `miles.parallel.megatron` proves that by running it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace

ATTENTION_KINDS = ("gqa", "mla", "dsa")  # dsa: DeepSeek sparse attention (indexer + top-k)


@dataclass(frozen=True)
class ParallelConfig:
    """Megatron parallel degrees. `etp` (expert tensor parallel) defaults to `tp` when None."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sp: bool = False
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep", "etp", "first_stage_layers", "last_stage_layers"):
            value = getattr(self, name)
            if value is None and name in ("etp", "first_stage_layers", "last_stage_layers"):
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp must be true or false, got {self.sp!r}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def dense_size(self) -> int:
        """Ranks one replica of the dense (attention) part spans: tp·cp·pp."""
        return self.tp * self.cp * self.pp

    @property
    def expert_size(self) -> int:
        """Ranks one replica of the expert part spans: etp·ep·pp."""
        return self.expert_tp * self.ep * self.pp

    def dp(self, world_size: int) -> int:
        return world_size // self.dense_size

    def expert_dp(self, world_size: int) -> int:
        return world_size // self.expert_size

    def describe(self) -> str:
        text = f"tp{self.tp}·pp{self.pp}·cp{self.cp}·ep{self.ep}·etp{self.expert_tp}"
        if self.sp:
            text += "+sp"
        if self.first_stage_layers is not None or self.last_stage_layers is not None:
            text += f" stages(first={self.first_stage_layers}, last={self.last_stage_layers})"
        return text

    def trainer_args(self) -> tuple[tuple[str, int | bool | None], ...]:
        """The Megatron trainer flags for this layout as (flag, value) pairs, the names
        `python -m miles.train` parses; False or None means the flag is not passed."""
        return (
            ("--tensor-model-parallel-size", self.tp),
            ("--pipeline-model-parallel-size", self.pp),
            ("--context-parallel-size", self.cp),
            ("--expert-model-parallel-size", self.ep),
            ("--expert-tensor-parallel-size", self.expert_tp),
            ("--sequence-parallel", self.sp),
            ("--decoder-first-pipeline-num-layers", self.first_stage_layers),
            ("--decoder-last-pipeline-num-layers", self.last_stage_layers),
        )

    def trainer_flags(self) -> tuple[str, ...]:
        """`trainer_args()` as argv tokens."""
        out: list[str] = []
        for flag, value in self.trainer_args():
            if value is True:
                out.append(flag)
            elif value not in (None, False):
                out += [flag, str(value)]
        return tuple(out)

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ModelShape:
    """The facts of a model that parallel layouts depend on."""

    name: str
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # KV heads; None = one per attention head
    num_experts: int | None = None  # None = dense
    attention: str = "gqa"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"attention {self.attention!r} is not one of {', '.join(ATTENTION_KINDS)}")
        for name in ("num_layers", "num_attention_heads", "num_query_groups", "num_experts"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{self.name}: {name} must be an integer >= 1, got {value!r}")

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.num_query_groups is None else self.num_query_groups

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
    config: ParallelConfig
    world_size: int
    model: ModelShape | None
    violations: tuple[Violation, ...] = ()
    notes: tuple[str, ...] = ()  # what megatron-core only warns about

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def rules(self) -> tuple[str, ...]:
        return tuple(v.rule for v in self.violations)

    def summary(self) -> str:
        where = f" for {self.model.name}" if self.model else ""
        head = f"{self.config.describe()} on {self.world_size} rank(s){where}"
        if self.ok:
            return f"{head}: valid (dp={self.config.dp(self.world_size)})"
        return f"{head}: " + "; ".join(str(v) for v in self.violations)


class LayoutError(ValueError):
    """A layout breaks a Megatron rule; `.verdict` holds every violation."""

    def __init__(self, verdict: Verdict, where: str = "") -> None:
        self.verdict = verdict
        prefix = f"{where}: " if where else ""
        super().__init__(prefix + verdict.summary())


# --- the rules, in the order megatron-core checks them ---------------------------------------

Check = Callable[[ParallelConfig, int, ModelShape | None], str | None]


@dataclass(frozen=True)
class Rule:
    id: str
    check: Check  # message when violated, else None
    factors: tuple[str, ...]  # the ParallelConfig fields a fix may change, preferred first
    # What a fix achieves for this rule; without one, a fix is described by whether the
    # whole layout becomes valid.
    outcome: Callable[[ParallelConfig, int, ModelShape | None], str] | None = None
    needs_model: bool = False


def _dense_grid(c: ParallelConfig, world: int, m: ModelShape | None) -> str | None:
    if world % c.dense_size:
        return f"tp({c.tp})·cp({c.cp})·pp({c.pp}) = {c.dense_size} does not divide world size {world}"
    return None


def _expert_grid(c: ParallelConfig, world: int, m: ModelShape | None) -> str | None:
    if world % c.expert_size:
        etp = f"etp({c.expert_tp})" if c.etp is not None else f"etp(= tp, {c.expert_tp})"
        return f"{etp}·ep({c.ep})·pp({c.pp}) = {c.expert_size} does not divide world size {world}"
    return None


def _sp_needs_tp(c: ParallelConfig, world: int, m: ModelShape | None) -> str | None:
    if c.sp and c.tp <= 1:
        return f"sequence parallel splits activations over the tp group, so it needs tp > 1 (tp={c.tp})"
    return None


def _heads_tp(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    if m.num_attention_heads % c.tp:
        return f"{m.name}: {m.num_attention_heads} attention heads do not split evenly over tp({c.tp})"
    return None


def _kv_heads_tp(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    kv = m.kv_heads
    if kv % c.tp and c.tp % kv:
        return f"{m.name}: {kv} KV heads (query groups) are neither a multiple nor a divisor of tp({c.tp})"
    return None


def _ep_needs_moe(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    if c.ep > 1 and m.num_experts is None:
        return f"{m.name} is a dense model (no experts), so ep({c.ep}) must be 1"
    return None


def _stage_layers(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    if c.first_stage_layers is None and c.last_stage_layers is None:
        return None
    layers, stages = _middle(c, m)
    given = f"first stage {c.first_stage_layers}, last stage {c.last_stage_layers}"
    if stages < 0:
        # megatron-core accepts this and builds only the last stage's layers: a silently
        # truncated model. Refuse it here.
        return (
            f"{m.name}: pp({c.pp}) has one stage, which is both first and last, so {given} "
            f"cannot both be set; unset them (the stage holds all {m.num_layers} layers)"
        )
    if bool(layers) != bool(stages):
        return (
            f"{m.name}: {m.num_layers} layers with pp({c.pp}) and {given} leave {layers} layer(s) "
            f"for {stages} middle stage(s); both must be zero or both positive"
        )
    if stages and layers % stages:
        return (
            f"{m.name}: {m.num_layers} layers with pp({c.pp}) and {given} leave {layers} layer(s), "
            f"which do not split evenly over {stages} middle stage(s)"
        )
    if layers < 0:
        # megatron-core accepts this and builds a negative-size middle stage; refuse it here.
        return f"{m.name}: {given} add up to more than its {m.num_layers} layers"
    return None


def _middle(c: ParallelConfig, m: ModelShape) -> tuple[int, int]:
    layers, stages = m.num_layers, c.pp
    for given in (c.first_stage_layers, c.last_stage_layers):
        if given is not None:
            layers -= given
            stages -= 1
    return layers, stages


def _dsa_cp(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    if m.attention == "dsa" and c.cp > 1:
        return f"{m.name} uses DSA sparse attention, which megatron-core cannot split over cp({c.cp}); cp must be 1"
    return None


def _layers_pp(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    if c.first_stage_layers is None and c.last_stage_layers is None and m.num_layers % c.pp:
        return f"{m.name}: {m.num_layers} layers do not split evenly over pp({c.pp}) pipeline stages"
    return None


def _experts_ep(c: ParallelConfig, world: int, m: ModelShape) -> str | None:
    if m.num_experts is not None and m.num_experts % c.ep:
        return f"{m.name}: {m.num_experts} experts do not split evenly over ep({c.ep})"
    return None


RULES: tuple[Rule, ...] = (
    Rule("dense-grid", _dense_grid, ("tp", "cp", "pp"), lambda c, w, m: f"makes tp·cp·pp = {c.dense_size} divide world {w}"),
    Rule("expert-grid", _expert_grid, ("ep", "etp", "pp"), lambda c, w, m: f"makes etp·ep·pp = {c.expert_size} divide world {w}"),
    Rule("sp-needs-tp", _sp_needs_tp, ("sp", "tp")),
    Rule("heads-tp", _heads_tp, ("tp",), lambda c, w, m: f"splits {m.num_attention_heads} heads {m.num_attention_heads // c.tp} per tp rank", True),
    Rule("kv-heads-tp", _kv_heads_tp, ("tp",), lambda c, w, m: f"fits {m.kv_heads} KV heads to tp {c.tp}", True),
    Rule("ep-needs-moe", _ep_needs_moe, ("ep",), needs_model=True),
    Rule("stage-layers", _stage_layers, ("first_stage_layers", "last_stage_layers", "pp"), needs_model=True),
    Rule("dsa-cp", _dsa_cp, ("cp",), needs_model=True),
    Rule("layers-pp", _layers_pp, ("pp", "first_stage_layers", "last_stage_layers"), lambda c, w, m: _split_text(c, m), True),
    Rule("experts-ep", _experts_ep, ("ep",), lambda c, w, m: f"puts {m.num_experts // c.ep} experts on each ep rank", True),
)  # fmt: skip
RULE_IDS = tuple(r.id for r in RULES)


def _split_text(c: ParallelConfig, m: ModelShape) -> str:
    if c.first_stage_layers is None and c.last_stage_layers is None:
        return f"splits {m.num_layers} layers {m.num_layers // c.pp} per stage"
    return f"splits {m.num_layers} layers as {stage_sizes(c, m)}"


def stage_sizes(config: ParallelConfig, model: ModelShape) -> tuple[int, ...]:
    """Layers per pipeline stage, as megatron-core assigns them (assumes a valid layout)."""
    layers, stages = _middle(config, model)
    middle = layers // stages if stages else 0
    sizes = [middle] * config.pp
    if config.first_stage_layers is not None:
        sizes[0] = config.first_stage_layers
    if config.last_stage_layers is not None:
        sizes[-1] = config.last_stage_layers
    return tuple(sizes)


def _violated(config: ParallelConfig, world: int, model: ModelShape | None) -> Iterator[tuple[Rule, str]]:
    for rule in RULES:
        if rule.needs_model and model is None:
            continue
        message = rule.check(config, world, model)
        if message:
            yield rule, message


def validate(config: ParallelConfig, world_size: int, model: ModelShape | None = None) -> Verdict:
    """Every rule the layout breaks on `world_size` ranks, first the one megatron-core hits first.

    Without `model` only the rank-grid rules apply.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size must be an integer >= 1, got {world_size!r}")
    violations = tuple(
        Violation(rule.id, message, tuple(_fixes(rule, config, world_size, model)))
        for rule, message in _violated(config, world_size, model)
    )
    return Verdict(config, world_size, model, violations, tuple(_notes(config, model)))


def check(
    config: ParallelConfig, world_size: int, model: ModelShape | None = None, where: str = ""
) -> Verdict:
    """`validate`, raising `LayoutError` when the layout is not valid."""
    verdict = validate(config, world_size, model)
    if not verdict.ok:
        raise LayoutError(verdict, where)
    return verdict


def _notes(c: ParallelConfig, m: ModelShape | None) -> Iterator[str]:
    if c.ep > 1 and c.tp > 1 and not c.sp:
        yield "megatron-core warns that training with ep > 1 and tp > 1 should use sequence parallel"


# --- the nearest valid change ----------------------------------------------------------------

_MAX_FIXES = 2


def _fixes(rule: Rule, config: ParallelConfig, world: int, model: ModelShape | None) -> Iterator[str]:
    """Single-factor changes that clear this rule, best first: ones that make the whole layout
    valid before ones that only clear this rule, then the smallest change."""
    found = []
    for order, name in enumerate(rule.factors):
        for value in _candidates(name, config, world, model):
            changed = _with(config, name, value)
            if changed is None or rule.check(changed, world, model):
                continue
            whole = next(_violated(changed, world, model), None) is None
            spread = _imbalance(changed, model) if whole else 0
            found.append((not whole, _distance(name, config, value), spread, order, name, value, changed))
    found.sort(key=lambda f: f[:4])
    for partial, *_, name, value, changed in found[:_MAX_FIXES]:
        if rule.outcome is not None:
            outcome = rule.outcome(changed, world, model)
        else:
            outcome = (
                f"clears {rule.id}, but the layout still breaks another rule"
                if partial
                else "makes the layout valid"
            )
        yield f"{_show(name, config)} → {name}={_show_value(name, value)} {outcome}"


def _imbalance(config: ParallelConfig, model: ModelShape | None) -> int:
    """How unevenly a valid layout spreads layers over pipeline stages (0 = evenly)."""
    if model is None:
        return 0
    sizes = stage_sizes(config, model)
    return max(sizes) - min(sizes)


def _candidates(name: str, c: ParallelConfig, world: int, m: ModelShape | None) -> list:
    if name == "sp":
        return [not c.sp]
    if name in ("first_stage_layers", "last_stage_layers"):
        top = m.num_layers if m else 0
        return [None, *range(1, top + 1)]
    return list(range(1, world + 1))


def _with(c: ParallelConfig, name: str, value) -> ParallelConfig | None:
    current = c.expert_tp if name == "etp" else getattr(c, name)
    if value == current:
        return None
    return replace(c, **{name: value})


def _distance(name: str, c: ParallelConfig, value) -> float:
    if name == "sp":
        return 1.0
    current = c.expert_tp if name == "etp" else getattr(c, name)
    if current is None or value is None:
        # Setting or clearing an explicit stage size keeps every degree, so it ranks just
        # before halving or doubling one.
        return 0.9
    return abs(math.log2(value) - math.log2(current)) + (0.01 if value > current else 0.0)


def _show(name: str, c: ParallelConfig) -> str:
    current = c.expert_tp if name == "etp" else getattr(c, name)
    return f"{name}={_show_value(name, current)}"


def _show_value(name: str, value) -> str:
    if name == "sp":
        return "on" if value else "off"
    return "unset" if value is None else str(value)
