"""DeepSeek-V4's config.json as its Megatron mapping reads it: what it refuses, with one line naming the key.

Every deepseek_v4 value miles.families.deepseek_v4.model does not compute as transformers does is refused by
name, before a model is built; the mapping of the tiny model's config (the published switches)
passes.
"""

from __future__ import annotations

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import UnmappedModel
from miles.families.deepseek_v4 import FAMILY

register_cpu_ci(est_time=1, suite="stage-a-cpu")

refuse_unmapped, weights = FAMILY.refuse_unmapped, FAMILY.weights

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
V4 = {
    "model_type": "deepseek_v4", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 64, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "n_shared_experts": 1,
    "hc_mult": 4, "index_n_heads": 8, "index_head_dim": 32, "vocab_size": 512, "scoring_func": "sqrtsoftplus",
    "layer_types": [SLIDING, SLIDING, CSA, HCA], "mlp_layer_types": ["hash_moe"] * 3 + ["moe"],
    "compress_rates": {CSA: 4, HCA: 128},
    "rope_parameters": {"main": {"rope_type": "default"}, "compress": {"rope_type": "yarn", "attention_factor": 1.0}},
}  # fmt: skip

REFUSED = {
    "biases": ({"mlp_bias": True}, "attention_bias/mlp_bias=true is not built"),
    "gelu": ({"hidden_act": "gelu"}, "hidden_act 'gelu': only silu"),
    "softmax router": ({"scoring_func": "softmax"}, "scoring_func 'softmax': only sqrtsoftplus"),
    "two kv heads": (
        {"num_key_value_heads": 2},
        "num_key_value_heads 2: DeepSeek-V4 attends with one shared",
    ),
    "tied": ({"tie_word_embeddings": True}, "tie_word_embeddings=true"),
    "dropout": ({"attention_dropout": 0.1}, "attention_dropout 0.1"),
    "groups": ({"o_groups": 3}, "o_groups 3 does not divide num_attention_heads 4"),
    "rope kind": (
        {"rope_parameters": {"compress": {"rope_type": "linear"}}},
        "rope_type 'linear': only default",
    ),
    "yarn scaling": (
        {"rope_parameters": {"compress": {"rope_type": "yarn", "attention_factor": 1.3}}},
        "attention_factor 1.3: DeepSeek-V4 never scales",
    ),
    "short layer list": ({"layer_types": [SLIDING] * 3}, "layer_types .* need 4 entries"),
    # transformers builds one shared expert whatever the key says; 0 once converted with no shared
    # expert and logits 6.85 off, 2 blamed the checkpoint file
    "no shared expert": (
        {"n_shared_experts": 0},
        "n_shared_experts 0: transformers' DeepseekV4ForCausalLM builds exactly one",
    ),
    "two shared experts": ({"n_shared_experts": 2}, "n_shared_experts 2: .*set it to 1"),
    "unknown mlp kind": (
        {"mlp_layer_types": ["dense"] * 4},
        "mlp_layer_types .* need 4 entries of hash_moe, moe",
    ),
}


def test_the_published_switches_are_mapped_and_every_weight_has_one_source():
    refuse_unmapped(V4)
    names = [name for name, _ in weights(V4)]
    assert len(names) == len(set(names))
    assert "decoder.layers.2.self_attention.indexer.compressor.ape" in names  # the CSA layer's indexer
    assert "decoder.layers.3.self_attention.compressor.ape" in names and not any(
        "layers.3.self_attention.indexer" in n for n in names
    )  # HCA: a compressor, no indexer
    assert not any("layers.0.self_attention.compressor" in n for n in names)  # sliding: neither
    assert (
        "decoder.layers.0.mlp.router.tid2eid" in names and "decoder.layers.3.mlp.router.expert_bias" in names
    )


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_is_not_built_is_refused_by_name(case):
    change, message = REFUSED[case]
    with pytest.raises(UnmappedModel, match=message) as raised:
        refuse_unmapped({**V4, **change})
    assert "\n" not in str(raised.value) and str(raised.value).startswith("config.json ")
