"""Tiny checkpoints: the families' real classes, loadable by the Auto classes, with a usable tokenizer."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from miles.ci.register import register_cpu_ci
from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import family
from miles.ckpt.plan import FAMILIES
from miles.ckpt.shards import read_weight_map
from miles.ckpt.tiny import make_tiny_checkpoint
from miles.ckpt.validate import validate_checkpoint
from miles.families import transformers_config

register_cpu_ci(est_time=3, suite="stage-b-cpu")


@pytest.mark.parametrize("name", FAMILIES)
def test_tiny_checkpoint_loads_with_auto_classes_and_generates_on_cpu(tiny, name):
    path = tiny(name)
    attention = "sdpa" if family(name).sdpa else "eager"
    # a release whose class transformers lacks (MiMo's remote code) loads its trunk as the family says
    trunk = family(name).trunk_model_type is not None
    given = {"config": transformers_config(path)} if trunk else {}
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attention, **given
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    written = json.loads((path / "config.json").read_text())["architectures"]
    if family(
        name
    ).tiny_class:  # a vision-language release's class; the causal-LM auto class loads its decoder
        assert written == [family(name).tiny_class] and type(model).__name__.endswith("ForCausalLM")
    elif trunk:
        assert written == list(family(name).release_architectures), written
        assert model.config.model_type == family(name).trunk_model_type
    else:
        assert type(model).__name__ in written
    messages = [{"role": "user", "content": "copy 0427:"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    validate_checkpoint(path, name, expect_layers=4)


def test_tiny_checkpoint_is_sharded_with_an_index_and_a_few_megabytes(tiny):
    path = tiny("qwen3_moe")
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) >= 2 and (path / "model.safetensors.index.json").is_file()
    assert sum(p.stat().st_size for p in shards) < 8_000_000


def test_tokenizer_spells_digits_and_letters_one_token_each_and_ends_turns_with_eos(tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny("qwen3"))
    text = "copy 0427: abcXYZ"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text) and tokenizer.decode(ids) == text
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_same_arguments_give_the_same_bytes(tiny, tmp_path, tree_digest):
    again = make_tiny_checkpoint("glm_moe_dsa", 4, tmp_path / "again")
    assert tree_digest(again) == tree_digest(tiny("glm_moe_dsa"))


def test_dims_override_the_family_defaults_and_a_bad_dim_is_refused(tmp_path):
    path = make_tiny_checkpoint("qwen3", 2, tmp_path / "wide", seed=3, hidden_size=256, intermediate_size=512)
    config = json.loads((path / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 2)
    with pytest.raises(CheckpointError, match="vocab_size 100 < 259"):
        make_tiny_checkpoint("qwen3", 2, tmp_path / "small-vocab", vocab_size=100)
    with pytest.raises(CheckpointError, match="num_hidden_layers cannot be a dim"):
        make_tiny_checkpoint("qwen3", 2, tmp_path / "layers", num_hidden_layers=3)


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_tiny_qwen3_ties_its_embeddings_like_qwen3_4b(tiny):
    path = tiny("qwen3")
    assert _config(path)["tie_word_embeddings"] is True
    assert "lm_head.weight" not in read_weight_map(path).weight_map
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tiny_qwen3_moe_renormalizes_its_top_k_like_qwen3_30b_a3b(tiny):
    assert _config(tiny("qwen3_moe"))["norm_topk_prob"] is True


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_tiny_qwen3_attention_is_wider_than_hidden_and_rope_theta_is_1e6(tiny, name):
    config = _config(tiny(name))
    assert config["num_attention_heads"] * config["head_dim"] != config["hidden_size"]
    assert config["rope_parameters"]["rope_theta"] == 1_000_000


@pytest.mark.parametrize(
    "name,mtp_tensor",
    [("glm_moe_dsa", "model.layers.4.eh_proj.weight"), ("deepseek_v4", "mtp.0.e_proj.weight")],
)
def test_tiny_models_carry_the_mtp_layer_their_config_declares(tiny, name, mtp_tensor):
    path = tiny(name)
    assert _config(path)["num_nextn_predict_layers"] == 1
    names = read_weight_map(path).weight_map
    assert mtp_tensor in names
    block = [n for n in names if n.startswith(mtp_tensor.rsplit(".", 2)[0])]
    assert any(".experts." in n for n in block) and any("q_b" in n or "wq_b" in n for n in block)
    validate_checkpoint(path, name, expect_layers=4)  # declared, so not an unexpected tensor


def test_tiny_deepseek_v4_has_flash_layer_kinds_and_no_constant_values_that_hide_paths(tiny):
    from safetensors import safe_open

    path = tiny("deepseek_v4")
    config = _config(path)
    sliding, csa, hca = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
    kinds = [sliding, sliding, csa, hca]
    assert config["layer_types"] == kinds  # the first 4 of Flash's compress_ratios
    assert config["mlp_layer_types"] == ["hash_moe"] * 3 + ["moe"]
    assert config["hc_mult"] == 4 and config["index_n_heads"] == 8
    assert config["rope_parameters"]["compress"]["rope_type"] == "yarn"
    names = read_weight_map(path).weight_map
    assert not any(n.startswith("mtp.0.attn.compressor") for n in names)  # the MTP layer is sliding
    assert "mtp.0.ffn.gate.bias" in names and "mtp.0.ffn.gate.tid2eid" not in names  # and routes by top-k
    tensors = {}
    for shard in sorted(set(names.values())):
        with safe_open(path / shard, "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    table = tensors["model.layers.0.ffn.gate.tid2eid"]
    assert table.dtype == torch.int64 and table.shape == (512, 2)
    assert bool((table[:, 0] != table[:, 1]).all()) and set(table.unique().tolist()) == set(range(8))
    for name in ("model.layers.0.attn.attn_sink", "model.layers.3.attn.compressor.ape", "model.layers.1.hc_ffn_base",
                 "model.layers.1.hc_ffn_scale", "model.hc_head.hc_base", "model.layers.3.ffn.gate.bias",
                 "model.layers.2.attn.indexer.compressor.norm.weight", "model.layers.0.attn.q_norm.weight"):  # fmt: skip
        assert tensors[name].float().std() > 0.01, name


def test_any_switch_can_be_set_from_the_command_line(tmp_path):
    from miles.ckpt.cli import main

    untied = tmp_path / "untied"
    assert main(["make-tiny", "--family", "qwen3", "--layers", "2", "--out", str(untied),
                 "--dim", "tie_word_embeddings=0", "--dim", "rope_theta=10000.0"]) == 0  # fmt: skip
    assert _config(untied)["tie_word_embeddings"] is False
    assert _config(untied)["rope_parameters"]["rope_theta"] == 10000.0
    assert "lm_head.weight" in read_weight_map(untied).weight_map
    no_mtp = tmp_path / "no-mtp"
    assert main(["make-tiny", "--family", "glm_moe_dsa", "--layers", "2", "--out", str(no_mtp),
                 "--dim", "num_nextn_predict_layers=0"]) == 0  # fmt: skip
    assert not [n for n in read_weight_map(no_mtp).weight_map if ".layers.2." in n]
    tied = make_tiny_checkpoint("qwen3_moe", 2, tmp_path / "tied", tie_word_embeddings=1)
    assert _config(tied)["tie_word_embeddings"] is True
