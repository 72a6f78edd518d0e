"""GLM-4.7-Flash's config.json as the Megatron backend reads it: what it maps, what it refuses, and why.

Every glm4_moe_lite value megatron-core's model cannot compute as transformers does is refused
with one line naming the key and the reason; which layers are MoE is transformers' reading of
`mlp_layer_types` (its default: the first layer dense), and the `first_k_dense_replace` the
published config.json also writes (SGLang reads it) must agree; every Megatron flag a command sets
that describes another GLM-4.7-Flash (a softmax router, an updated expert bias, MTP training, DSA,
another MoE pattern) is refused by the backend's flag check.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import UnmappedModel, family, megatron_family
from miles.families.facts import flag_values

register_cpu_ci(est_time=1, suite="stage-a-cpu")

# GLM-4.7-Flash's config.json at tiny sizes, as zai-org publishes it (first_k_dense_replace beside
# transformers' mlp_layer_types, which its class derives when absent)
LITE = {
    "model_type": "glm4_moe_lite", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
    "v_head_dim": 64, "n_routed_experts": 8, "num_experts_per_tok": 4, "n_shared_experts": 1, "moe_intermediate_size": 64,
    "routed_scaling_factor": 1.8, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
    "rope_scaling": {"rope_theta": 1000000}, "rope_interleave": True,
}  # fmt: skip

REFUSED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias/mlp_bias=true is not mapped"),
    "yarn rope": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not mapped"),
    "rope halves": ({"rope_interleave": False}, "rope_interleave=false: megatron-core's MLA rotates"),
    "kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads 2 != num_attention_heads 4"),
    "attention dropout": ({"attention_dropout": 0.1}, "attention_dropout 0.1: megatron-core's MLA attention"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act 'gelu': only silu"),
    "raw top-k weights": ({"norm_topk_prob": False}, "norm_topk_prob=false or num_experts_per_tok=1"),
    "group score": (
        {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
        "transformers scores a group by its top-2 experts",
    ),
    "dense after MoE": (
        {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"], "first_k_dense_replace": None},
        "a dense layer after a MoE layer",
    ),
    "first_k_dense_replace disagrees": ({"first_k_dense_replace": 2}, "first_k_dense_replace 2 with 1 leading"),
    "dense last layer with MTP": (
        {"mlp_layer_types": ["dense"] * 4, "first_k_dense_replace": 4},
        "num_nextn_predict_layers with a dense last layer",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_glm4_moe_lite_config_megatron_cannot_compute_as_transformers_does_is_refused_by_name(case):
    change, message = REFUSED[case]
    config = {**LITE, **change}
    with pytest.raises(UnmappedModel, match="^config.json ") as err:
        megatron_family(config).refuse_unmapped(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_published_switches_and_the_other_mapped_ones_are_not_refused():
    other = {**LITE, "q_lora_rank": None, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
             "tie_word_embeddings": True, "mlp_layer_types": ["dense", "dense", "sparse", "sparse"],
             "first_k_dense_replace": 2}  # fmt: skip
    for config in (LITE, other):
        assert (
            megatron_family(config).refuse_unmapped(config) is None
        )  # it returns only when nothing is refused


@pytest.mark.parametrize(
    ("written", "moe"),
    [({}, [False, True, True, True, True]),  # transformers' default list, then the MTP layer
     ({"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}, [False, False, True, True, True])],
)  # fmt: skip
def test_moe_layers_are_transformers_reading_of_mlp_layer_types(written, moe):
    from transformers import AutoConfig

    config = {**LITE, **written}
    built = AutoConfig.for_model("glm4_moe_lite", num_hidden_layers=4, **written)
    assert family("glm4_moe_lite").moe_layers(config)[:4] == [k == "sparse" for k in built.mlp_layer_types]
    assert family("glm4_moe_lite").moe_layers(config) == moe
    pattern = "+".join(f"[{int(m)}]*{n}" for m, n in ((0, moe.index(True)), (1, 4 - moe.index(True))))
    assert flag_values(family("glm4_moe_lite").keys, config)["--moe-layer-freq"] == pattern


def test_the_megatron_model_takes_the_mapped_values():
    fields = family("glm4_moe_lite").transformer_fields({**LITE, "q_lora_rank": None})
    assert fields["q_lora_rank"] is None  # q_proj, not MLATransformerConfig's default latent of 512
    assert fields["moe_layer_freq"] == [0, 1, 1, 1] and fields["moe_router_topk_scaling_factor"] == 1.8
    assert fields["rotary_base"] == 1_000_000 and fields["moe_shared_expert_intermediate_size"] == 64
    assert "experimental_attention_variant" not in fields  # megatron-core's own MLA attention


def test_flags_that_describe_another_glm4_moe_lite_are_refused_together(tmp_path):
    from miles.train.args import parse_config
    from miles.train.backends.megatron import MegatronSetupError, check_model_flags

    config = parse_config([
        "--hf-checkpoint", str(tmp_path), "--moe-router-score-function", "softmax",
        "--moe-router-bias-update-rate", "0.001", "--mtp-num-layers", "2", "--moe-layer-freq", "[0]*2+[1]*2",
        "--v-head-dim", "16", "--moe-router-topk-scaling-factor", "2.5",
    ])  # fmt: skip
    with pytest.raises(MegatronSetupError) as err:
        check_model_flags(config.model, LITE, str(tmp_path), config.megatron)
    message = str(err.value)
    for wrong in (
        "--moe-router-score-function softmax (transformers' Glm4MoeLiteForCausalLM routes by sigmoid scores: sigmoid)",
        "--moe-router-bias-update-rate 0.001 (",
        "--mtp-num-layers 2 (config.json num_nextn_predict_layers: ",
        "--moe-layer-freq [0]*2+[1]*2 (config.json mlp_layer_types",
        "--v-head-dim 16 (config.json v_head_dim: 64)",
        "--moe-router-topk-scaling-factor 2.5 (config.json routed_scaling_factor: 1.8)",
    ):
        assert wrong in message, (wrong, message)
