"""A recipe script refuses at render time what `python -m miles.train` would refuse at start.

`--extra-args` used to be appended unchecked: an unknown flag, a flag without effect on the
chosen engine or backend (`--colocate` or `--sglang-*` on the built-in engine, a Megatron flag
on FSDP, `--offload-train` on CPU), an argparse abbreviation (`--coloc`), a negative
`--num-rollout`, a `--run-id` that climbs out of the output folder and a newline in an
`--extra-env-vars` value all rendered a plan (exit 0) that failed, or did something else, once
started. Now the whole command is read by the trainer's own parser (exact spellings only, every
value by its rule) and the trainer's consumption refusal, and names and variables by theirs:
one line, exit 2. Each test runs the recipe script as a user does (`scripts/run_<name>.py`,
whose main is miles.recipes.script.main) with `train --dry-run`, which starts nothing.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.recipes.script import main

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _render(
    capsys, *argv: str, name: str = "qwen3_4b", env: dict | None = None
) -> tuple[int, list[str], str]:
    capsys.readouterr()
    code = main(name, argv=["train", "--dry-run", *argv], env=env or {})
    said = capsys.readouterr()
    return code, said.err.strip().splitlines(), said.out


def _refused(capsys, *argv: str, **kwargs) -> str:
    code, lines, _ = _render(capsys, *argv, **kwargs)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


# --- the cases ----------------------------------------------------------------------


def test_an_unknown_flag_in_extra_args_is_refused(capsys):
    line = _refused(capsys, "--extra-args=--bogus-flag 1")
    assert "--bogus-flag: python -m miles.train has no flag --bogus-flag" in line, line


def test_colocate_on_the_built_in_engine_is_refused(capsys):
    line = _refused(capsys, "--extra-args=--colocate")
    assert "--colocate (the built-in engine samples inside the trainer's processes" in line, line
    assert "no effect on --train-backend megatron with the torch rollout engine, so refused" in line, line


def test_an_sglang_flag_on_the_built_in_engine_is_refused(capsys):
    line = _refused(capsys, "--extra-args=--sglang-mem-fraction-static 0.5")
    assert "--sglang-mem-fraction-static (read by the sglang rollout engine" in line, line
    assert "no effect on --train-backend megatron with the torch rollout engine, so refused" in line, line


def test_an_sglang_passthrough_on_the_cpu_lane_is_refused(capsys):
    line = _refused(capsys, "--extra-args=--sglang-moe-a2a-backend mori")
    assert "--sglang-moe-a2a-backend: the cpu lane pins no sglang, so no engine takes it" in line, line


def test_a_megatron_flag_on_fsdp_is_refused(capsys):
    line = _refused(capsys, "--train-backend", "fsdp", "--extra-args=--sequence-parallel")
    assert "--sequence-parallel (read by --train-backend megatron): no effect on --train-backend fsdp" in line


def test_offload_train_on_cpu_renders_now_that_every_backend_acts_on_it(capsys):
    # refused while no backend moved its state off the GPU; on CPU "off the device" is the disk
    # form now (docs/training.md), so the trainer acts on it and the render passes it through
    code, lines, out = _render(capsys, "--extra-args=--offload-train")
    assert code == 0 and lines == [], lines
    assert out.rstrip().endswith("--offload-train"), out[-200:]


def test_an_abbreviated_flag_is_refused_with_the_spelling_meant(capsys):
    line = _refused(capsys, "--extra-args=--coloc")
    assert "--coloc: python -m miles.train has no flag --coloc (close: --colocate)" in line, line


@pytest.mark.parametrize(
    "argv", [("--num-rollout=-1",), ("--extra-args=--num-rollout -1",), ("--num-rollout=0",)]
)
def test_a_rollout_count_below_one_is_refused(capsys, argv):
    line = _refused(capsys, *argv)
    assert "python -m miles.train refuses the command: argument --num-rollout: must be >= 1" in line, line


@pytest.mark.parametrize(
    ("run_id", "rule"),
    [
        ("../../escape", "climbs outside the folder"),
        ("a/b", "holds a '/'"),
        (".hidden", "starts with '.'"),
        ("", "non-empty"),
    ],
)
def test_a_run_id_that_is_not_one_plain_name_is_refused(capsys, tmp_path, run_id, rule):
    line = _refused(capsys, f"--run-id={run_id}", f"--output-dir={tmp_path / 'runs'}")
    assert line.startswith("error: --run-id ") and rule in line, line
    assert not (tmp_path / "runs").exists() and not (tmp_path / "escape").exists()


@pytest.mark.parametrize("given", ['{"MY_VAR": "a\\nb"}', "MY_VAR='a\nb'", '{"MY_VAR": "x\\ry"}'])
def test_a_control_character_in_an_env_value_is_refused(capsys, given):
    line = _refused(capsys, f"--extra-env-vars={given}")
    assert "--extra-env-vars: MY_VAR=" in line and "holds a control character" in line, line


# --- more of the same kind ------------------------------------------------------------------


@pytest.mark.parametrize("given", ['{"A-B": "1"}', '{"1X": "2"}', '{"": "3"}', "'A B=1'"])
def test_an_env_name_that_is_not_a_variable_name_is_refused(capsys, given):
    assert "is not a variable name" in _refused(capsys, f"--extra-env-vars={given}")


def test_a_flag_given_twice_with_different_values_in_extra_args_is_refused(capsys):
    line = _refused(capsys, "--extra-args=--lr 1e-6 --lr 2e-6")
    assert "--extra-args: --lr given 2 times with different values" in line, line


def test_a_control_character_in_an_extra_arg_is_refused(capsys):
    line = _refused(capsys, "--extra-args=--prompt-data 'a\x1bb'")
    assert "holds a control character" in line, line


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        ("--rollout-temperature 0", "--rollout-temperature must be > 0"),
        ("--eps-clip -1", "argument --eps-clip"),
        ("--rollout-top-p 2", "argument --rollout-top-p"),
        ("--lr abc", "argument --lr"),
        ("--global-batch-size 3", "must be a multiple of --global-batch-size (3)"),
        ("--kl-coef 0.1", "--kl-coef 0.1: KL in the reward is not supported"),
    ],
)
def test_a_value_the_trainer_refuses_is_refused_at_render(capsys, extra, rule):
    line = _refused(capsys, f"--extra-args={extra}")
    assert "python -m miles.train refuses the command" in line and rule in line, line


def test_the_variable_form_of_extra_args_is_checked_the_same(capsys):
    line = _refused(capsys, env={"MILES_SCRIPT_EXTRA_ARGS": "--coloc"})
    assert "--coloc: python -m miles.train has no flag --coloc" in line, line


def test_the_variable_form_of_run_id_is_checked_the_same(capsys):
    assert "climbs outside the folder" in _refused(capsys, env={"MILES_SCRIPT_RUN_ID": "../x"})


def test_an_unknown_sglang_field_on_a_gpu_form_is_refused(capsys):
    line = _refused(capsys, "--platform=cuda", "--extra-args=--sglang-not-a-field 1")
    assert "--sglang-not-a-field: sglang" in line and "has no ServerArgs field 'not_a_field'" in line, line


def test_a_valid_override_still_renders_last(capsys):
    code, lines, out = _render(capsys, "--extra-args=--lr 2e-6 --num-rollout 3")
    assert code == 0, lines
    assert "extra_args     --lr 2e-6 --num-rollout 3" in out, out


def test_the_engine_extra_args_choose_is_the_one_the_flags_are_checked_against(capsys):
    # the device check's sglang step renders the CPU tiny profile with --rollout-engine sglang:
    # its sglang flags act there, so the render passes them; on the profile's torch engine they
    # are refused (above)
    code, lines, out = _render(
        capsys, "--extra-args=--rollout-engine sglang --sglang-mem-fraction-static 0.3 --colocate"
    )
    assert code == 0 and lines == [], lines
    assert out.rstrip().endswith("--rollout-engine sglang --sglang-mem-fraction-static 0.3 --colocate"), out[
        -200:
    ]
