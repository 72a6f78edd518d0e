"""Every recipe's rendered command beside its reference command (radixark/miles), and the model beside its config.json.

The recipes are held to two tables: `python -m miles.recipes diff` (each profile's command, as
the launcher renders it, against the reference launcher's quoted command, environment and
layout, every difference with a reason) and `python -m miles.recipes facts` (each published
config.json value against the Megatron flag that carries it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.parallel import ParallelLayout
from miles.recipes import load, names, shared, variants
from miles.recipes.diff import reference_comparisons, rendered
from miles.recipes.facts import rows
from miles.recipes.fidelity import Deviation, Placement, Reference, compare, deviation, flags, renamed, shown
from miles.recipes.library.glm5_2_744b_a40b import GLM5_2_744B_A40B
from miles.recipes.library.qwen3_30b_a3b import QWEN3_30B_A3B
from miles.recipes.recipe import gpu_profile
from miles.recipes.upstream import Upstream

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
FORMS = [
    (name, form.variant, "cuda" if form.variant == "shared" else form.variant)
    for name in names()
    for form in variants(name)
]
SOURCE = Upstream("scripts/run_x.py", "0" * 40, "execute", (), "a test machine", nvlink=False)


def _reference(argv: str, platform: str = "cuda", env=()) -> Reference:
    return Reference(platform, "X", SOURCE, tuple(argv.split()), tuple(env))


@pytest.mark.parametrize(("name", "variant", "platform"), FORMS)
def test_every_difference_from_the_reference_has_a_reason(name, variant, platform):
    form = shared(name).for_platform(platform)
    compared = reference_comparisons(form, platform)
    assert len(compared) == len([p for p in form.profiles if p.platform == platform]), (
        "a profile has no reference"
    )
    for item in compared:
        assert not item.unexplained, "\n".join(line.render() for line in item.unexplained)
        assert item.comparison.agree > 30


def test_every_deviation_explains_a_difference():
    """A reason that explains nothing any more (upstream changed, the recipe was fixed) is removed:
    each one explains a line of some form's comparison (the shared ones, of some recipe's)."""
    explained, offered = set(), {}
    for name in names():
        for form in variants(name):
            platform = "cuda" if form.variant == "shared" else form.variant
            explained |= {
                line.reason
                for item in reference_comparisons(form, platform)
                for line in item.comparison.lines
            }
            offered |= {d.reason: d for d in form.deviations if platform in d.platforms}
    stale = [d for reason, d in offered.items() if reason not in explained]
    assert not stale, "\n".join(f"{getattr(d, 'keys', None) or d.theirs}: {d.reason}" for d in stale)


def test_a_flag_given_twice_with_different_values_is_an_error_no_reason_explains():
    inkling = shared("inkling")
    doubled = replace(
        inkling,
        args=tuple(
            (group, (*args, ("--micro-batch-size", 4)) if group == "checkpoint" else args)
            for group, args in inkling.args
        ),
        deviations=(*inkling.deviations, deviation("--micro-batch-size", reason="any")),
    )
    (item,) = reference_comparisons(doubled, "cuda")
    (line,) = [line for line in item.unexplained if line.key == "--micro-batch-size"]
    assert line.render() == (
        "! --micro-batch-size: given 2 times with different values (4 then 1); the trainer keeps the last  UNEXPLAINED"
    )


def test_a_fallback_is_rendered_and_explains_each_difference_it_makes(inkling_unbuilt):
    """Inkling's recipe as it declared its FSDP fallback: the GPU command trains data-parallel
    without Megatron's model flags, and diff explains each difference by the fallback's reason;
    without that reason they are unexplained."""
    inkling = inkling_unbuilt
    (item,) = reference_comparisons(inkling, "cuda")
    assert item.unexplained == ()
    lines = {line.key: line for line in item.comparison.lines}
    for key in ("layout:4", "--num-layers", "--megatron-to-hf-mode", "env:CUDA_DEVICE_MAX_CONNECTIONS"):
        assert lines[key].reason.startswith("fallback to --train-backend fsdp: miles' Megatron backend"), key
    argv, env = rendered(inkling, inkling.profiles[0])
    assert argv[argv.index("--train-backend") + 1] == "fsdp" and "--num-layers" not in argv
    bare = compare(
        argv, env, Placement(4, ParallelLayout(), 4), item.comparison.reference, inkling.deviations
    )
    assert {"layout:4", "--num-layers", "env:CUDA_DEVICE_MAX_CONNECTIONS"} <= {
        ln.key for ln in bare.unexplained
    }


def test_diff_command_exits_1_on_an_unexplained_difference(tmp_path):
    """The user's command, on a copy of the tree whose qwen3_4b recipe rolls out at 0.8 again."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "miles", tree / "miles", ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "requirements").symlink_to(ROOT / "requirements")
    recipe = tree / "miles/recipes/library/qwen3_4b.py"
    text = recipe.read_text()
    assert 'rollout=(("--rm-type", "math"),)' in text
    recipe.write_text(
        text.replace(
            'rollout=(("--rm-type", "math"),)',
            'rollout=(("--rm-type", "math"), ("--rollout-temperature", 0.8))',
        )
    )
    proc = subprocess.run(
        [sys.executable, "-m", "miles.recipes", "diff", "qwen3_4b", "--platform", "cuda"],
        cwd=tree, capture_output=True, text=True, check=False, env={**os.environ, "PYTHONPATH": str(tree)},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr
    assert "~ --rollout-temperature: ours 0.8, reference 1  UNEXPLAINED" in proc.stdout
    assert "difference(s) from the reference are UNEXPLAINED" in proc.stderr


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


def test_window_sizes_are_written_as_megatrons_left_right_pair():
    # Inkling-Small's 512-key window: megatron-core's (511, 0) admits the query and 511 keys before it
    assert dict(shared("inkling").model.model_args())["--window-size"] == "511,0"
    assert "--window-size" not in dict(shared("deepseek_v4").model.model_args())


@pytest.mark.parametrize("window", [1, 3, 32, 512])
def test_a_window_flag_admits_the_keys_transformers_admits(window):
    """The --window-size the facts table derives from a sliding window admits, under megatron-core's
    rule, exactly the keys transformers' sliding-window mask admits. megatron-core 0.16.1's rule
    (transformer/utils.py, get_sliding_window_causal_mask, which allocates on CUDA and so is
    restated here): masked unless triu(diagonal=skv - sq - LEFT) and tril(diagonal=skv - sq + RIGHT)."""
    import torch
    from transformers.masking_utils import sliding_window_causal_mask_function

    from miles.families.facts import window as window_flag
    from miles.train.config import _window

    left, right = _window(window_flag(window, {}))
    n = window + 20
    ones = torch.ones(n, n, dtype=torch.bool)
    megatron = torch.tril(torch.triu(ones, diagonal=-left), diagonal=right)  # True: attended
    admits = sliding_window_causal_mask_function(window)
    zero, rows = torch.tensor(0), torch.arange(n)
    hf = admits(zero, zero, rows[:, None], rows[None, :]).expand(n, n)
    assert torch.equal(megatron, hf)
    assert int(hf[n - 1].sum()) == window


def test_what_megatron_core_lacks_is_said_in_the_recipe():
    gaps = {gap.feature for gap in shared("deepseek_v4").model.gaps}
    assert {"hybrid compressed sparse attention", "sqrt-softplus routing with expert bias"} <= gaps
    # GLM-5.2's cross-layer top-k sharing is miles' own (miles.families.glm_moe_dsa.dsa): no gap, read from config.json
    glm = shared("glm5_2_744b_a40b").model
    assert glm.gaps == ()
    table = {r.key: r for r in rows(glm)}
    assert table["index_topk_freq"].status == table["index_skip_topk_offset"].status == "model"


def test_a_layout_that_differs_from_the_reference_without_a_reason_is_unexplained():
    recipe = shared("qwen3_30b_a3b")
    other = gpu_profile(
        "cuda", 1, 8, "Qwen3-30B-A3B", ParallelLayout(tp=2, sp=True, ep=8, etp=1), rollout_gpus_per_engine=2,
        suite="stage-c-8-gpu-h200",
    )  # fmt: skip
    drifted = replace(recipe, profiles=(recipe.profiles[0], other, recipe.profiles[2]))
    (line,) = [line for item in reference_comparisons(drifted, "cuda") for line in item.unexplained]
    assert line.key == "layout:8" and line.reason is None
    assert line.render().startswith(
        "~ layout:8: ours 8 GPU(s) tp2·pp1·cp1·ep8·etp1+sp, 2 GPU(s) per rollout engine"
    )


def test_a_deviation_explains_only_its_platforms():
    reference = _reference("--lr 1e-6", platform="rocm")
    reasons = (Deviation(("--lr",), "because", ("cuda",)),)
    result = compare(["--lr", "2e-6"], {}, reference.layout, reference, reasons)
    assert result.unexplained[0].render() == "~ --lr: ours 2e-06, reference 1e-06  UNEXPLAINED"


def test_numbers_compare_by_value_and_patterns_match_families():
    reference = _reference("--kl-loss-coef 0.00 --eval-interval 20")
    result = compare(
        ["--kl-loss-coef", "0"], {}, reference.layout, reference, (Deviation(("--eval-*",), "no eval"),)
    )
    assert result.agree == 2 and [line.reason for line in result.lines] == [
        "no eval"
    ]  # the flag and the layout


def test_a_renamed_flag_compares_its_value():
    reference = _reference("--sglang-cuda-graph-max-bs 512")
    rename = (
        renamed("--sglang-cuda-graph-max-bs", "--sglang-cuda-graph-max-bs-decode", reason="0.5.23 name"),
    )
    same = compare(["--sglang-cuda-graph-max-bs-decode", "512"], {}, reference.layout, reference, rename)
    assert [line.render() for line in same.lines] == [
        "= --sglang-cuda-graph-max-bs-decode 512: the reference's --sglang-cuda-graph-max-bs  [0.5.23 name]"
    ]
    other = compare(["--sglang-cuda-graph-max-bs-decode", "256"], {}, reference.layout, reference, rename)
    assert [line.render() for line in other.unexplained] == [
        "~ --sglang-cuda-graph-max-bs-decode: ours 256, reference 512  UNEXPLAINED"
    ]


def test_moe_layer_patterns_compare_by_the_layers_they_describe():
    assert (
        shown("[0]*3+[1]*2", "--moe-layer-freq") == shown("[0,0,0,1,1]", "--moe-layer-freq") == "[0,0,0,1,1]"
    )
    assert shown("[1]*4", "--moe-layer-freq") != shown("[1,1,1]", "--moe-layer-freq")


def test_the_references_layout_is_read_from_its_flags():
    ref = _reference(
        "--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 4 --cp-comm-type a2a "
        "--expert-tensor-parallel-size 1 --actor-num-nodes 1 --actor-num-gpus-per-node 8 --rollout-num-gpus-per-engine 2"
    )
    assert ref.layout == Placement(
        8, ParallelLayout(tp=2, sp=True, cp=4, etp=1, cp_comm_type="a2a"), 2, "a test machine"
    )


def test_flags_reads_switches_values_and_lists():
    assert flags("--a --b 1 --spec m f --c 'x y'") == (
        ("--a", True),
        ("--b", "1"),
        ("--spec", ("m", "f")),
        ("--c", "x y"),
    )


def test_every_reference_cites_a_full_commit_and_the_model_of_a_profile():
    for name in names():
        recipe = shared(name)
        models = {*recipe.models}
        for ref in recipe.references:
            assert len(ref.source.commit) == 40 and int(ref.source.commit, 16) >= 0, ref.script
            assert ref.model in models, (name, ref.model)


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


def _spec_args(recipe, flag: str, value):
    """The recipe with its model's architecture flag `flag` set to `value` (a mutation on a copy)."""
    arch = tuple((f, value if f == flag else v) for f, v in recipe.model.arch_args)
    assert arch != recipe.model.arch_args
    return replace(recipe, model=replace(recipe.model, arch_args=arch))


def _profile(recipe, platform: str, gpus: int, parallel: ParallelLayout):
    profiles = tuple(
        replace(p, parallel=parallel) if (p.platform, p.world_size) == (platform, gpus) else p
        for p in recipe.profiles
    )
    return replace(recipe, profiles=profiles)


# Each mutation once passed `diff`: a deviation named the flag, never the value, so a changed value
# was explained by a reason written for another one.
MUTATIONS = {
    "Qwen3-30B-A3B rolls out in BF16": (
        lambda: replace(shared("qwen3_30b_a3b"), fp8_rollout=False), "cuda", "--hf-checkpoint",
    ),
    "an added NCCL_NVLS_ENABLE=0": (
        lambda: replace(shared("qwen3_4b"), env=(*shared("qwen3_4b").env, ("NCCL_NVLS_ENABLE", "0"))),
        "cuda", "env:NCCL_NVLS_ENABLE",
    ),
    "Qwen3-30B-A3B's ROCm 4-GPU layout at pp4": (
        lambda: _profile(load("qwen3_30b_a3b", platform="rocm"), "rocm", 4, ParallelLayout(pp=4, ep=1, etp=1)),
        "rocm", "layout:4",
    ),
    "GLM-5.2's dispatcher set to allgather": (
        lambda: _spec_args(shared("glm5_2_744b_a40b"), "--moe-token-dispatcher-type", "allgather"),
        "cuda", "--moe-token-dispatcher-type",
    ),
    "Qwen3-4B at tp4·cp1 on 4 GPUs": (
        lambda: _profile(shared("qwen3_4b"), "cuda", 4, ParallelLayout(tp=4, sp=True)), "cuda", "layout:4",
    ),
}  # fmt: skip


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_a_changed_value_is_drift_no_reason_explains(mutation):
    make, platform, key = MUTATIONS[mutation]
    lines = [line for item in reference_comparisons(make(), platform) for line in item.unexplained]
    assert key in {line.key for line in lines}, [line.render() for line in lines]


def test_a_bare_name_explains_only_what_the_reference_alone_passes():
    reference = _reference("--lr 1e-6 --dump-details /x")
    reasons = (Deviation(("--lr", "--dump-details"), "because"),)
    result = compare(["--lr", "2e-6"], {}, reference.layout, reference, reasons)
    assert [(line.key, line.reason) for line in result.lines] == [
        ("--lr", None),
        ("--dump-details", "because"),
    ]
    pinned = (Deviation(("--lr=2e-06",), "pinned"),)
    assert compare(["--lr", "2e-6"], {}, reference.layout, reference, pinned).lines[0].reason == "pinned"
    assert compare(["--lr", "3e-6"], {}, reference.layout, reference, pinned).lines[0].reason is None


def test_every_key_of_every_deviation_explains_a_difference():
    """A pinned value no form renders any more (the recipe changed) is removed or re-pinned."""
    used, offered = set(), set()
    for name in names():
        for form in variants(name):
            platform = "cuda" if form.variant == "shared" else form.variant
            devs = [d for d in form.deviations if isinstance(d, Deviation) and platform in d.platforms]
            offered |= {(d.reason, spec) for d in devs for spec in d.keys}
            for item in reference_comparisons(form, platform):
                for line in item.comparison.lines:
                    ours = None if line.kind == "-" else line.ours.lstrip("=")
                    theirs = line.theirs.lstrip("=") or None
                    for d in devs:
                        spec = d.spec_for(line.key, platform, ours, theirs)
                        if spec:
                            used.add((d.reason, spec))
                            break
    assert not offered - used, sorted(spec for _, spec in offered - used)


def test_a_layout_of_our_own_pins_it_and_names_the_tests_that_prove_it():
    own = [
        (form.name, platform, d)
        for name in names()
        for form in variants(name)
        for d in form.deviations
        if isinstance(d, Deviation) and any(k.startswith("layout:") for k in d.keys)
        for platform in d.platforms
        if platform == ("cuda" if form.variant == "shared" else form.variant)
    ]
    assert {(n, p) for n, p, _ in own} == {
        ("qwen3_4b", "cuda"),
        ("qwen3_30b_a3b", "cuda"),
        ("qwen3_30b_a3b", "rocm"),
    }
    for name, platform, d in own:
        assert all("=" in k for k in d.keys if k.startswith("layout:")), d.keys
        assert d.evidence, f"{name} {platform}: a layout of our own names its proof"
        texts = [(ROOT / path).read_text() for path in d.evidence]
        assert "RECIPE_PROFILES" in texts[0]  # megatron-core's rank grids at every GPU profile's world size
        assert f'("{name}", "{platform}")' in texts[1]  # a dry start of this form, scaled to CPU ranks
