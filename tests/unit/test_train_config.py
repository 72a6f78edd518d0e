"""The trainer's configuration sections: every flag in exactly one, built once, frozen, typed."""

from __future__ import annotations

import dataclasses
import re

import pytest

from miles.ci.register import register_cpu_ci
from miles.parallel import ParallelLayout
from miles.train.args import build_parser, parse_config
from miles.train.config import (
    FLAG,
    FLAGS,
    SECTION_NAMES,
    SECTIONS,
    ModelConfig,
    ParallelFlags,
    RunConfig,
    flag_of,
)

register_cpu_ci(est_time=1, suite="stage-a-cpu")

# A recipe-shaped command touching most sections.
COMMAND = """
--hf-checkpoint /models/Qwen3-4B --ref-load /models/Qwen3-4B_torch_dist --num-layers 36 --num-query-groups 8
--rollout-batch-size 32 --n-samples-per-prompt 8 --global-batch-size 256 --eps-clip 0.2 --eps-clip-high 0.28
--adam-beta2 0.98 --sglang-mem-fraction-static 0.7 --tensor-model-parallel-size 2 --sequence-parallel
--expert-tensor-parallel-size 1 --recompute-granularity full --actor-num-gpus-per-node 4 --train-backend megatron
--sglang-cuda-graph-bs 1 2 4 8
""".split()


def _options_in_help() -> list[str]:
    """Every option string `python -m miles.train --help` shows, from the parser's own output."""
    text = build_parser().format_help()
    listed = text.split("options:", 1)[1]
    return sorted({m for m in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", listed) if m != "--help"})


def test_every_flag_the_parser_lists_belongs_to_exactly_one_section():
    in_sections = [f.option for s in SECTIONS for f in s.flags()]
    assert len(in_sections) == len(set(in_sections))  # no flag in two sections
    # the epilog's --sglang-<name> is not a flag; everything else --help lists is one of a section
    assert sorted(set(in_sections)) == [o for o in _options_in_help() if o != "--sglang-"]
    assert [f.option for f in FLAGS] == in_sections


def test_a_flag_added_to_the_parser_outside_the_sections_is_caught():
    parser = build_parser()
    parser.add_argument("--stray-flag")
    listed = parser.format_help().split("options:", 1)[1]
    assert "--stray-flag" in listed and "--stray-flag" not in {f.option for f in FLAGS}


def test_each_flag_is_the_field_of_its_name_and_fields_without_a_flag_are_few():
    for section in SECTIONS:
        for field in dataclasses.fields(section):
            if FLAG in field.metadata:
                assert f"--{field.name.replace('_', '-')}" in {f.option for f in section.flags()}
    derived = [(s.name, f.name) for s in SECTIONS for f in dataclasses.fields(s) if FLAG not in f.metadata]
    assert derived == [("sglang", "server_args")]  # the --sglang-<name> pass-through


def test_the_run_config_has_one_attribute_per_section():
    names = [f.name for f in dataclasses.fields(RunConfig) if f.name != "flags_set"]
    assert sorted(names) == sorted(SECTION_NAMES)


def test_sections_carry_the_parsed_values_and_cannot_be_changed():
    config = parse_config(COMMAND)
    assert config.checkpoint.hf_checkpoint == "/models/Qwen3-4B"
    assert config.rollout.samples == config.batch.global_batch_size == 256
    assert (config.algorithm.eps_clip, config.algorithm.eps_clip_high) == (0.2, 0.28)
    assert config.optimizer.adam_beta2 == 0.98 and config.job.train_backend == "megatron"
    assert config.layout == ParallelLayout(tp=2, sp=True, etp=1)
    assert config.model.num_query_groups == 8 and config.megatron.recompute_granularity == "full"
    assert config.sglang.sglang_mem_fraction_static == 0.7
    assert config.sglang.server_args["cuda_graph_bs"] == ["1", "2", "4", "8"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rollout.num_rollout = 1  # type: ignore[misc]


def test_list_flags_become_tuples_in_a_section():
    config = parse_config(["--hf-checkpoint", "m", "--rollout-stop-token-ids", "3", "4"])
    assert config.rollout.rollout_stop_token_ids == (3, 4)


def test_the_flags_a_command_sets_are_recorded_before_defaults_are_filled_in():
    config = parse_config(["--hf-checkpoint", "m", "--eps-clip", "0.3", "--sglang-dp-size", "2"])
    assert config.flags_set == ("--hf-checkpoint", "--eps-clip", "--sglang-dp-size")
    assert config.algorithm.eps_clip_high == 0.3  # filled from --eps-clip, not set by the command


def test_a_sections_values_off_their_default_are_the_flags_set_and_what_validation_filled_in():
    config = parse_config(COMMAND)
    sections = [
        name for name in SECTION_NAMES if name != ParallelFlags.name
    ]  # RunConfig.layout is the layout
    found = {option for name in sections for option in config.section(name).non_default()}
    layout = {f.option for f in ParallelFlags.flags()}
    passed = {o for o in config.flags_set if o not in layout and flag_of(o) is not None}
    assert found == passed | {"--rollout-seed"}  # filled in from --seed
    assert config.megatron.non_default() == {"--recompute-granularity": "full"}


def test_the_small_configs_derive_from_the_sections():
    config = parse_config(
        "--hf-checkpoint m --rollout-temperature 0.7 --rollout-stop-token-ids 5 --lr 2e-5 --adam-beta1 0.8".split()
    )
    sampling = config.rollout.sampling_config(eos_token_ids=(2, 5))
    assert (sampling.temperature, sampling.stop_token_ids) == (0.7, (5, 2))
    loss = config.algorithm.loss_config(config.rollout.rollout_temperature)
    assert loss.temperature == 0.7 and loss.eps_clip_high == loss.eps_clip
    optim = config.optimizer.optim_config()
    assert (optim.lr, optim.beta1, optim.beta2) == (2e-5, 0.8, 0.999)


def test_a_section_is_built_directly_with_the_flags_defaults():
    assert ModelConfig().num_layers is None and ModelConfig(num_layers=4).num_layers == 4
