"""Every recipe beside its reference recipe (radixark/miles), and the model beside its config.json.

The recipes are held to two tables: `python -m miles.recipes diff` (each form against the
reference script's flags, environment and layouts, every difference with a reason) and
`python -m miles.recipes facts` (each published config.json value against the Megatron flag
that carries it).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from miles.parallel import ParallelLayout
from miles.recipes import names, shared, variants
from miles.recipes.diff import reference_comparison
from miles.recipes.facts import rows
from miles.recipes.fidelity import Deviation, Placement, Reference, compare, flags
from miles.recipes.recipe import gpu_profile
from miles.recipes.specs import GLM5_2_744B_A40B, QWEN3_30B_A3B

ROOT = Path(__file__).resolve().parents[2]
FORMS = [
    (name, form.variant, "cuda" if form.variant == "shared" else form.variant)
    for name in names()
    for form in variants(name)
]


@pytest.mark.parametrize(("name", "variant", "platform"), FORMS)
def test_every_difference_from_the_reference_has_a_reason(name, variant, platform):
    form = shared(name).for_platform(platform)
    comparison = reference_comparison(form, platform)
    assert comparison is not None, f"{name} has no {platform} reference"
    assert not comparison.unexplained, "\n".join(line.render() for line in comparison.unexplained)
    assert comparison.agree > 30


@pytest.mark.parametrize("name", names())
def test_every_published_config_value_is_carried_or_named_as_a_gap(name):
    bad = [r for r in rows(shared(name).model) if r.bad]
    assert not bad, "\n".join(
        f"{r.key}: {r.flag} {r.expected} vs recipe {r.recipe} ({r.status})" for r in bad
    )


def test_a_flag_that_disagrees_with_config_json_fails_the_table():
    drifted = replace(
        QWEN3_30B_A3B,
        arch_args=tuple((f, 10000000 if f == "--rotary-base" else v) for f, v in QWEN3_30B_A3B.arch_args),
    )
    (row,) = [r for r in rows(drifted) if r.key == "rope_theta"]
    assert (row.status, row.expected, row.recipe) == ("DIFFERS", "1000000", "10000000")


def test_a_deliberate_training_choice_shows_its_reason_instead_of_a_difference():
    (row,) = [r for r in rows(QWEN3_30B_A3B) if r.key == "router_aux_loss_coef"]
    assert (row.status, row.expected, row.recipe) == ("choice", "0.001", "0")
    assert "no load-balancing loss" in row.note and not row.bad


def test_a_config_value_no_rule_or_gap_covers_is_unmapped():
    published = replace(QWEN3_30B_A3B.published, values=(*QWEN3_30B_A3B.published.values, ("qk_clip", 100)))
    (row,) = [r for r in rows(replace(QWEN3_30B_A3B, published=published)) if r.key == "qk_clip"]
    assert row.status == "UNMAPPED" and row.bad


def test_every_gap_names_published_keys_and_every_key_a_source():
    for name in names():
        spec = shared(name).model
        published = dict(spec.published.values)
        for gap in spec.gaps:
            assert set(gap.keys) <= set(published), (name, gap.feature)
        assert {key for key, _ in spec.choices} <= set(published), name
        assert all(spec.published.source_of(key) for key in published)


def test_the_recipes_carry_the_models_published_shapes():
    inkling = dict(shared("inkling").model.model_args())
    assert (inkling["--num-experts"], inkling["--moe-router-topk"], inkling["--moe-ffn-hidden-size"]) == (
        256,
        6,
        2048,
    )
    assert inkling["--moe-router-score-function"] == "sigmoid" and inkling["--qk-layernorm"]
    assert inkling["--position-embedding-type"] == "none"
    glm = dict(GLM5_2_744B_A40B.model_args())
    assert glm["--rotary-base"] == 8000000 and glm["--make-vocab-size-divisible-by"] == 16
    assert glm["--moe-router-bias-update-rate"] == 0 and glm["--qk-layernorm"]
    qwen = dict(QWEN3_30B_A3B.model_args())
    assert qwen["--moe-router-dtype"] == "fp32" and qwen["--moe-permute-fusion"]


def test_no_recipe_passes_a_flag_no_megatron_parses():
    for name in names():
        for form in variants(name):
            for p in form.profiles:
                flags_ = {flag for _, args in form.arg_groups(p, _FIELDS, env={}) for flag, _ in args}
                assert "--use-dsa" not in flags_, (name, p.describe())


def test_window_sizes_are_written_as_megatrons_left_right_pair():
    assert dict(shared("inkling").model.model_args())["--window-size"] == "512,0"
    assert "--window-size" not in dict(shared("deepseek_v4").model.model_args())


def test_what_megatron_core_lacks_is_said_in_the_recipe():
    gaps = {gap.feature for gap in shared("deepseek_v4").model.gaps}
    assert {"hybrid compressed sparse attention", "sqrt-softplus routing with expert bias"} <= gaps
    assert shared("glm5_2_744b_a40b").model.gaps[0].keys == ("index_topk_freq",)


def test_a_layout_that_differs_from_the_reference_without_a_reason_is_unexplained():
    recipe = shared("qwen3_30b_a3b")
    other = gpu_profile(
        "cuda", 1, 8, "Qwen3-30B-A3B", ParallelLayout(tp=2, sp=True, ep=8, etp=1), rollout_gpus_per_engine=2,
        suite="stage-c-8-gpu-h200",
    )  # fmt: skip
    drifted = replace(recipe, profiles=(recipe.profiles[0], other, recipe.profiles[2]))
    (line,) = reference_comparison(drifted, "cuda").unexplained
    assert line.key == "layout:8" and line.reason is None
    assert line.render().startswith("~ layout:8: ours tp2·pp1·cp1·ep8·etp1+sp, 2 GPU(s) per rollout engine")


def test_a_deviation_explains_only_its_platforms():
    reference = Reference("rocm", "s", "m", "x", flags("--lr 1e-6"), (), (Placement(4, ParallelLayout(), 1),))
    reasons = (Deviation(("--lr",), "because", ("cuda",)),)
    result = compare(flags("--lr 2e-6"), {}, [Placement(4, ParallelLayout(), 1)], reference, reasons)
    assert result.unexplained[0].render() == "~ --lr: ours 2e-06, reference 1e-06  UNEXPLAINED"


def test_numbers_compare_by_value_and_patterns_match_families():
    reference = Reference("cuda", "s", "m", "x", flags("--kl-loss-coef 0.00 --eval-interval 20"), (), ())
    result = compare(flags("--kl-loss-coef 0"), {}, [], reference, (Deviation(("--eval-*",), "no eval"),))
    assert result.agree == 1 and [line.reason for line in result.lines] == ["no eval"]


def test_flags_reads_switches_values_and_lists():
    assert flags("--a --b 1 --spec m f --c 'x y'") == (
        ("--a", True),
        ("--b", "1"),
        ("--spec", ("m", "f")),
        ("--c", "x y"),
    )


def test_diff_and_facts_commands_find_nothing_unexplained():
    for command in ("diff", "facts"):
        proc = subprocess.run(
            [sys.executable, "-m", "miles.recipes", command],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    assert "UNEXPLAINED" not in proc.stdout


_FIELDS = {
    name: f"{{{name}}}"
    for name in (
        "hf_checkpoint",
        "ref_load",
        "save_dir",
        "run_dir",
        "data_dir",
        "model_dir",
        "hf_dir",
        "run_id",
    )
} | {"rollout_gpus_per_engine": 4}
