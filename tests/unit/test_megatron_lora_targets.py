"""Which Megatron layers --target-modules names for --train-backend megatron (miles.megatron.lora.targets).

Megatron fuses q_proj, k_proj and v_proj into linear_qkv and gate_proj and up_proj into linear_fc1,
so one adapter serves each fused layer: an HF spelling names its layer only with all its parts.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.megatron.lora import LoraRefused, hf_targets, targets
from miles.train.args import parse_config

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _lora(*extra: str):
    return parse_config(["--hf-checkpoint", "x", "--lora-rank", "4", *extra]).lora


def test_all_linear_adapts_every_fused_layer():
    assert targets(_lora()) == ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
    assert hf_targets(targets(_lora())) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


def test_hf_and_megatron_spellings_name_the_same_layers():
    hf = _lora("--target-modules", "q_proj,k_proj,v_proj,down_proj")
    assert targets(hf) == ("linear_qkv", "linear_fc2")
    assert targets(_lora("--target-modules", "linear_qkv,linear_fc2")) == targets(hf)


def test_part_of_a_fused_layer_is_refused_with_the_parts_to_name():
    with pytest.raises(LoraRefused, match="fuses q_proj, k_proj, v_proj into one linear_qkv"):
        targets(_lora("--target-modules", "q_proj,v_proj"))


def test_an_unknown_module_is_refused_with_the_known_ones():
    with pytest.raises(LoraRefused, match="lm_head is no linear layer.*linear_qkv"):
        targets(_lora("--target-modules", "lm_head"))
