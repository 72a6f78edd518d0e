"""The --dumper-* flags (miles.train.dumps): what a phase's KEY=VALUE pairs mean, the errors a bad
one gets, and the flags no component acts on refused with the reason."""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.train import consumption
from miles.train.args import parse_config
from miles.train.dumps import DumpConfigError, PhaseDump, phase_dump

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _config(*flags: str):
    return parse_config(["--hf-checkpoint", "m", *flags], raising=True)


def test_dumper_enable_turns_on_both_training_phases_and_pairs_override_it():
    config = _config(
        "--dumper-enable", "--dumper-fwd-only", "enable=0", "--dumper-fwd-bwd", "filter=layer_id == 2"
    )
    assert phase_dump(True, "--dumper-fwd-only", config.checks.dumper_fwd_only) == PhaseDump(enable=False)
    assert phase_dump(True, "--dumper-fwd-bwd", config.checks.dumper_fwd_bwd) == PhaseDump(
        enable=True, filter="layer_id == 2"
    )
    assert phase_dump(False, "--dumper-fwd-bwd", ["enable=1", "enable_model_grad=true"]) == PhaseDump(
        enable=True, enable_model_grad=True
    )


@pytest.mark.parametrize(
    ("pair", "says"),
    [
        ("enable_grad=1", "KEY one of enable, filter, enable_model_value, enable_model_grad"),
        ("enable", "expected KEY=VALUE"),
        ("enable=yes", "enable='yes': expected 0, 1, true or false"),
        ("filter=layer_id <", "is not a Python expression"),
    ],
)
def test_a_bad_pair_names_the_flag_and_what_fits(pair, says):
    with pytest.raises(DumpConfigError, match="--dumper-fwd-bwd") as info:
        phase_dump(True, "--dumper-fwd-bwd", [pair])
    assert says in str(info.value)
    with pytest.raises(Exception, match="--dumper-fwd-bwd"):
        _config("--dumper-enable", "--dumper-fwd-bwd", pair)


def test_a_dump_folder_with_no_phase_dumping_is_refused():
    with pytest.raises(Exception, match="--dumper-dir configure tensor dumps, but no phase dumps"):
        _config("--dumper-dir", "/tmp/x")
    assert _config("--dumper-dir", "/tmp/x", "--dumper-fwd-bwd", "enable=1").checks.dumper_dir == "/tmp/x"


@pytest.mark.parametrize(
    "flags",
    [
        ("--dumper-inference", "enable=1"),
        ("--dumper-source-patcher-config-train", "p.yaml"),
        ("--dumper-source-patcher-config-inference", "p.yaml"),
    ],
)
def test_what_no_component_dumps_is_refused_with_the_reason(flags):
    config = _config("--dumper-enable", *flags)
    for engine in ("torch", "sglang"):
        refusal = consumption.refusal(config, engine)
        assert refusal is not None and refusal.startswith(flags[0]), refusal
    assert "--dumper-enable" not in consumption.flags_without_effect(config, "torch")


def _tiny_decoder():
    import torch

    class Layer(torch.nn.Module):
        def __init__(self, number: int):
            super().__init__()
            self.layer_number = number  # megatron's: 1-based, counted over every pipeline stage
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(3), Layer(4)])  # a second pipeline stage's layers

        def forward(self, input_ids):
            x = input_ids.float()
            for layer in self.layers:
                x = layer(x)
            return x

    return Decoder()


def test_layer_ids_are_the_global_layer_numbers_and_the_bound_stops_writing(tmp_path):
    import json

    import torch

    from miles.train.dumps import Dumper

    model = _tiny_decoder()
    phases = {"fwd_only": PhaseDump(enable=True), "fwd_bwd": PhaseDump(enable=False)}
    dumper = Dumper(
        tmp_path, phases, rank=0, world_size=1, max_bytes=4 * 4 * 4 * 3
    )  # three [4, 4] fp32 tensors
    with dumper.phase("fwd_only", 0, [model]):
        model(torch.ones(4, 4))
        model(torch.ones(4, 4))  # step 1: nothing left under the bound
    manifest = json.loads((tmp_path / "fwd_only" / "rollout_0" / "manifest_rank=0.json").read_text())
    assert manifest["truncated"] and manifest["bytes"] == 192
    names = [entry["file"] for entry in manifest["files"]]
    assert names == [
        "step=0___rank=0___dump_index=1___name=input_ids.pt",
        "step=0___rank=0___dump_index=2___name=layers.0.proj.output___layer_id=2.pt",
        "step=0___rank=0___dump_index=3___name=layers.0.output___layer_id=2.pt",
    ]
    assert sorted(p.name for p in (tmp_path / "fwd_only" / "rollout_0").glob("*.pt")) == sorted(names)
