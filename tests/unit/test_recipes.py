"""miles.recipes: recipes as data, platform overlays and dispatch, model specs, checkpoint plans."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.parallel import InvalidParallelism, ParallelLayout, validate
from miles.platform import PlatformMismatch
from miles.recipes import GROUPS, load, names, shared, variants
from miles.recipes.args import ArgsError, fill, merge, render
from miles.recipes.diff import recipe_diff
from miles.recipes.library.inkling import INKLING_SMALL
from miles.recipes.library.qwen3_4b import QWEN3_4B
from miles.recipes.models import UnknownModel, moe_layer_freq, resolve_model
from miles.recipes.recipe import RecipeError, gpu_profile, groups

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def _flags(recipe, platform, model=None) -> list[str]:
    profile = recipe.profile(model, platform)
    fields = {
        "hf_checkpoint": "/m/hf", "ref_load": "/m/ref", "save_dir": "/r/ckpt", "data_dir": "/d",
        "rollout_gpus_per_engine": profile.rollout_gpus_per_engine,
    }  # fmt: skip
    return list(recipe.train_args(profile, fields))


def test_the_recipes_found_in_the_library_each_declare_a_rocm_overlay():
    assert names() == (
        "deepseek_v4",
        "glm47_flash",
        "glm5_2_744b_a40b",
        "inkling",
        "mimo_7b_rl",
        "qwen2_5_0_5b",
        "qwen3_30b_a3b",
        "qwen3_4b",
        "qwen3_5_35b_a3b",
    )
    for name in names():
        assert [r.variant for r in variants(name)] == ["shared", "rocm"]


def test_every_verified_profile_passes_validate():
    for name in names():
        for recipe in variants(name):
            for p in recipe.profiles:
                verdict = validate(p.parallel, p.world_size, recipe.resolve(p.model).shape)
                assert verdict.ok, f"{name} {p.describe()}: {verdict.summary()}"


def test_an_impossible_profile_is_refused_where_the_recipe_is_defined():
    recipe = shared("qwen3_30b_a3b")
    bad = gpu_profile(
        "cuda", 1, 4, "Qwen3-30B-A3B-4layer", ParallelLayout(tp=2, pp=2, ep=4, etp=1),
        rollout_gpus_per_engine=4, suite="stage-c-4-gpu-h200",
    )  # fmt: skip
    with pytest.raises(InvalidParallelism) as err:
        replace(recipe, profiles=(bad,))
    message = str(err.value)
    assert message.startswith(
        "miles/recipes/library/qwen3_30b_a3b.py: qwen3_30b_a3b (shared) profile cuda 1x4"
    )
    assert "ep=4 → ep=2 makes etp·ep·pp = 4 divide world 4" in message


def test_a_missing_profile_lists_the_defined_ones_and_where_to_add_one():
    recipe = load("inkling", platform="rocm")
    with pytest.raises(NotImplementedError) as err:
        recipe.profile("Inkling-Small-4layer", "rocm", nodes=1, gpus_per_node=8)
    message = str(err.value)
    assert "no parallel profile for Inkling-Small-4layer on rocm with 1 node(s) x 8 GPU(s)" in message
    assert "Defined: rocm 1x4 Inkling-Small-4layer: tp4·pp1·cp1·ep4·etp1+sp" in message
    assert "the ROCM overlay.profiles in miles/recipes/library/inkling.py" in message


def test_load_dispatches_on_this_machine_platform():
    assert load("inkling", env={}).variant == "shared"
    assert load("inkling", platform="rocm").variant == "rocm"


def test_load_refuses_rocm_on_a_cpu_torch_naming_both_facts():
    with pytest.raises(PlatformMismatch, match=r"MILES_HARDWARE_PLATFORM=rocm but .*torch build cpu"):
        load("inkling", env={"MILES_HARDWARE_PLATFORM": "rocm"})


def test_unknown_recipe_lists_the_known_ones():
    with pytest.raises(
        RecipeError,
        match="unknown recipe 'inkling2'; known: deepseek_v4, glm47_flash, glm5_2_744b_a40b, inkling, mimo_7b_rl, qwen2_5_0_5b",
    ):
        shared("inkling2")


def test_rocm_overlay_replaces_deepep_with_mori_and_keeps_everything_else():
    cuda = _flags(shared("glm5_2_744b_a40b"), "cuda")
    rocm = _flags(load("glm5_2_744b_a40b", platform="rocm"), "rocm")
    assert cuda[cuda.index("--sglang-moe-a2a-backend") + 1] == "deepep"
    assert rocm[rocm.index("--sglang-moe-a2a-backend") + 1] == "mori"
    assert [f for f in cuda if f.startswith("--")] == [f for f in rocm if f.startswith("--")]


def test_four_gpu_rocm_moe_layout_uses_ep_2_under_pp_2():
    flags = _flags(load("qwen3_30b_a3b", platform="rocm"), "rocm")
    layout = {
        f: flags[flags.index(f) + 1]
        for f in ("--pipeline-model-parallel-size", "--expert-model-parallel-size")
    }
    assert layout == {"--pipeline-model-parallel-size": "2", "--expert-model-parallel-size": "2"}


def test_diff_lists_every_rocm_delta_of_inkling():
    base = shared("inkling")
    lines = recipe_diff(base, base.for_platform("rocm"))
    assert "  + --sglang-attention-backend triton" in lines
    assert "  + numba==0.65.1" in lines
    assert any(
        line.startswith("  + rocm 1x4 Inkling-Small-4layer: tp4·pp1·cp1·ep4·etp1+sp") for line in lines
    )
    assert any(line.startswith("  - cuda 1x4 Inkling-Small-4layer") for line in lines)


def test_diff_shows_a_changed_flag_with_both_values():
    base = shared("glm5_2_744b_a40b")
    lines = recipe_diff(base, base.for_platform("rocm"))
    assert "  ~ --sglang-moe-a2a-backend deepep -> --sglang-moe-a2a-backend mori" in lines


def test_a_recipe_does_not_differ_from_itself():
    assert recipe_diff(shared("qwen3_4b"), shared("qwen3_4b")) == []


def test_diff_command_prints_the_amd_deltas():
    proc = subprocess.run(
        [sys.executable, "-m", "miles.recipes", "diff", "inkling"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "inkling: shared -> rocm" in proc.stdout and "+ numba==0.65.1" in proc.stdout


def test_diff_of_a_platform_without_an_overlay_names_the_recipe_file(capsys):
    from miles.recipes.__main__ import main

    assert main(["diff", "inkling", "--platform", "mi300x"]) == 2
    err = capsys.readouterr().err
    assert "inkling declares no mi300x overlay; add one in miles/recipes/library/inkling.py" in err


def test_overlay_removes_a_flag_given_none():
    assert merge((("--a", 1), ("--b", True)), (("--b", None), ("--c", "x"))) == (("--a", 1), ("--c", "x"))


def test_merge_keeps_the_flag_position_and_takes_the_new_value():
    assert merge((("--a", 1), ("--b", 2)), (("--a", 3),)) == (("--a", 3), ("--b", 2))


def test_render_spells_switches_lists_and_numbers():
    assert render((("--x", True), ("--y", ("a", "b")), ("--lr", 1e-6), ("--t", 1.0), ("--off", None))) == [
        "--x", "--y", "a", "b", "--lr", "1e-06", "--t", "1",
    ]  # fmt: skip


def test_unknown_template_field_names_the_flag_and_the_known_fields():
    with pytest.raises(ArgsError, match=r"recipe.py: --save: unknown field \{save_path\}.*known: run_dir"):
        fill((("--save", "{save_path}"),), {"run_dir": "/r"}, "recipe.py")


def test_recipe_args_are_the_defaults_with_the_recipes_own_flags_merged_in():
    from miles.recipes import defaults as d

    args = dict(d.args_with(rollout=(("--num-rollout", 5), ("--balance-data", None), ("--new", 1))))
    assert [g for g in args] == list(GROUPS)
    flags = [flag for flag, _ in args["rollout"]]
    assert flags.index("--num-rollout") == [flag for flag, _ in d.ROLLOUT].index("--num-rollout")
    assert dict(args["rollout"])["--num-rollout"] == 5 and args["rollout"][-1] == ("--new", 1)
    assert "--balance-data" not in dict(args["rollout"])
    assert args["grpo"] == d.GRPO and args["perf"] == d.PERF
    with pytest.raises(RecipeError, match="unknown argument group"):
        d.args_with(sglang=(("--x", 1),))


def test_unknown_argument_group_is_refused():
    with pytest.raises(RecipeError, match="unknown argument group"):
        groups(sglang=(("--x", 1),))


def test_slice_chosen_by_keyword():
    model = resolve_model("Inkling-Small-4layer", INKLING_SMALL, env={})
    assert (model.num_layers, model.is_slice, model.how) == (4, True, "keyword")


def test_slice_chosen_by_model_args_num_layers():
    model = resolve_model("Qwen3-4B", QWEN3_4B, env={"MODEL_ARGS_NUM_LAYERS": "6"})
    assert (model.name, model.num_layers) == ("Qwen3-4B-6layer", 6)


def test_keyword_wins_over_model_args_num_layers():
    model = resolve_model("Inkling-Small-4layer", INKLING_SMALL, env={"MODEL_ARGS_NUM_LAYERS": "8"})
    assert model.num_layers == 4


def test_full_depth_without_keyword_or_variable():
    assert resolve_model("Qwen3-4B", QWEN3_4B, env={}).num_layers == 36


def test_slice_deeper_than_the_model_is_refused():
    with pytest.raises(UnknownModel, match="Qwen3-4B has 36 layers"):
        resolve_model("Qwen3-4B-40layer", QWEN3_4B, env={})


def test_unknown_model_name_says_what_is_accepted():
    with pytest.raises(UnknownModel, match="is not Qwen3-4B, Qwen3-4B-<N>layer or tiny"):
        resolve_model("Qwen3-8B", QWEN3_4B, env={})


def test_moe_layer_frequency_is_regenerated_for_the_slice():
    flags = dict(resolve_model("Inkling-Small-4layer", INKLING_SMALL, env={}).model_args())
    assert flags["--moe-layer-freq"] == "[0]*2+[1]*2"
    assert dict(INKLING_SMALL.model_args())["--moe-layer-freq"] == "[0]*2+[1]*40"
    assert moe_layer_freq(3, 2) == "[0]*2"  # a slice shallower than the dense prefix stays dense


def test_tiny_plan_builds_the_family_locally_and_skips_conversions():
    plan = shared("glm5_2_744b_a40b").checkpoint_plan("tiny", model_dir="/models")
    assert (plan.source, plan.model_name, plan.num_layers) == (
        "tiny:glm_moe_dsa",
        "GLM-5.2-744B-A40B-tiny",
        4,  # the family's tiny depth: layers 0-2 run the DSA indexer, layer 3 reuses its top-k
    )
    assert plan.steps == ("fetch", "validate")
    assert shared("qwen3_4b").checkpoint_plan("tiny").num_layers == 2


def test_fp8_recipe_slice_plan_trims_converts_and_builds_torch_dist():
    plan = shared("qwen3_30b_a3b").checkpoint_plan("Qwen3-30B-A3B-4layer", model_dir="/models")
    assert plan.steps == ("fetch", "validate", "trim", "fp8", "torch_dist")
    assert (plan.source, plan.num_layers, plan.hf_dir) == (
        "Qwen/Qwen3-30B-A3B",
        4,
        "/models/Qwen3-30B-A3B-4layer",
    )


def test_bf16_recipe_at_full_depth_has_no_trim_and_no_fp8():
    plan = shared("qwen3_4b").checkpoint_plan("Qwen3-4B", env={})
    assert plan.steps == ("fetch", "validate", "torch_dist") and plan.num_layers is None


def test_stage_dir_adds_the_stage_step_and_source_overrides_the_repo():
    plan = shared("inkling").checkpoint_plan(stage_dir="/local/ssd", source="/mirror/Inkling-Small-4layer")
    assert plan.steps[-1] == "stage" and plan.source == "/mirror/Inkling-Small-4layer"


def test_fp8_recipe_rolls_out_from_the_fp8_checkpoint_and_references_torch_dist():
    from miles.recipes.launch import RunOptions, build_plan

    plan = build_plan(
        shared("qwen3_30b_a3b"), RunOptions(model="Qwen3-30B-A3B-4layer", model_dir="/m"), base_env={}
    )
    args = plan.train_args
    assert args[args.index("--hf-checkpoint") + 1] == "/m/Qwen3-30B-A3B-4layer_fp8"
    assert args[args.index("--ref-load") + 1] == "/m/Qwen3-30B-A3B-4layer_torch_dist"


def test_a_recipe_whose_family_megatron_cannot_build_trains_its_declared_fallback(inkling_unbuilt):
    # Inkling's torch_dist would hold HF names, which no Megatron job loads: FSDP reads the HF dir
    from miles.recipes.launch import RunOptions, build_plan

    recipe = shared("inkling")
    plan = build_plan(recipe, RunOptions(model="Inkling-Small-4layer", model_dir="/m"), base_env={})
    args = plan.train_args
    assert recipe.fallback is not None and "torch_dist" not in plan.checkpoint.steps
    assert args[args.index("--train-backend") + 1] == "fsdp"
    assert args[args.index("--hf-checkpoint") + 1] == "/m/Inkling-Small-4layer"
    assert args[args.index("--ref-load") + 1] == "/m/Inkling-Small-4layer"
    assert not [
        a for a in args if a.startswith(("--megatron-to-hf-mode", "--tensor-model-parallel", "--num-layers"))
    ]


def test_deepseek_v4_trains_with_megatron_from_its_torch_dist():
    # miles' Megatron backend builds DeepSeek-V4 (its own model): the recipe has no fallback left
    from miles.recipes.launch import RunOptions, build_plan

    recipe = shared("deepseek_v4")
    plan = build_plan(recipe, RunOptions(model="DeepSeek-V4-Flash-4layer", model_dir="/m"), base_env={})
    args = plan.train_args
    assert recipe.fallback is None and plan.checkpoint.steps[-1] == "torch_dist"
    assert args[args.index("--train-backend") + 1] == "megatron"
    assert args[args.index("--hf-checkpoint") + 1] == "/m/DeepSeek-V4-Flash-4layer_fp8"
    assert args[args.index("--ref-load") + 1] == "/m/DeepSeek-V4-Flash-4layer_torch_dist"
    assert args[args.index("--tensor-model-parallel-size") + 1] == "4" and "--sequence-parallel" in args


def test_list_and_show_say_a_fallback_profile_trains_data_parallel_not_at_its_megatron_layout(
    capsys, inkling_unbuilt
):
    from miles.recipes.__main__ import main

    assert main(["list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    for name, gpus in (("Inkling-Small-4layer", 4),):
        line = next(ln for ln in listed if f"cuda 1x{gpus} {name}:" in ln)
        assert (
            f": fsdp data-parallel over {gpus} GPUs (the fallback; its Megatron layout tp{gpus}·" in line
        ), line
        assert line.endswith("(FSDP fallback, untested on GPU)"), line
    glm = next(
        ln for ln in listed if "cuda 1x4 GLM-5.2-744B-A40B-5layer:" in ln
    )  # built: its layout, no fallback
    assert glm.endswith(": tp4·pp1·cp1·ep4·etp1+sp  (untested on GPU)"), glm
    dsv4 = next(ln for ln in listed if "cuda 1x8 DeepSeek-V4-Flash-4layer:" in ln)  # built since
    assert dsv4.endswith(": tp8·pp1·cp1·ep8·etp1+sp  (untested on GPU)"), dsv4
    assert main(["show", "inkling", "--platform", "rocm"]) == 0
    shown = capsys.readouterr().out
    assert "train backend: fsdp (fallback from megatron: miles' Megatron backend does not build" in shown
    assert "rocm 1x4 Inkling-Small-4layer: fsdp data-parallel over 4 GPUs" in shown


def test_a_megatron_recipe_of_an_unbuilt_family_must_declare_its_fallback(inkling_unbuilt):
    with pytest.raises(RecipeError, match="declare the recipe's Fallback"):
        replace(inkling_unbuilt, fallback=None)
    for built, family in (("glm5_2_744b_a40b", "glm_moe_dsa"), ("deepseek_v4", "deepseek_v4")):
        with pytest.raises(RecipeError, match=f"builds {family} now; remove the fallback"):
            replace(shared(built), fallback=inkling_unbuilt.fallback)


def test_tiny_profile_of_a_family_megatron_cannot_build_is_data_parallel_fsdp(inkling_unbuilt):
    flags = _flags(inkling_unbuilt, "cpu")
    assert flags[flags.index("--train-backend") + 1] == "fsdp"
    assert flags[flags.index("--rollout-engine") + 1] == "torch"
    assert not [f for f in flags if f.startswith("--sglang-") or f.startswith("--tensor-model-parallel")]
    assert "--num-layers" not in flags  # fsdp reads the architecture from the HF config


@pytest.mark.parametrize(
    ("recipe", "layout"),
    [
        ("qwen3_4b", ("--tensor-model-parallel-size", "2")),
        ("qwen3_30b_a3b", ("--expert-model-parallel-size", "2")),
        ("inkling", ("--expert-model-parallel-size", "2")),
    ],
)
def test_tiny_profile_of_a_gpt_family_trains_with_megatron_at_a_layout_of_its_own(recipe, layout):
    flags = _flags(shared(recipe), "cpu")
    assert flags[flags.index("--train-backend") + 1] == "megatron"
    assert flags[flags.index(layout[0]) + 1] == layout[1]
    assert flags[flags.index("--rollout-engine") + 1] == "torch"
    # the tiny checkpoint's shape is its config.json: the full model's widths are not emitted
    assert "--num-layers" not in flags and "--hidden-size" not in flags
    plan = shared(recipe).checkpoint_plan("tiny", train_backend="megatron")
    assert "torch_dist" in plan.steps  # what --ref-load names


def test_every_generated_command_parses_with_the_trainer():
    from miles.train.args import parse_args

    for name in names():
        for recipe in variants(name):
            for p in recipe.profiles:
                parsed = parse_args(_flags(recipe, p.platform, p.model))
                assert parsed.train_backend == recipe.backend_of(p)


def test_importing_recipes_imports_no_torch():
    code = "import sys, miles.recipes.script; sys.exit('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ}, check=False).returncode
        == 0
    )


def test_a_usage_error_of_the_recipes_command_is_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "miles.recipes", "facts", "--bogus"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "python -m miles.recipes: error: unrecognized arguments: --bogus (--help lists the commands and flags)"
    ]
