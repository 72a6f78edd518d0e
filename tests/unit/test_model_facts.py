"""One facts table per model family (miles.families), read by everything that maps config.json to Megatron.

The recipes' fact check, the Megatron backend's model-flag check, the layout checker's model
shape, the converter's TransformerConfig and the common.pt arguments all read a family's
rows; these tests hold them to one another: a recipe's own flags pass the backend's check
against its published config, every row's flag is one the trainer parses, and a family is
found from its module alone.
"""

from __future__ import annotations

import json
import pkgutil
from pathlib import Path

import pytest

from miles import families
from miles.ci.register import register_cpu_ci
from miles.families.facts import ABSENT, flag_values, value
from miles.recipes import names, variants
from miles.train.args import build_parser, parse_config
from miles.train.config import FLAGS, ModelConfig

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def _specs():
    return {recipe.model.name: recipe.model for name in names() for recipe in variants(name)}


def test_a_family_is_its_folder():
    folders = sorted(m.name for m in pkgutil.iter_modules(families.__path__) if m.ispkg)
    assert families.FAMILIES == tuple(folders)
    assert {spec.family for spec in _specs().values()} == set(families.FAMILIES)


def test_every_row_names_a_flag_the_trainer_parses():
    options = {f.option for f in FLAGS}
    missing = {row.flag for f in families.families().values() for row in f.keys} - options
    assert missing == set()


def test_every_row_that_describes_the_model_is_a_flag_of_the_model_section():
    """The backend checks those flags against config.json through the model section it receives."""
    shape = {f.option for f in ModelConfig.flags()}
    rows = {row.flag for f in families.families().values() for row in f.keys if row.describes_model}
    assert rows - shape == set()


@pytest.mark.parametrize("name", sorted(_specs()))
def test_a_recipes_own_flags_pass_the_backends_check_against_its_published_config(name, tmp_path):
    from miles.train.backends.megatron import check_model_flags

    spec = _specs()[name]
    config = {"model_type": families.family(spec.family).model_types[0], **dict(spec.published.values)}
    argv = ["--hf-checkpoint", str(tmp_path)]
    for flag, val in spec.model_args():
        argv += [flag] if val is True else [flag, str(val)]
    assert (
        check_model_flags(parse_config(argv).model, config, str(tmp_path)) is None
    )  # raises on a disagreement


def test_the_backend_names_every_flag_that_describes_another_model(tmp_path):
    from miles.train.backends.megatron import MegatronSetupError, check_model_flags

    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "hidden_size": 128, "num_local_experts": 8,
              "rope_parameters": {"rope_theta": 1000000}, "router_aux_loss_coef": 0.001}  # fmt: skip
    config_of_run = parse_config(["--hf-checkpoint", str(tmp_path), "--num-layers", "4", "--num-experts", "8",
                                  "--rotary-base", "10000", "--moe-aux-loss-coeff", "0"])  # fmt: skip
    with pytest.raises(MegatronSetupError) as err:
        check_model_flags(config_of_run.model, config, "m")
    message = str(err.value)
    assert (
        "--num-layers 4 (config.json num_hidden_layers: 2); --rotary-base 10000 (config.json rope_theta: 1000000)"
        in message
    )
    assert "--num-experts" not in message  # num_local_experts, as transformers 5 writes it
    assert "--moe-aux-loss-coeff" not in message  # a training choice, not another model


def test_config_readers_find_values_where_transformers_writes_them():
    assert value({"rope_parameters": {"rope_theta": 5}}, "rope_theta") == 5
    assert flag_values(families.family("qwen3").keys, {"hidden_size": 128, "num_attention_heads": 4}) == {
        "--hidden-size": 128, "--num-attention-heads": 4, "--kv-channels": 32,
    }  # fmt: skip
    assert "--v-head-dim" not in flag_values(families.family("glm_moe_dsa").keys, {"hidden_size": 128})
    assert value({"num_local_experts": 8}, "num_experts") == 8
    assert value({}, "num_experts") is ABSENT


def test_mla_families_expand_kv_heads_to_every_attention_head():
    dsv4 = families.family("deepseek_v4")
    flags = flag_values(dsv4.keys, {"num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512})
    assert flags == {"--num-attention-heads": 64, "--v-head-dim": 512}  # no query groups for MLA
    # GlmMoeDsaConfig writes head_dim = qk_rope_head_dim (64 in GLM-5): the value head is v_head_dim
    glm = families.family("glm_moe_dsa")
    config = {"num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 64, "v_head_dim": 256}
    assert flag_values(glm.keys, config) == {"--num-attention-heads": 64, "--v-head-dim": 256}


@pytest.mark.parametrize("name", sorted(_specs()))
def test_a_recipe_models_attention_is_its_familys_and_its_flags_say_so(name):
    spec = _specs()[name]
    flags = dict(spec.arch_args)
    from_flags = (
        "dsa" if "--dsa-indexer-topk" in flags else "mla" if flags.get("--multi-latent-attention") else "gqa"
    )
    assert spec.attention == families.family(spec.family).attention == from_flags


@pytest.mark.parametrize("family", families.FAMILIES)
def test_the_layout_checker_reads_a_tiny_config_through_its_family(family, tmp_path):
    from miles.train.layout import model_shape

    table = families.family(family)
    config = {"model_type": table.model_types[0], "num_hidden_layers": 2, **table.tiny_dims}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = model_shape(build_parser().parse_args(["--hf-checkpoint", str(tmp_path)]))
    assert (shape.num_layers, shape.num_attention_heads, shape.attention) == (
        2, table.tiny_dims["num_attention_heads"], table.attention,
    )  # fmt: skip
    experts = value(config, "num_experts")
    experts = value(config, "n_routed_experts") if experts is ABSENT else experts
    assert shape.num_experts == (None if experts is ABSENT else experts)  # a dense family has none
    assert shape.num_query_groups == (
        None if table.attention != "gqa" else table.tiny_dims["num_key_value_heads"]
    )
