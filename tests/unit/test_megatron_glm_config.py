"""GLM-5.2's config.json as the Megatron backend reads it: what it maps, what it refuses, and why.

Every glm_moe_dsa value megatron-core's model cannot compute as transformers does is refused
with one line naming the key and the reason; every Megatron flag a command sets that describes
another GLM (a softmax router, an updated expert bias, MTP training, another attention variant)
is refused by the backend's flag check; and a pipeline split that starts a stage on a layer
reusing another layer's DSA top-k is refused when the trainer parses its flags.
"""

from __future__ import annotations

import json

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import UnmappedModel, family, megatron_family
from miles.families.facts import indexer_types, shared_index_layers

register_cpu_ci(est_time=1, suite="stage-a-cpu")

GLM = {
    "model_type": "glm_moe_dsa", "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_nope_head_dim": 48, "qk_rope_head_dim": 16,
    "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "index_topk_freq": 4, "index_skip_topk_offset": 3, "num_nextn_predict_layers": 1,
}  # fmt: skip

REFUSED = {
    "attention_bias": ({"attention_bias": True}, "attention_bias/mlp_bias=true is not mapped"),
    "yarn rope": ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not mapped"),
    "no q latent": ({"q_lora_rank": None}, "q_lora_rank null: the DSA indexer reads the q latent"),
    "kv heads": ({"num_key_value_heads": 2}, "num_key_value_heads 2 != num_attention_heads 4"),
    "attention dropout": ({"attention_dropout": 0.1}, "attention_dropout 0.1: megatron-core's DSA attention"),
    "indexer rope halves": ({"indexer_rope_interleave": False}, "indexer_rope_interleave=false"),
    "raw top-k weights": ({"norm_topk_prob": False}, "norm_topk_prob=false or num_experts_per_tok=1"),
    "group score": (
        {"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
        "transformers scores a group by its top-2 experts",
    ),
    "dense last layer with MTP": ({"first_k_dense_replace": 4}, "num_nextn_predict_layers with a dense last layer"),
    "shared first layer": ({"index_topk_pattern": "SFFS"}, "layer 0 is shared"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_glm_config_megatron_cannot_compute_as_transformers_does_is_refused_by_name(case):
    change, message = REFUSED[case]
    config = {**GLM, **change}
    with pytest.raises(UnmappedModel, match="^config.json ") as err:
        megatron_family(config).refuse_unmapped(config)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_published_switches_are_mapped():
    grouped = {**GLM, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4}  # 4 // 2 = 2: as transformers
    for config in (GLM, grouped):
        assert (
            megatron_family(config).refuse_unmapped(config) is None
        )  # it returns only when nothing is refused


@pytest.mark.parametrize(
    ("keys", "layers"),
    [({"index_topk_freq": 4, "index_skip_topk_offset": 3}, 9), ({"index_topk_freq": 4}, 8), ({}, 3),
     ({"index_topk_pattern": "FFSFS"}, 5), ({"index_topk_freq": 2, "index_skip_topk_offset": 0}, 6)],
)  # fmt: skip
def test_indexer_kinds_are_transformers_own(keys, layers):
    from transformers import AutoConfig

    config = AutoConfig.for_model("glm_moe_dsa", num_hidden_layers=layers, **keys)
    assert indexer_types(keys, layers) == tuple(config.indexer_types)
    assert indexer_types(config.to_dict()) == tuple(config.indexer_types)  # as config.json writes it


def test_glm_5_2_runs_its_indexer_on_layers_1_2_3_7_11_and_the_mtp_layer():
    published = {"index_topk_freq": 4, "index_skip_topk_offset": 3, "num_hidden_layers": 78}
    full = [i + 1 for i, kind in enumerate(indexer_types(published, 79)) if kind == "full"]
    assert full[:5] == [1, 2, 3, 7, 11] and full[-2:] == [75, 79]  # 1-based, the MTP layer (79) last
    assert shared_index_layers({**published, "num_hidden_layers": 5}) == (3, 4)


def test_flags_that_describe_another_glm_are_refused_together(tmp_path):
    from miles.train.args import parse_config
    from miles.train.backends.megatron import MegatronSetupError, check_model_flags

    config = parse_config([
        "--hf-checkpoint", str(tmp_path), "--moe-router-score-function", "softmax",
        "--moe-router-bias-update-rate", "0.001", "--mtp-num-layers", "2",
        "--experimental-attention-variant", "gated_delta_net", "--v-head-dim", "16",
    ])  # fmt: skip
    with pytest.raises(MegatronSetupError) as err:
        check_model_flags(config.model, GLM, str(tmp_path), config.megatron)
    message = str(err.value)
    for wrong in (
        "--moe-router-score-function softmax (transformers' GlmMoeDsaForCausalLM routes by sigmoid scores: sigmoid)",
        "--moe-router-bias-update-rate 0.001 (",
        "--mtp-num-layers 2 (config.json num_nextn_predict_layers: ",
        "--experimental-attention-variant gated_delta_net (",
        "--v-head-dim 16 (config.json v_head_dim: 32)",
    ):
        assert wrong in message, wrong
    assert family("glm_moe_dsa").fixed  # the rows the check read


def test_a_pipeline_stage_starting_on_a_shared_dsa_layer_is_refused_at_parse_time(tmp_path, capsys):
    from miles.train.args import parse_args

    (tmp_path / "config.json").write_text(json.dumps(GLM))  # layers 0-2 full, layer 3 shared
    base = ["--hf-checkpoint", str(tmp_path), "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
            "--pipeline-model-parallel-size", "2"]  # fmt: skip
    assert parse_args(base).layout.pp == 2  # 2 + 2: both stages start on a full layer
    with pytest.raises(SystemExit):
        parse_args([*base, "--decoder-first-pipeline-num-layers", "3"])
    err = capsys.readouterr().err
    assert "a pipeline stage starts at layer 3, which reuses the DSA top-k of an earlier layer" in err
    assert "first_stage_layers=2" in err  # the fix
