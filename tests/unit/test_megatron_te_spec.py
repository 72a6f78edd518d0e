"""Which layer spec a Megatron run builds, what its first line says, and how its experts export.

With Transformer Engine on a GPU the backend builds megatron-core's TE spec (TE's attention,
fused linears, grouped-GEMM experts); otherwise the stand-in spec with the same keys. TE cannot
be installed here, so its status is passed in as `te_status()` would report it on a GPU; the
stand-in is built for real, and the first line is read off the modules built.
"""

from __future__ import annotations

import inspect

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")

CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 32, "moe_intermediate_size": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 300, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 64, "tie_word_embeddings": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [0], "dtype": "float32",
}  # fmt: skip


def test_spec_choice_follows_transformer_impl_and_megatron_cores_own_te_import():
    from miles.megatron.spec import LOCAL, TE, SpecRefused, TEStatus, choose_impl

    # TE cannot exist here: its status is passed in, as te_status() would report it on a GPU
    absent, present = (
        TEStatus(False, None, "transformer_engine is not installed"),
        TEStatus(True, "2.9.0", ""),
    )
    assert choose_impl(None, "cuda:0", present) == (TE, "transformer-engine 2.9.0")
    assert choose_impl(None, "cuda:0", absent) == (
        LOCAL,
        "no Transformer Engine: transformer_engine is not installed",
    )
    assert choose_impl("local", "cuda:0", present) == (LOCAL, "--transformer-impl local")
    assert choose_impl(None, "cpu") == (LOCAL, "on the CPU")
    with pytest.raises(
        SpecRefused, match="Transformer Engine does not load here \\(transformer_engine is not installed\\)"
    ):
        choose_impl("transformer_engine", "cuda:0", absent)
    with pytest.raises(SpecRefused, match="this run is on the CPU"):
        choose_impl("transformer_engine", "cpu", present)
    # installed but broken (TE raises FileNotFoundError when its torch extension is missing,
    # transformer_engine/common/__init__.py _get_shared_object_file): megatron-core's own imports
    # catch only ImportError, so no spec can be built
    broken = TEStatus(
        False, None, "importing it failed: FileNotFoundError: Could not find shared object", True
    )
    with pytest.raises(SpecRefused, match="installed but does not load here .*FileNotFoundError"):
        choose_impl("local", "cuda:0", broken)


def test_the_first_line_names_the_modules_built_and_a_conversion_builds_the_stand_in(monkeypatch):
    from miles.families.model import build_model
    from miles.megatron import spec
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    # even where TE would load, a model built without a spec choice (the conversion's) is the stand-in
    monkeypatch.setattr(spec, "te_status", lambda: spec.TEStatus(True, "2.9.0", ""))
    with single_process_group(), cpu_placed():
        model = build_model(CONFIG)
    line = spec.built_spec_line([model], None, spec.LOCAL, "on the CPU")
    assert line == (
        "megatron stand-in layer spec (on the CPU): attention DotProductAttention, "
        "linear_qkv NormColumnParallelLinear, experts SequentialMLP"
    )


def test_grouped_gemm_experts_export_under_sequential_mlps_names():
    from megatron.core.transformer.moe import experts

    from miles.megatron.export import expert_name

    # megatron-core names local expert i's weight `weight{i}` of TEGroupedMLP's grouped linears
    assert "f'{name}.weight{i}'" in inspect.getsource(experts.TEGroupedMLP.sharded_state_dict)
    assert expert_name("mlp.experts.linear_fc1.weight3") == "mlp.experts.local_experts.3.linear_fc1.weight"
    assert expert_name("mlp.experts.linear_fc2.weight0") == "mlp.experts.local_experts.0.linear_fc2.weight"
    assert (
        expert_name("mlp.experts.local_experts.1.linear_fc1.weight")
        == "mlp.experts.local_experts.1.linear_fc1.weight"
    )
    assert expert_name("mlp.linear_fc1.layer_norm_weight") == "mlp.linear_fc1.layer_norm_weight"
    # whole-model names keep their owner: a decoder layer's, or a carried MTP layer's (GLM-5.2)
    assert (
        expert_name("decoder.layers.2.mlp.experts.linear_fc2.weight1")
        == "decoder.layers.2.mlp.experts.local_experts.1.linear_fc2.weight"
    )
    assert (
        expert_name("mtp.layers.0.transformer_layer.mlp.experts.linear_fc1.weight5")
        == "mtp.layers.0.transformer_layer.mlp.experts.local_experts.5.linear_fc1.weight"
    )


def test_no_gpu_means_the_stand_in_and_a_requested_te_spec_is_refused():
    from miles.megatron.spec import SpecRefused, choose_impl

    with pytest.raises(SpecRefused, match="pass --transformer-impl local or leave the flag out"):
        choose_impl("transformer_engine", "cpu")
