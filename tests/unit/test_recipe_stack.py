"""The pinned stack accepts every flag a recipe renders, and the render refuses one it would not.

The SGLang side is checked against the installed sglang 0.5.23 itself: tests/unit/sglang_probe.py
imports the real `sglang.srt.server_args.ServerArgs` in a process of its own, giving sglang an
import-only stand-in for triton where triton is absent (the cpu lane does not install it;
sglang.srt.utils imports it at module load, nothing here runs a kernel). The probe builds the
engine's keyword arguments from each rendered trainer command with miles' own
`server_kwargs` and constructs a real ServerArgs from them, so a flag the class lacks fails
there exactly as the engine would refuse it at start.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from miles.image.pins import parse_lock
from miles.recipes import names, shared, variants
from miles.recipes.launch import build_plan
from miles.recipes.recipe import RecipeError
from miles.recipes.snapshot import FIXED
from miles.recipes.stack import fields_file, lane_sglang, sglang_fields

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("sglang_probe.py")
GPU_PLANS = [
    (form, profile)
    for name in names()
    for form in variants(name)
    for profile in form.profiles
    if profile.platform in ("cuda", "rocm")
]


def _probe(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _plan(form, profile):
    options = replace(FIXED, model=profile.model, nodes=profile.nodes, gpus_per_node=profile.gpus_per_node)
    return build_plan(form, options, profile.platform, base_env={})


def test_both_gpu_lanes_pin_the_sglang_whose_field_list_is_kept():
    pins = {platform: lane_sglang(platform) for platform in ("cuda", "rocm")}
    assert pins == {
        "cuda": ("0.5.23", "requirements/cuda-h200.txt"),
        "rocm": ("0.5.23", "requirements/rocm-mi350.txt"),
    }
    assert (
        parse_lock(ROOT / "requirements/cpu-sglang.txt").pins["sglang"].version == "0.5.23"
    )  # what is installed here


def test_the_kept_field_list_is_the_installed_sglangs_serverargs():
    """Regenerate with `python tests/unit/sglang_probe.py --fields > <file>` when the pin moves."""
    assert fields_file("0.5.23").read_text() == _probe("--fields")


def test_every_rendered_sglang_flag_builds_the_real_serverargs():
    """Every GPU profile of every recipe, shared form and platform overlays, through miles' own
    engine arguments into a real ServerArgs."""
    cases = []
    for form, profile in GPU_PLANS:
        plan = _plan(form, profile)
        argv = list(plan.train_args)
        assert any(a.startswith("--sglang-") for a in argv), (form.name, profile.describe())
        cases.append({"argv": argv, "local_world": profile.gpus_per_node})
    answers = json.loads(_probe(json.dumps(cases)).strip().splitlines()[-1])
    errors = [
        f"{form.name} [{form.variant}] {profile.describe()}: {answer['error']}"
        for (form, profile), answer in zip(GPU_PLANS, answers, strict=True)
        if "error" in answer
    ]
    assert not errors, "\n".join(errors)
    assert len(answers) == len(GPU_PLANS) == 25  # every recipe's GPU profiles, both platforms


def _with_engine_flag(name: str, flag: str, value) -> object:
    recipe = shared(name)
    args = tuple(
        (group, (*group_args, (flag, value)) if group == "rollout_engine" else group_args)
        for group, group_args in recipe.args
    )
    return replace(recipe, args=args)


def test_the_render_refuses_an_sglang_flag_the_pinned_stack_lacks():
    recipe = _with_engine_flag("glm5_2_744b_a40b", "--sglang-router-policy", "consistent_hashing")
    with pytest.raises(RecipeError) as caught:
        _plan(recipe, recipe.profiles[0])
    assert str(caught.value) == (
        "glm5_2_744b_a40b (shared form) cuda 1x4 GLM-5.2-744B-A40B-5layer: tp4·pp1·cp1·ep4·etp1+sp: "
        "--sglang-router-policy: sglang 0.5.23 (requirements/cuda-h200.txt) has no ServerArgs field "
        "'router_policy' (close: retraction_policy, hicache_write_policy). Fix the recipe in "
        "miles/recipes/library/glm5_2_744b_a40b.py"
    )


def test_the_render_refuses_a_trainer_flag_the_parser_lacks():
    recipe = shared("qwen3_4b")
    recipe = replace(
        recipe,
        args=tuple((g, (*a, ("--rollout-temprature", 1)) if g == "rollout" else a) for g, a in recipe.args),
    )
    with pytest.raises(RecipeError, match=r"--rollout-temprature: python -m miles.train has no flag --rollout-temprature "
                                          r"\(close: --rollout-temperature"):  # fmt: skip
        _plan(recipe, recipe.profile("tiny", "cpu"))


def test_the_render_refuses_a_flag_given_twice_with_different_values():
    recipe = _with_engine_flag("qwen3_4b", "--seed", 7)
    with pytest.raises(RecipeError, match=r"--seed: given 2 times with different values \(7 then 1234\)"):
        _plan(recipe, recipe.profiles[0])


def test_extra_args_are_the_callers_and_may_override():
    recipe = shared("qwen3_4b")
    options = replace(FIXED, model="tiny", extra_args=("--seed", "7"))
    plan = build_plan(recipe, options, "cpu", base_env={})
    assert plan.train_args[-2:] == ("--seed", "7")


def test_a_missing_field_list_says_how_to_write_it():
    with pytest.raises(
        ValueError, match=r"no ServerArgs field list for the pinned sglang 9.9.9 .*sglang_probe.py --fields"
    ):
        sglang_fields("9.9.9")
