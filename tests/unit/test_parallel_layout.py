"""miles.parallel: layouts, the Megatron rules, the suggested fixes and the check command.

Agreement with megatron-core itself is proven in tests/parallel/test_megatron_agreement.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.parallel import LayoutError, ModelShape, ParallelConfig, check, stage_sizes, validate

ROOT = Path(__file__).resolve().parents[2]
MOE = ModelShape("Qwen3-30B-A3B-4layer", 4, 32, 4, 128)
DENSE = ModelShape("Qwen3-4B", 36, 32, 8)


def test_sizes_below_one_are_refused_by_name():
    with pytest.raises(ValueError, match="ep must be an integer >= 1, got 0"):
        ParallelConfig(ep=0)


def test_expert_tensor_parallel_defaults_to_tensor_parallel():
    config = ParallelConfig(tp=4, ep=2)
    assert (config.expert_tp, config.expert_size, config.dense_size) == (4, 8, 4)


def test_trainer_flags_use_megatron_names():
    flags = ParallelConfig(tp=2, pp=2, ep=2, etp=1, sp=True, first_stage_layers=3).trainer_flags()
    assert flags == (
        "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2",
        "--context-parallel-size", "1",
        "--expert-model-parallel-size", "2",
        "--expert-tensor-parallel-size", "1",
        "--sequence-parallel",
        "--decoder-first-pipeline-num-layers", "3",
    )  # fmt: skip


def test_expert_grid_message_names_every_factor_and_the_world_size():
    verdict = validate(ParallelConfig(tp=2, pp=2, ep=4, etp=1), 4)
    assert verdict.rules == ("expert-grid",)
    assert verdict.violations[0].message == "etp(1)·ep(4)·pp(2) = 8 does not divide world size 4"


def test_expert_grid_fix_prefers_the_nearest_ep():
    fixes = validate(ParallelConfig(tp=2, pp=2, ep=4, etp=1), 4).violations[0].fixes
    assert fixes[0] == "ep=4 → ep=2 makes etp·ep·pp = 4 divide world 4"


def test_implicit_expert_tensor_parallel_is_named_as_such():
    message = validate(ParallelConfig(tp=4, ep=4), 4).violations[0].message
    assert message.startswith("etp(= tp, 4)·ep(4)·pp(1) = 16")


def test_dense_grid_names_tp_cp_pp():
    verdict = validate(ParallelConfig(tp=2, cp=2, pp=2), 4, DENSE)
    assert verdict.violations[0].message == "tp(2)·cp(2)·pp(2) = 8 does not divide world size 4"


def test_the_smallest_change_comes_first():
    # tp=1 and tp=2 both make the layout valid on 6 ranks; 3 -> 2 is the smaller step.
    fixes = validate(ParallelConfig(tp=3), 6, MOE).violations[0].fixes
    assert fixes[0] == "tp=3 → tp=2 splits 32 heads 16 per tp rank"


def test_a_fix_that_would_break_another_rule_is_not_offered_first():
    # 8 experts on ep=3 (world 3): ep=2 splits the experts but 2 does not divide 3 ranks.
    fixes = validate(ParallelConfig(ep=3), 3, ModelShape("moe8", 4, 8, 8, 8)).violations[0].fixes
    assert fixes[0].startswith("ep=3 → ep=1")


def test_fewer_kv_heads_than_tp_ranks_are_replicated_and_allowed():
    assert validate(ParallelConfig(tp=8), 8, ModelShape("gqa2", 4, 16, 2)).ok


def test_kv_heads_neither_multiple_nor_divisor_of_tp_are_refused():
    verdict = validate(ParallelConfig(tp=4), 4, ModelShape("kv3", 4, 12, 3))
    assert verdict.rules == ("kv-heads-tp",)


def test_sequence_parallel_without_tp_suggests_turning_it_off():
    verdict = validate(ParallelConfig(sp=True), 2, DENSE)
    assert verdict.violations[0].fixes[0] == "sp=on → sp=off makes the layout valid"


def test_expert_parallel_on_a_dense_model_is_refused():
    assert validate(ParallelConfig(ep=2), 2, DENSE).rules == ("ep-needs-moe",)


def test_dsa_models_cannot_use_context_parallel():
    glm = ModelShape("GLM-5.2-5layer", 5, 64, 64, 256, "dsa")
    assert validate(ParallelConfig(cp=2), 2, glm).rules == ("dsa-cp",)


def test_uneven_layers_suggest_an_explicit_first_stage():
    verdict = validate(ParallelConfig(pp=2), 2, ModelShape("GLM-5.2-5layer", 5, 64, 64, 256, "dsa"))
    assert verdict.rules == ("layers-pp",)
    assert (
        verdict.violations[0].fixes[0]
        == "first_stage_layers=unset → first_stage_layers=2 splits 5 layers as (2, 3)"
    )


def test_stage_sizes_larger_than_the_model_are_refused():
    verdict = validate(ParallelConfig(pp=3, first_stage_layers=3, last_stage_layers=3), 3, MOE)
    assert verdict.rules == ("stage-layers",)


def test_first_and_last_stage_sizes_on_a_single_stage_are_refused():
    # megatron-core would build only the last stage's 1 layer of the model's 4.
    verdict = validate(ParallelConfig(first_stage_layers=1, last_stage_layers=1), 1, MOE)
    assert verdict.rules == ("stage-layers",)
    assert "pp(1) has one stage, which is both first and last" in verdict.violations[0].message


def test_a_fix_that_leaves_another_rule_broken_does_not_claim_a_valid_layout():
    fixes = validate(ParallelConfig(first_stage_layers=1, last_stage_layers=1), 4, MOE).violations[0].fixes
    assert fixes == (
        "pp=1 → pp=4 makes the layout valid",
        "pp=1 → pp=3 clears stage-layers, but the layout still breaks another rule",
    )


def test_stage_sizes_follow_megatron_assignment():
    assert stage_sizes(ParallelConfig(pp=4, first_stage_layers=2), ModelShape("m", 5, 8)) == (2, 1, 1, 1)
    assert stage_sizes(ParallelConfig(pp=2), MOE) == (2, 2)


def test_without_a_model_only_the_grid_rules_apply():
    assert validate(ParallelConfig(tp=3), 3).ok


def test_every_broken_rule_is_reported_in_megatron_order():
    verdict = validate(ParallelConfig(sp=True, ep=2), 2, DENSE)
    assert verdict.rules == ("sp-needs-tp", "ep-needs-moe")


def test_ep_with_tp_without_sequence_parallel_carries_megatron_warning():
    verdict = validate(ParallelConfig(tp=2, ep=2, etp=1), 4, MOE)
    assert verdict.ok and "sequence parallel" in verdict.notes[0]


def test_check_raises_with_where_prefix():
    with pytest.raises(LayoutError, match=r"^recipe inkling, rocm 1x4: tp2·pp2") as err:
        check(ParallelConfig(tp=2, pp=2, ep=4, etp=1), 4, MOE, where="recipe inkling, rocm 1x4")
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
