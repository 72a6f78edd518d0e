"""Every fusion the Megatron backend turns on with Transformer Engine's spec is one megatron-core's
constructors accept, with what it runs installed.

With TE's spec the backend took Megatron-LM's fusion defaults, among them
gradient_accumulation_fusion; megatron-core 0.16.1's GPTModel builds its output layer as a
plain ColumnParallelLinear, whose constructor raises RuntimeError without Apex's
fused_weight_gradient_mlp_cuda (in neither image nor lock): every Megatron run of the GPU
images would have stopped at model build. The scan (miles.megatron.fusions) reads the
installed megatron-core's constructors and the extension modules each fusion's code imports;
miles' table must answer each, and the backend turns a fusion on only where what it runs
imports. TE cannot load here, so the model is built with the TE spec's TransformerConfig and
megatron-core's own output layer, up to the layers TE would supply (the stand-in spec's).
"""

from __future__ import annotations

import functools
import json

import pytest

from miles.ci.register import register_cpu_ci
from miles.megatron import fusions, options
from miles.megatron.te_names import installed_megatron_core
from miles.train.args import parse_config

register_cpu_ci(est_time=9, suite="stage-a-cpu")


def _megatron(*flags: str):
    return parse_config(["--hf-checkpoint", "/unused", *flags]).megatron


@functools.cache
def _scan() -> fusions.Scan:
    return fusions.scan(installed_megatron_core())


def test_every_check_megatron_cores_constructors_make_of_a_fusion_is_answered():
    result = _scan()
    assert fusions.unanswered(result) == [], "\n".join(map(str, fusions.unanswered(result)))
    # each answer the table gives is a check the installed release still makes
    keys = {c.key for c in result.checks}
    stale = [k for f in fusions.FUSIONS for k in f.answers if k not in keys]
    assert stale == []


def test_the_extension_modules_each_fusion_runs_are_the_tables():
    result = _scan()
    assert {f.field: f.modules for f in fusions.FUSIONS} == dict(result.modules)
    assert result.modules["gradient_accumulation_fusion"] == ("fused_weight_gradient_mlp_cuda",)
    (column,) = [c for c in result.checks if c.function == "ColumnParallelLinear.__init__"]
    assert column.path == "megatron/core/tensor_parallel/layers.py"


def test_the_scan_finds_a_constructor_check_and_the_extension_behind_its_flag(tmp_path):
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "layer.py").write_text(
        "try:\n    import fast_wgrad_cuda\n    HAVE_FAST = True\nexcept ImportError:\n    HAVE_FAST = False\n\n"
        "class Linear:\n    def __init__(self, config):\n"
        "        if config.gradient_accumulation_fusion and not HAVE_FAST:\n            raise RuntimeError('no')\n"
        "    def forward(self, x):\n        if self.config.gradient_accumulation_fusion:\n            raise ValueError\n"
    )
    result = fusions.scan(core, ("gradient_accumulation_fusion",))
    assert [c.key for c in result.checks] == [
        "megatron.core.layer:Linear.__init__ (config.gradient_accumulation_fusion and (not HAVE_FAST))"
    ]  # a check outside a constructor is not one
    assert result.modules == {"gradient_accumulation_fusion": ("fast_wgrad_cuda",)}


def test_a_fusion_is_on_with_te_only_where_what_it_runs_imports():
    megatron = _megatron()
    on_image = options.transformer_fields(
        megatron, "transformer_engine", imports=lambda m: m == "transformer_engine"
    )
    assert {f: on_image[f] for f in fusions.BY_FIELD} == {
        "apply_rope_fusion": True, "bias_dropout_fusion": True, "masked_softmax_fusion": False,
        "bias_activation_fusion": True, "gradient_accumulation_fusion": False,
    }  # fmt: skip
    with_apex = options.transformer_fields(megatron, "transformer_engine", imports=lambda m: True)
    assert all(with_apex[f] for f in fusions.BY_FIELD)
    flagged = _megatron("--no-gradient-accumulation-fusion", "--no-rope-fusion")
    off = options.transformer_fields(flagged, "transformer_engine", imports=lambda m: True)
    assert (off["gradient_accumulation_fusion"], off["apply_rope_fusion"]) == (False, False)
    assert not any(
        options.transformer_fields(megatron, "local", imports=lambda m: True)[f] for f in fusions.BY_FIELD
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "glm_moe_dsa"])
def test_the_te_specs_model_builds_on_cpu_up_to_the_layers_te_supplies(family, tmp_path):
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.families.model import build_model
    from miles.families.transformer import transformer_config
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    layers = 4 if family == "glm_moe_dsa" else 2
    config = json.loads((make_tiny_checkpoint(family, layers, tmp_path / family) / "config.json").read_text())
    # the fields the backend gives megatron-core with TE's spec, with this machine's imports
    fields = options.transformer_fields(_megatron(), "transformer_engine")
    with single_process_group(), cpu_placed():
        tc = transformer_config(config, dtype=torch.float32, on_cpu=True, initialize=True, **fields)
        model = build_model(config, transformer=tc)
    assert type(model.output_layer) is ColumnParallelLinear  # megatron-core's own, with either spec
    assert model.output_layer.gradient_accumulation_fusion is fusions.module_imports(
        "fused_weight_gradient_mlp_cuda"
    )
    if family == "glm_moe_dsa":  # DSA refuses the rope fusion: the family's off wins over TE's default
        assert tc.apply_rope_fusion is False


def test_each_no_fusion_flag_turns_off_the_field_the_table_pairs_it_with():
    for fusion in fusions.FUSIONS:
        fields = options.transformer_fields(
            _megatron(fusion.flag), "transformer_engine", imports=lambda m: True
        )
        assert [f for f in fusions.BY_FIELD if not fields[f]] == [fusion.field], fusion.flag
