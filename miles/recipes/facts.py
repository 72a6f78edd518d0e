"""The fidelity table: every published config.json value beside the Megatron flag that carries it.

Each row is a config.json key of the model (typed in once, with its source, in
the recipe module that trains it), the flag its family's facts table (`miles.families`) maps it to, the
value that row derives from it, and the value the recipe's model flags (at full depth) give
that flag: `ok` when they agree, `DIFFERS` when not, `choice` when the recipe trains with
another value on purpose (the spec says why), `gap` when the key is something megatron-core
cannot express (a `Gap` of the spec says what and how the reference gets it), `model` when
the Megatron model reads the key from config.json itself (the family's `read_by_model`),
`UNMAPPED` when no row and no gap covers it. A recipe is true to its model when no row DIFFERS or is
UNMAPPED; tests/unit/test_recipe_facts.py holds all five to that.
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.families import family
from miles.families.facts import ABSENT, layer_pattern, shown
from miles.recipes.args import Args
from miles.recipes.models import ModelSpec


@dataclass(frozen=True)
class Row:
    key: str
    published: object
    source: str
    flag: str  # "" when no rule maps the key
    expected: str  # what the flag should be ("" when unmapped or a gap)
    recipe: str  # what the recipe passes ("(not passed)" when absent)
    status: str  # ok | choice | gap | model | DIFFERS | UNMAPPED
    note: str = ""  # the gap's feature, the choice's reason, or why an optional flag is left out

    @property
    def bad(self) -> bool:
        return self.status in ("DIFFERS", "UNMAPPED")


def rows(spec: ModelSpec) -> list[Row]:
    """The fidelity table of `spec` (empty without published values)."""
    if spec.published is None:
        return []
    flags = _flags(spec.model_args())
    gaps = {key: gap for gap in spec.gaps for key in gap.keys}
    choices = dict(spec.choices)
    table = family(spec.family)
    published = dict(spec.published.values)
    out = []
    for key, value in spec.published.values:
        source = spec.published.source_of(key)
        gap = gaps.get(key)
        rule = table.key(key)
        if rule is None and key in table.read_by_model:
            out.append(Row(key, value, source, "", "", "", "model", table.read_by_model[key]))
            continue
        if rule is None:
            status = "gap" if gap else "UNMAPPED"
            out.append(Row(key, value, source, "", "", "", status, gap.feature if gap else ""))
            continue
        expected = shown(rule.derive(value, published))
        passed = flags.get(rule.flag, ABSENT)
        if passed is ABSENT:
            recipe = "(not passed)" if rule.default is ABSENT else f"{shown(rule.default)} (default)"
            actual = None if rule.default is ABSENT else shown(rule.default)
        else:
            recipe = actual = shown(passed)
        if actual == expected:
            status, note = "ok", ""
        elif actual is None and rule.optional:
            status, note = "ok", rule.optional
        elif key in choices:
            status, note = "choice", choices[key]
        elif gap:
            status, note = "gap", gap.feature
        else:
            status, note = "DIFFERS", ""
        out.append(Row(key, value, source, rule.flag, expected, recipe, status, note))
    return out


def _flags(args: Args) -> dict[str, object]:
    out: dict[str, object] = {}
    for flag, value in args:
        out[flag] = layer_pattern(str(value)) if flag == "--moe-layer-freq" else value
    return out


def format_table(name: str, spec: ModelSpec) -> str:
    lines = [f"{spec.name} ({name}): published config.json beside the recipe's Megatron flags (full depth)"]
    if spec.published is None:
        return lines[0] + "\n  (no published values recorded)"
    lines.append(f"  source: {spec.published.source}")
    table = rows(spec)
    width = max(len(r.key) for r in table)
    for r in table:
        value = shown(r.published) if not isinstance(r.published, tuple) else str(list(r.published))
        target = (
            f"{r.flag} {r.expected}".strip()
            if r.flag
            else "(read from config.json)"
            if r.status == "model"
            else "(no Megatron flag)"
        )
        mark = r.status if r.status != "ok" else "ok"
        tail = f"  [{r.note}]" if r.note else ""
        lines.append(f"  {r.key:<{width}}  {value:<12} -> {target:<48} recipe {r.recipe:<16} {mark}{tail}")
    own = {k for k, _ in spec.published.sources}
    for key in sorted(own):
        lines.append(f"  source of {key}: {spec.published.source_of(key)}")
    if spec.gaps:
        lines.append("  megatron-core (as pinned) cannot express:")
        lines += [f"    - {gap.feature}: {gap.why}" for gap in spec.gaps]
    if spec.known_differences:
        lines.append("  the rollout engine computes otherwise than the trainer (transformers' math):")
        lines += [f"    - {what}: {why}" for what, why in spec.known_differences]
    return "\n".join(lines)
