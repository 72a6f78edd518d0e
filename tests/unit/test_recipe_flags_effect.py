"""No recipe flag is accepted and ignored: the render refuses what the run would not act on.

Each profile's rendered trainer command is parsed by the trainer's own parser and checked
against what its backend and engine declare they consume (miles.train.consumption), as
`python -m miles.train` checks it at start: every flag of every shipped profile acts.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from miles.ci.register import register_cpu_ci
from miles.recipes import names, shared, variants
from miles.recipes.launch import build_plan
from miles.recipes.recipe import RecipeError
from miles.recipes.snapshot import FIXED
from miles.train import consumption
from miles.train.args import parse_config

register_cpu_ci(est_time=3, suite="stage-a-cpu")

PLANS = [(form, profile) for name in names() for form in variants(name) for profile in form.profiles]


def _plan(form, profile):
    options = replace(FIXED, model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node)
    return build_plan(form, options, profile.platform, base_env={})


def _with_flag(name: str, group: str, flag: str, value):
    recipe = shared(name)
    args = tuple((g, (*a, (flag, value)) if g == group else a) for g, a in recipe.args)
    return replace(recipe, args=args)


def test_every_flag_of_every_shipped_profile_acts():
    unused = {}
    for form, profile in PLANS:
        config = parse_config(list(_plan(form, profile).train_args))
        without = consumption.flags_without_effect(config, profile.rollout_engine)
        if without:
            unused[f"{form.name} ({form.variant}) {profile.describe()}"] = without
    assert not unused


def test_the_render_refuses_colocate_on_the_cpu_lane_in_one_line():
    recipe = _with_flag("qwen3_4b", "perf", "--colocate", True)
    with pytest.raises(RecipeError) as caught:
        _plan(recipe, recipe.profile("tiny", "cpu"))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("qwen3_4b (shared form) cpu 1x2 tiny")
    assert (
        "on the cpu lane: --colocate (the built-in engine samples inside the trainer's processes" in message
    )
    assert (
        "no effect on --train-backend megatron with the torch rollout engine, so refused; drop them"
        in message
    )
    assert message.endswith("Fix the recipe in miles/recipes/library/qwen3_4b.py")


def test_the_render_refuses_a_megatron_option_on_an_fsdp_profile(inkling_unbuilt):
    recipe = _with_flag("inkling", "perf", "--sequence-parallel", True)  # its tiny profile trains with FSDP
    cpu = next(p for p in recipe.profiles if p.platform == "cpu")
    with pytest.raises(RecipeError, match=r"--sequence-parallel \(read by --train-backend megatron\): no effect on "
                                          r"--train-backend fsdp with the torch rollout engine"):  # fmt: skip
        _plan(recipe, cpu)


def test_the_trainer_refuses_a_flag_without_effect_at_start_in_one_line(tmp_path):
    """The command a user runs; it stops before any model or data loads (the checkpoint need not exist)."""
    done = subprocess.run(
        [sys.executable, "-m", "miles.train", "--hf-checkpoint", str(tmp_path / "absent"), "--offload-rollout"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert "--offload-rollout (the built-in engine samples inside the trainer's processes" in lines[0]
    assert "no effect on --train-backend fsdp with the torch rollout engine, so refused" in lines[0]


def test_a_recipe_rendered_for_fsdp_leaves_out_its_megatron_options():
    """What the GPU recipe tests run for the families Megatron cannot build: the script's
    --train-backend fsdp renders the recipe for FSDP, and the trainer would accept every flag."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, str(root / "scripts/run_inkling.py"), "train", "--platform", "cuda",
         "--train-backend", "fsdp", "--dry-run", "--json"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    argv = json.loads(done.stdout)["command"]
    argv = argv[argv.index("miles.train") + 1 :]
    config = parse_config(argv)
    assert config.job.train_backend == "fsdp"
    assert consumption.refusal(config, "sglang") is None
    assert "--sequence-parallel" not in argv and "--attention-dropout" not in argv
    assert "--sglang-mem-fraction-static" in argv  # the engine's own options stay


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(RecipeError, match=r"qwen3_4b: no train backend 'fdsp'; known: fsdp, ddp, megatron"):
        shared("qwen3_4b").on_backend("fdsp")
