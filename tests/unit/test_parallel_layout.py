"""miles.parallel: layouts, the Megatron rules, the suggested fixes and the check command.

Agreement with megatron-core itself is proven in tests/parallel/test_megatron_agreement.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.parallel import (
    InvalidParallelism,
    ModelShape,
    ParallelLayout,
    check,
    env_problems,
    layers_per_virtual_stage,
    required_env,
    stage_sizes,
    validate,
)
from miles.parallel.numbers import divisors

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
MOE = ModelShape("Qwen3-30B-A3B-4layer", 4, 32, 4, 128)
DENSE = ModelShape("Qwen3-4B", 36, 32, 8)


def test_sizes_below_one_are_refused_by_name():
    with pytest.raises(ValueError, match="ep must be an integer >= 1, got 0"):
        ParallelLayout(ep=0)


def test_expert_tensor_parallel_defaults_to_tensor_parallel():
    config = ParallelLayout(tp=4, ep=2)
    assert (config.expert_tp, config.expert_size, config.dense_size) == (4, 8, 4)


def test_trainer_flags_use_megatron_names():
    flags = ParallelLayout(tp=2, pp=2, ep=2, etp=1, sp=True, first_stage_layers=3).trainer_flags()
    assert flags == (
        "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2",
        "--context-parallel-size", "1",
        "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1",
        "--sequence-parallel",
        "--decoder-first-pipeline-num-layers", "3",
    )  # fmt: skip


def test_data_parallel_sizes_are_derived_for_a_world_size():
    layout = ParallelLayout(tp=2, pp=2, ep=4, etp=1)
    assert (layout.dp(8), layout.expert_dp(8)) == (2, 1)
    assert ParallelLayout().dp(3) == 3  # the data-parallel backends: every rank is a replica


def test_a_world_the_grids_do_not_fit_names_every_factor_and_a_value_that_fits():
    with pytest.raises(InvalidParallelism) as err:
        ParallelLayout(tp=2, pp=2, ep=4, etp=1).dp(4)
    assert "etp(1)·ep(4)·pp(2) = 8 does not divide world size 4" in str(err.value)
    assert "ep=4 → ep=2" in str(err.value)


def test_megatron_core_gets_the_layout_from_one_translation():
    layout = ParallelLayout(tp=2, pp=2, vpp=2, cp=2, ep=2, sp=True, first_stage_layers=3, cp_comm_type="a2a")
    assert layout.initialize_model_parallel_kwargs() == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": 2, "context_parallel_size": 2,
        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2,
    }  # fmt: skip
    fields = layout.transformer_config_kwargs()
    assert fields["sequence_parallel"] and fields["num_layers_in_first_pipeline_stage"] == 3
    assert fields["cp_comm_type"] == "a2a" and fields["num_layers_in_last_pipeline_stage"] is None
    assert not ParallelLayout(sp=True).transformer_config_kwargs()["sequence_parallel"]  # tp=1


def test_one_virtual_stage_per_rank_is_no_virtual_pipeline_as_megatron_lm_reads_it():
    assert ParallelLayout(pp=2, vpp=1) == ParallelLayout(pp=2)
    assert not ParallelLayout(pp=2, vpp=1).interleaved and ParallelLayout(pp=2, vpp=2).model_chunks == 2


def test_an_expert_tensor_parallel_size_equal_to_tp_is_the_default():
    assert ParallelLayout(tp=4, etp=4) == ParallelLayout(tp=4)
    assert ParallelLayout(tp=4).trainer_flags()[-2:] == ("--expert-tensor-parallel-size", "4")


def test_one_layout_type_in_the_package():
    import re

    pattern = re.compile(r"class .*Layout|class ModelParallel")
    found = [
        f"{path.relative_to(ROOT)}: {line.strip()}"
        for path in sorted((ROOT / "miles").rglob("*.py"))
        for line in path.read_text().splitlines()
        if pattern.search(line)
    ]
    assert found == ["miles/parallel/layout.py: class ParallelLayout:"]


def test_expert_grid_message_names_every_factor_and_the_world_size():
    verdict = validate(ParallelLayout(tp=2, pp=2, ep=4, etp=1), 4)
    assert verdict.rules == ("expert-grid",)
    assert verdict.violations[0].message == "etp(1)·ep(4)·pp(2) = 8 does not divide world size 4"


def test_expert_grid_fix_prefers_the_nearest_ep():
    fixes = validate(ParallelLayout(tp=2, pp=2, ep=4, etp=1), 4).violations[0].fixes
    assert fixes[0] == "ep=4 → ep=2 makes etp·ep·pp = 4 divide world 4"


def test_implicit_expert_tensor_parallel_is_named_as_such():
    message = validate(ParallelLayout(tp=4, ep=4), 4).violations[0].message
    assert message.startswith("etp(= tp, 4)·ep(4)·pp(1) = 16")


def test_dense_grid_names_tp_cp_pp():
    verdict = validate(ParallelLayout(tp=2, cp=2, pp=2), 4, DENSE)
    assert verdict.violations[0].message == "tp(2)·cp(2)·pp(2) = 8 does not divide world size 4"


def test_the_smallest_change_comes_first():
    # tp=1 and tp=2 both make the layout valid on 6 ranks; 3 -> 2 is the smaller step.
    fixes = validate(ParallelLayout(tp=3), 6, DENSE).violations[0].fixes
    assert fixes[0] == "tp=3 → tp=2 splits 32 heads 16 per tp rank"


def test_a_fix_that_would_break_another_rule_is_not_offered_first():
    # 8 experts on ep=3 (world 3): ep=2 splits the experts but 2 does not divide 3 ranks.
    fixes = validate(ParallelLayout(ep=3), 3, ModelShape("moe8", 4, 8, 8, 8)).violations[0].fixes
    assert fixes[0].startswith("ep=3 → ep=1")


def test_fewer_kv_heads_than_tp_ranks_are_replicated_and_allowed():
    assert validate(ParallelLayout(tp=8), 8, ModelShape("gqa2", 4, 16, 2)).ok


def test_kv_heads_neither_multiple_nor_divisor_of_tp_are_refused():
    verdict = validate(ParallelLayout(tp=4), 4, ModelShape("kv3", 4, 12, 3))
    assert verdict.rules == ("kv-heads-tp",)


def test_sequence_parallel_with_tp_1_is_turned_off_with_a_note_as_megatron_lm_does():
    verdict = validate(ParallelLayout(sp=True, pp=2, cp=2, ep=4, etp=1), 8, MOE)  # the AMD reference
    assert verdict.ok
    assert "Megatron-LM turns it off with a warning" in verdict.notes[0]
    assert not ParallelLayout(sp=True).effective_sp


def test_expert_parallel_on_a_dense_model_is_refused():
    assert validate(ParallelLayout(ep=2), 2, DENSE).rules == ("ep-needs-moe",)


GLM = ModelShape("GLM-5.2-5layer", 5, 64, 64, 256, "dsa")


def test_dsa_with_context_parallel_is_refused_by_megatron_core_0_16():
    verdict = validate(ParallelLayout(cp=2, cp_comm_type="all_gather"), 2, GLM, megatron_core="0.16.1")
    assert verdict.rules == ("dsa-cp",)
    assert "megatron-core 0.16.1 cannot split over cp(2)" in verdict.violations[0].message


def test_dsa_with_context_parallel_needs_all_gather_from_megatron_core_0_19():
    assert validate(ParallelLayout(cp=2), 2, GLM, megatron_core="0.19.2").rules == ("dsa-cp",)
    assert validate(ParallelLayout(cp=2, cp_comm_type="all_gather"), 2, GLM, megatron_core="0.19.2").ok


def test_dsa_fix_under_0_19_is_the_all_gather_communication():
    fixes = validate(ParallelLayout(cp=2), 2, GLM, megatron_core="0.19.2").violations[0].fixes
    assert "cp_comm_type=unset → cp_comm_type=all_gather makes the layout valid" in fixes


def test_the_installed_megatron_core_decides_by_default():
    from miles.parallel.rules import installed_megatron_core

    assert validate(ParallelLayout(), 1).megatron_core == installed_megatron_core() == "0.16.1"


def test_uneven_layers_suggest_an_explicit_first_stage():
    verdict = validate(ParallelLayout(pp=2), 2, ModelShape("GLM-5.2-5layer", 5, 64, 64, 256, "dsa"))
    assert verdict.rules == ("layers-pp",)
    assert (
        verdict.violations[0].fixes[0]
        == "first_stage_layers=unset → first_stage_layers=2 splits 5 layers as (2, 3)"
    )


def test_stage_sizes_larger_than_the_model_are_refused():
    verdict = validate(ParallelLayout(pp=3, first_stage_layers=3, last_stage_layers=3), 3, MOE)
    assert verdict.rules == ("stage-layers",)


def test_first_and_last_stage_sizes_on_a_single_stage_are_refused():
    # megatron-core would build only the last stage's 1 layer of the model's 4.
    verdict = validate(ParallelLayout(first_stage_layers=1, last_stage_layers=1), 1, MOE)
    assert verdict.rules == ("stage-layers",)
    assert "pp(1) has one stage, which is both first and last" in verdict.violations[0].message


def test_fix_candidates_are_the_divisors_of_the_world():
    # pp=3 would clear stage-layers but can never divide 4 ranks, so it is not searched.
    fixes = validate(ParallelLayout(first_stage_layers=1, last_stage_layers=1), 4, MOE).violations[0].fixes
    assert fixes == ("pp=1 → pp=4 makes the layout valid",)


def test_a_fix_with_a_rule_outcome_still_says_when_the_layout_stays_invalid():
    # etp follows tp=3; etp=4 clears the expert grid but tp=3 still breaks the dense grid.
    fixes = validate(ParallelLayout(tp=3), 8).violations[1].fixes
    assert fixes[0] == (
        "etp=3 → etp=4 makes etp·ep·pp = 4 divide world 8, but the layout would still be invalid "
        "(dense-grid: tp(3)·cp(1)·pp(1) = 3 does not divide world size 8)"
    )


def test_stage_sizes_follow_megatron_assignment():
    assert stage_sizes(ParallelLayout(pp=4, first_stage_layers=2), ModelShape("m", 5, 8)) == (2, 1, 1, 1)
    assert stage_sizes(ParallelLayout(pp=2), MOE) == (2, 2)


def test_without_a_model_only_the_grid_rules_apply():
    assert validate(ParallelLayout(tp=3), 3).ok


def test_every_broken_rule_is_reported_in_megatron_order():
    verdict = validate(ParallelLayout(tp=3, ep=2), 6, DENSE)
    assert verdict.rules == ("heads-tp", "kv-heads-tp", "ep-needs-moe")


def test_ep_with_tp_without_sequence_parallel_carries_megatron_warning_without_a_model():
    verdict = validate(ParallelLayout(tp=2, ep=2, etp=1), 4)
    assert verdict.ok and "sequence parallel" in verdict.notes[0]


def test_check_raises_with_where_prefix():
    with pytest.raises(InvalidParallelism, match=r"^recipe inkling, rocm 1x4: tp2·pp2") as err:
        check(ParallelLayout(tp=2, pp=2, ep=4, etp=1, sp=True), 4, MOE, where="recipe inkling, rocm 1x4")
    assert err.value.verdict.rules == ("expert-grid",)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles.parallel", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )


def test_check_command_passes_a_valid_layout():
    proc = _cli("check", "--world-size", "4", "--tp", "2", "--pp", "2", "--ep", "2", "--etp", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["ok"] is True


def test_check_command_prints_the_fix_and_exits_1():
    proc = _cli("check", "--world-size", "4", "--tp", "2", "--pp", "2", "--ep", "4", "--etp", "1")
    assert proc.returncode == 1
    assert "fix: ep=4 → ep=2 makes etp·ep·pp = 4 divide world 4" in proc.stdout


def test_check_command_applies_model_rules_when_given_a_model():
    proc = _cli(
        "check", "--world-size", "3", "--tp", "3", "--layers", "4", "--heads", "32", "--kv-heads", "4"
    )
    assert proc.returncode == 1
    assert "heads-tp: model: 32 attention heads do not split evenly over tp(3)" in proc.stdout


def test_check_command_bad_size_is_a_usage_error():
    proc = _cli("check", "--world-size", "4", "--tp", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: tp must be an integer >= 1, got 0"


def test_layout_checks_import_neither_torch_nor_megatron():
    code = "import sys, miles.parallel; sys.exit(bool({'torch', 'megatron'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=False).returncode == 0


# --- virtual pipeline stages -------------------------------------------------------------

EIGHT = ModelShape("dense8", 8, 8)


def test_virtual_pipeline_needs_more_than_one_pipeline_rank():
    verdict = validate(ParallelLayout(vpp=2), 1, EIGHT)
    assert verdict.rules == ("vpp-needs-pp",)
    assert verdict.violations[0].fixes[0] == "vpp=2 → vpp=unset makes the layout valid"


def test_layers_per_virtual_stage_follow_megatron_assignment():
    config = ParallelLayout(tp=2, pp=2, vpp=2)
    assert validate(config, 4, EIGHT).ok
    assert stage_sizes(config, EIGHT) == (4, 4)
    assert layers_per_virtual_stage(config, EIGHT) == (2, 2)


def test_layers_per_pipeline_rank_must_split_into_the_virtual_stages():
    verdict = validate(ParallelLayout(pp=2, vpp=3), 2, EIGHT)
    assert verdict.rules == ("vpp-layers",)
    assert verdict.violations[0].message == (
        "dense8: 8 layers over pp(2) leave 4 per pipeline rank, which do not split into vpp(3) virtual stages"
    )


def test_explicit_stage_sizes_must_split_into_the_virtual_stages():
    verdict = validate(ParallelLayout(pp=4, vpp=2, first_stage_layers=3), 4, ModelShape("m", 9, 8))
    assert verdict.rules == ("stage-layers",)
    assert "the first stage's 3 layer(s) do not split into vpp(2)" in verdict.violations[0].message


def test_virtual_pipeline_reaches_the_trainer_under_megatron_lm_flag():
    flags = ParallelLayout(tp=2, pp=2, vpp=2).trainer_flags()
    assert flags[-2:] == ("--num-virtual-stages-per-pipeline-rank", "2")


# --- MoE rules ---------------------------------------------------------------------------


def test_moe_with_tensor_parallel_needs_sequence_parallel():
    verdict = validate(ParallelLayout(tp=2), 2, MOE)
    assert verdict.rules == ("moe-tp-needs-sp",)
    assert verdict.violations[0].fixes[0] == "sp=off → sp=on makes the layout valid"


def test_dense_models_may_use_tensor_parallel_without_sequence_parallel():
    assert validate(ParallelLayout(tp=2), 2, DENSE).ok


def test_moe_with_biases_needs_expert_tensor_parallel_1():
    biased = ModelShape("biased-moe", 4, 8, 8, 8, bias=True)
    verdict = validate(ParallelLayout(tp=2, sp=True, ep=2, etp=2), 4, biased)
    assert verdict.rules == ("moe-bias-etp",)
    assert verdict.violations[0].fixes[0] == "etp=2 → etp=1 makes the layout valid"
    assert validate(ParallelLayout(tp=2, sp=True, ep=2, etp=2), 4, replace(biased, bias=False)).ok


def test_experts_copied_over_tensor_parallel_need_expert_parallel():
    # at ep 1 megatron-core reduces expert weights as dense ones, over data parallel only
    verdict = validate(ParallelLayout(tp=2, sp=True, etp=1), 2, MOE)
    assert verdict.rules == ("expert-copies-tp",)
    assert "copied on 2 ranks of a tensor-parallel group" in verdict.violations[0].message
    assert verdict.violations[0].fixes == (
        "etp=1 → etp=2 makes the layout valid",
        "ep=1 → ep=2 makes the layout valid",
    )
    assert validate(ParallelLayout(tp=2, sp=True, ep=2, etp=1), 2, MOE).ok
    assert validate(ParallelLayout(tp=2, sp=True, etp=2), 2, MOE).ok


def test_an_expert_ffn_width_must_split_over_expert_tensor_parallel():
    odd = ModelShape("odd-moe", 4, 8, 8, 8, moe_ffn_hidden_size=36)
    assert validate(ParallelLayout(tp=8, sp=True, etp=8), 8, odd).rules == ("moe-ffn-etp",)


# --- environment -------------------------------------------------------------------------


def test_tensor_or_context_parallel_need_one_device_connection():
    assert required_env(ParallelLayout(tp=2)) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert required_env(ParallelLayout(cp=2)) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert required_env(ParallelLayout(pp=2, ep=2)) == {}


def test_a_launch_environment_without_the_setting_is_named():
    (problem,) = env_problems(ParallelLayout(tp=2), {"CUDA_DEVICE_MAX_CONNECTIONS": "8"})
    assert "needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the launch environment" in problem
    assert problem.endswith("found CUDA_DEVICE_MAX_CONNECTIONS=8")
    assert env_problems(ParallelLayout(tp=2), {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}) == []


# --- the fix search ----------------------------------------------------------------------


def test_divisors_come_from_the_prime_factors():
    assert divisors(1) == [1]
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert len(divisors(2**40)) == 41
    prime = 1099511627791  # the first prime above 2^40
    assert divisors(prime) == [1, prime]
    assert divisors(prime * 3) == [1, 3, prime, 3 * prime]


def test_a_world_of_two_to_the_40_gets_divisor_fixes():
    verdict = validate(ParallelLayout(tp=3), 2**40)
    assert verdict.violations[0].fixes[0] == "tp=3 → tp=4 makes tp·cp·pp = 4 divide world 1099511627776"


def test_check_command_answers_a_huge_world_with_the_verdict_first():
    proc = _cli("check", "--world-size", "1099511627776", "--tp", "3")
    assert proc.returncode == 1
    assert proc.stdout.splitlines()[0] == (
        "layout tp3·pp1·cp1·ep1·etp3 on 1099511627776 rank(s): INVALID, dense-grid: tp(3)·cp(1)·pp(1) = 3 "
        "does not divide world size 1099511627776 (+1 more)"
    )


def test_check_command_understands_virtual_pipeline():
    proc = _cli(
        "check", "--world-size", "4", "--tp", "2", "--pp", "2", "--vpp", "2", "--layers", "8", "--heads", "8"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.splitlines()[0] == "layout tp2·pp2·cp1·ep1·etp2 vpp2 on 4 rank(s) for model: valid"


def test_a_usage_error_is_one_line():
    proc = _cli("check", "--world-size", "4", "--tpp", "2")
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "python -m miles.parallel: error: unrecognized arguments: --tpp 2 (--help lists the commands and flags)"
    ]


def test_megatron_proof_of_a_world_above_the_cap_is_refused_before_forking():
    proc = _cli("check", "--world-size", "4096", "--tp", "2", "--megatron")
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: --megatron forks one gloo process per rank, and world size 4096 is above")
    assert "MILES_MEGATRON_PROOF_MAX_RANKS" in line


# --- the layout of a trainer command (miles.train.layout) ---------------------------------


def _trainer(*flags: str):
    from miles.train.args import parse_args

    base = [
        "--hf-checkpoint",
        "/nonexistent",
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "4",
    ]
    return parse_args([*base, "--num-layers", "8", "--num-attention-heads", "8", *flags])


def test_trainer_layers_per_virtual_stage_become_the_vpp_degree():
    from miles.train.layout import parallel_layout

    args = _trainer("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2")
    assert parallel_layout(args, 4).vpp == 2  # 8 layers / pp 2 = 4 per rank = 2 virtual stages of 2


def test_trainer_virtual_stages_per_rank_become_the_vpp_degree_the_run_carries():
    args = _trainer("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2")
    assert args.layout == ParallelLayout(pp=2, vpp=2)


def test_trainer_gets_one_virtual_pipeline_flag_at_most(capsys):
    with pytest.raises(SystemExit):
        _trainer(
            "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
            "--num-layers-per-virtual-pipeline-stage", "2",
        )  # fmt: skip
    assert "both set the virtual pipeline; give one" in capsys.readouterr().err


def test_trainer_virtual_stages_per_rank_reach_the_layout_checks(capsys):
    with pytest.raises(SystemExit):
        _trainer("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "3")
    assert "vpp(3) virtual stages" in capsys.readouterr().err


def test_trainer_layers_per_virtual_stage_that_do_not_divide_the_rank_are_named(capsys):
    with pytest.raises(SystemExit):
        _trainer("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3")
    err = capsys.readouterr().err
    assert "--num-layers-per-virtual-pipeline-stage 3: the 4 layers of each pipeline rank do not split" in err


def test_trainer_window_size_is_megatron_lms_left_right_pair(capsys):
    assert _trainer("--window-size", "512,0").window_size == (512, 0)
    with pytest.raises(SystemExit):
        _trainer("--window-size", "512")
    assert "--window-size: must be LEFT,RIGHT (e.g. 512,0), got '512'" in capsys.readouterr().err
