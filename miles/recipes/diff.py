"""Every difference between a recipe's shared form and a platform form of it, and between a
form and the reference recipe it follows (miles.recipes.fidelity)."""

from __future__ import annotations

from miles.recipes.args import Args
from miles.recipes.recipe import GROUPS, Recipe, RecipeError


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


def reference_comparison(form: Recipe, platform: str):
    """The recipe form for `platform` beside its reference recipe (None when it has none)."""
    from miles.recipes.fidelity import Placement, compare
    from miles.recipes.launch import RunOptions, build_plan

    reference = form.reference(platform)
    if reference is None:
        return None
    profiles = [p for p in form.profiles if p.platform == platform]
    if not profiles:
        raise RecipeError(
            f"{form.name} ({form.variant}) has no {platform} profile to set beside its reference"
        )
    profile = max(profiles, key=lambda p: (p.model == reference.model, p.world_size))
    fields = {name: f"{{{name}}}" for name in ("hf_checkpoint", "hf_dir", "ref_load", "torch_dist_dir",
                                               "save_dir", "run_dir", "model_dir", "data_dir", "run_id",
                                               "model_name")}  # fmt: skip
    fields |= {
        "nodes": profile.nodes,
        "gpus_per_node": profile.gpus_per_node,
        "world_size": profile.world_size,
    }
    fields["rollout_gpus_per_engine"] = profile.rollout_gpus_per_engine
    args = []
    for group, group_args in form.arg_groups(profile, fields, env={}):
        if group == "model":
            group_args = form.resolve(reference.model, env={}).model_args()
        args += list(group_args)
    options = RunOptions(model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node)
    env = dict(build_plan(form, options, platform, base_env={}).env)
    layouts = [Placement(p.world_size, p.parallel, p.rollout_gpus_per_engine) for p in profiles]
    return compare(tuple(args), env, layouts, reference, form.deviations)
