"""Every recipe x platform x profile's generated trainer command parses with miles.train's
flag parser: the recipes and the trainer agree on every flag name, type and rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from miles.ci.register import register_cpu_ci
from miles.recipes import names, variants
from miles.recipes.launch import TRAINER_MODULE, build_plan
from miles.recipes.snapshot import FIXED
from miles.train.args import parse_args

register_cpu_ci(est_time=2, suite="stage-a-cpu")

PLANS = [(recipe, profile) for name in names() for recipe in variants(name) for profile in recipe.profiles]


@pytest.mark.parametrize(
    ("recipe", "profile"),
    PLANS,
    ids=[f"{r.name}-{p.platform}-{p.nodes}x{p.gpus_per_node}-{p.model}" for r, p in PLANS],
)
def test_recipe_command_parses_with_the_trainer_flags(recipe, profile):
    options = replace(FIXED, model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node)
    plan = build_plan(recipe, options, profile.platform, base_env={})
    assert TRAINER_MODULE in plan.command
    args = parse_args(list(plan.train_args))
    world = profile.nodes * profile.gpus_per_node
    assert args.actor_num_nodes * args.actor_num_gpus_per_node == world
    assert args.train_backend == recipe.backend_of(profile)
    if profile.platform == "cpu":
        # The CPU profile must be something the CPU trainer runs: the trainer's own sampler.
        assert args.rollout_engine in ("torch", "auto")
    if args.train_backend == "megatron":
        assert args.tensor_model_parallel_size == profile.parallel.tp
        assert args.expert_model_parallel_size == profile.parallel.ep


def test_every_recipe_has_a_cpu_tiny_profile():
    cpu = {r.name for r, p in PLANS if p.platform == "cpu"}
    assert cpu == set(names())
