"""Every difference between a recipe's shared form and a platform form of it, and between a
form and the reference recipe it follows (miles.recipes.fidelity)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from miles.parallel import ParallelLayout
from miles.recipes.args import Args
from miles.recipes.fidelity import Comparison, Line, Placement, compare
from miles.recipes.launch import RunOptions, build_plan
from miles.recipes.recipe import GROUPS, ParallelProfile, Recipe
from miles.recipes.stack import stack_problems


def recipe_diff(shared: Recipe, other: Recipe) -> list[str]:
    """Lines `+ added`, `- removed`, `~ changed` for flags by group, environment, profiles and
    pins; an empty list means the two forms are the same."""
    lines: list[str] = []
    for group in GROUPS:
        lines += _section(group, _pairs(shared.group(group)), _pairs(other.group(group)), " ")
    lines += _section("env", dict(shared.env), dict(other.env), "=")
    lines += _section("pins", dict(shared.pins), dict(other.pins), "==")
    if shared.fp8_rollout != other.fp8_rollout:
        lines += [
            "rollout checkpoint:",
            f"  ~ fp8 {_yes(shared.fp8_rollout)} -> fp8 {_yes(other.fp8_rollout)}",
        ]
    lines += _profiles(shared, other)
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _pairs(args: Args) -> dict[str, str]:
    return {flag: _shown(value) for flag, value in args}


def _shown(value) -> str:
    if value is True:
        return ""
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return str(value)


def _section(title: str, old: dict[str, str], new: dict[str, str], sep: str) -> list[str]:
    def item(key: str, value: str) -> str:
        return key if value == "" else f"{key}{sep}{value}"

    body = []
    for key in old:
        if key not in new:
            body.append(f"  - {item(key, old[key])}")
        elif old[key] != new[key]:
            body.append(f"  ~ {item(key, old[key])} -> {item(key, new[key])}")
    body += [f"  + {item(key, value)}" for key, value in new.items() if key not in old]
    return [f"{title}:", *body] if body else []


def _profiles(shared: Recipe, other: Recipe) -> list[str]:
    old = {p.key: p for p in shared.profiles}
    new = {p.key: p for p in other.profiles}
    body = [f"  - {p.describe()}" for k, p in old.items() if k not in new]
    for k, p in new.items():
        if k not in old:
            body.append(f"  + {p.describe()}" + (f"  [{p.source}]" if p.source else ""))
        elif old[k] != p:
            body.append(f"  ~ {old[k].describe()} -> {p.describe()}")
    return ["profiles:", *body] if body else []


# Placeholder roots: the rendered command and the reference readings name the same places alike.
RENDER_OPTIONS = RunOptions(
    model_dir="{model_dir}",
    data_dir="{data_dir}",
    output_dir="{output_dir}",
    run_id="{run_id}",
    python="python",
)


@dataclass(frozen=True)
class ProfileComparison:
    """One profile's rendered command beside the reference reading it is held to."""

    form: Recipe
    profile: ParallelProfile
    comparison: Comparison

    @property
    def unexplained(self) -> tuple[Line, ...]:
        return self.comparison.unexplained


def rendered(form: Recipe, profile: ParallelProfile) -> tuple[tuple[str, ...], dict[str, str]]:
    """The trainer argv and job variables the launcher would run for `profile` (render-time
    additions included), with placeholder roots, before the stack check."""
    options = replace(
        RENDER_OPTIONS, model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node
    )
    plan = build_plan(form, options, profile.platform, base_env={}, check=False)
    return plan.train_args, dict(plan.env)


def reference_comparisons(form: Recipe, platform: str) -> list[ProfileComparison]:
    """Every `platform` profile of `form` beside its reference reading (none without references)."""
    out = []
    for profile in (p for p in form.profiles if p.platform == platform):
        reference = form.reference_for(profile)
        if reference is None:
            continue
        argv, env = rendered(form, profile)
        # a fallback backend renders no Megatron layout: its ranks are all data-parallel
        parallel = profile.parallel if form.backend_of(profile) == "megatron" else ParallelLayout()
        layout = Placement(profile.world_size, parallel, profile.rollout_gpus_per_engine)
        comparison = compare(argv, env, layout, reference, form.explained)
        problems = tuple(
            Line("!", flag, problem, "", None) for flag, problem in stack_problems(argv, platform)
        )
        if problems:
            comparison = replace(comparison, lines=(*problems, *comparison.lines))
        out.append(ProfileComparison(form, profile, comparison))
    return out
