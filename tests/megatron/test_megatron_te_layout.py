"""torch_dist checkpoints carry the keys of the layer spec GPU jobs train with: Transformer Engine's.

Transformer Engine cannot be installed here, so the spec is megatron-core's own
`get_gpt_layer_with_transformer_engine_spec`, called with local modules that have TE's
parameter names (miles.megatron.spec). Which norms are fused into which linear, and
where an MoE layer keeps its own pre-MLP norm, is decided by that megatron-core function;
the checkpoint must load into the resulting model with nothing missing and nothing left over.
"""

from __future__ import annotations

import json

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=2, suite="stage-b-cpu")

# one dense layer first, then MoE layers: both kinds of layer in one checkpoint
MIXED = {"mlp_only_layers": [0]}


@pytest.fixture(scope="module")
def mixed_moe(tmp_path_factory):
    from tests.support.ckpt import tiny

    made = tiny("qwen3_moe", 3, torch_dist=True, **MIXED)
    return json.loads((made.hf / "config.json").read_text()), made.torch_dist / "release"


def _te_spec_layers(config):
    from megatron.core.transformer.identity_op import IdentityOp

    from miles.families.transformer import transformer_config
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.spec import decoder_block_spec

    with single_process_group():
        specs = decoder_block_spec(transformer_config(config)).layer_specs
    return [(spec.submodules, IdentityOp) for spec in specs]


def test_te_spec_fuses_the_dense_norms_and_keeps_the_moe_pre_mlp_norm(mixed_moe):
    config, _ = mixed_moe
    (dense, identity), *moe = _te_spec_layers(config)
    assert dense.input_layernorm is identity and dense.pre_mlp_layernorm is identity
    for layer, _ in moe:
        assert layer.input_layernorm is identity  # fused into linear_qkv
        assert layer.pre_mlp_layernorm is not identity  # the router reads the normed input


def test_checkpoint_loads_strictly_into_the_te_spec_model(mixed_moe):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from miles.families.model import build_model
    from miles.megatron.checkpoint import single_process_group

    config, release = mixed_moe
    with single_process_group():
        model = build_model(config)
        wanted = model.sharded_state_dict()
        keys = {v.key for v in wanted.values()}
        # raises on any key the model asks for that the checkpoint lacks, or the reverse
        dist_checkpointing.load(wanted, str(release), strict=StrictHandling.RAISE_ALL)
    # a mixed dense/MoE pattern keeps per-layer keys
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in keys  # the dense layer's
    assert {"decoder.layers.1.pre_mlp_layernorm.weight", "decoder.layers.2.pre_mlp_layernorm.weight"} <= keys
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" not in keys
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in keys


def test_megatron_cores_local_spec_would_ask_for_a_moe_key_no_te_job_writes(mixed_moe):
    """Why the conversion does not use the local spec: it renames every pre-MLP norm to the fused
    linear_fc1 key, MoE layers included, which a TE model (and this checkpoint) does not have."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from miles.families.transformer import transformer_config
    from miles.megatron.checkpoint import single_process_group

    config, _ = mixed_moe
    with single_process_group():
        tc = transformer_config(config)
        spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
        model = GPTModel(
            config=tc, transformer_layer_spec=spec, vocab_size=config["vocab_size"], max_sequence_length=64
        )
        keys = {v.key for v in model.sharded_state_dict().values() if hasattr(v, "key")}
    assert "decoder.layers.1.pre_mlp_layernorm.weight" not in keys
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in keys
