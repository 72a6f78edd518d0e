"""MiMo (MiMo-7B-RL's family, model_type mimo) built by megatron-core computes what transformers' Qwen2 trunk and SGLang's MiMo MTP layer compute.

A tiny MiMo checkpoint with MiMo-7B-RL's switches (untied embeddings, GQA 4:1, q/k/v biases, rope
theta 640000, eps 1e-5, one MTP layer `model.mtp_layers.0.*`), its norms moved off transformers'
initial constants (tests/support/ckpt.py perturbed), run over two gloo ranks at TP 1 (two data-parallel
ranks), TP 2 with sequence parallelism and PP 2 in one launch (tests/megatron/mtp_layout_worker.py).
In float32, at every layout:

- the logits are within 1e-5 of transformers' Qwen2ForCausalLM loading the trunk (transformers has
  no MiMo class; miles loads the trunk so, miles.families.mimo);
- the MTP layer's logits (megatron-core's MTP block, fed the decoder's final hidden state, its
  embedding input zeroed at position 0 as the trainer runs it) are within 1e-5 of a reference built
  from transformers' own Qwen2DecoderLayer and Qwen2RMSNorm wired as SGLang's
  python/sglang/srt/models/mimo_mtp.py forward (sgl-project/sglang 87d624054f8a) wires them, and of the
  first layout's; with input_proj's halves exchanged the reference is far from them;
- the gradient norm of the mean token cross-entropy equals transformers' within 1e-5 relative.

And on one process: HF -> torch_dist (the converter prepare-ckpt runs) -> HF (the weight export's
cutting) gives back every tensor bit-equal, megatron's eh_proj holding input_proj's halves swapped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import perturbed
from tests.support.results import results

register_cpu_ci(est_time=15, suite="stage-b-cpu")

TOL = 1e-5
GRAD_REL = 1e-5
LAYERS = 2
WORKER = Path(__file__).with_name("mtp_layout_worker.py")
LAYOUTS = ("tp1", "tp2sp", "pp2")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return perturbed("mimo", LAYERS, tmp_path_factory.mktemp("mimo"))


@pytest.fixture(scope="module")
def measured(checkpoint) -> dict[str, list[dict]]:
    """layout -> the ranks' results."""
    found = results(ranks.launch(WORKER, json.dumps([[str(checkpoint), layout] for layout in LAYOUTS])))
    out = {r["layout"]: r["ranks"] for r in found}
    for layout, got in out.items():
        keys = ("gap", "mtp_gap", "mtp_gap_to_first_layout", "mtp_gap_unswapped", "grad_norm_rel")
        print(
            f"mimo at {layout}:",
            {k: max(r[k] for r in got if k in r) for k in keys if any(k in r for r in got)},
        )
    return out


def _last_stage(found: list[dict]) -> list[dict]:
    out = [r for r in found if "gap" in r]
    assert out, found
    return out


def test_the_tiny_checkpoint_is_named_as_mimo_7b_rl_and_holds_its_mtp_layer(checkpoint):
    from safetensors import safe_open

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["model_type"] == "mimo" and config["architectures"] == ["MiMoForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["num_attention_heads"] // config["num_key_value_heads"] == 4
    names = {}
    for shard in checkpoint.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            names |= {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.mtp_layers.0.")}
    own = {"token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight"}
    assert own <= {k.removeprefix("model.mtp_layers.0.") for k in names}
    assert names["model.mtp_layers.0.input_proj.weight"].shape == (128, 256)
    assert (
        "model.mtp_layers.0.self_attn.q_proj.bias" in names
        and "model.mtp_layers.0.mlp.up_proj.weight" in names
    )
    norms = [t for k, t in names.items() if k.endswith("norm.weight")]
    assert norms and all(float((t - 1).abs().max()) > 0.01 for t in norms)  # not transformers' ones


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_transformers_qwen2_trunk(measured, layout):
    gaps = [r["gap"] for r in _last_stage(measured[layout])]
    assert max(gaps) <= TOL, f"mimo at {layout}: megatron and transformers' logits differ by {gaps}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_mtp_layer_computes_sglangs_mimo_forward(measured, layout):
    for r in _last_stage(measured[layout]):
        assert r["mtp_gap"] <= TOL, f"mimo at {layout}: MTP logits differ from SGLang's wiring by {r}"
        assert r["mtp_gap_to_first_layout"] <= TOL, r
        assert r["mtp_vs_main"] > 100 * TOL, r  # the MTP layer is not the model's own prediction
        assert r["mtp_gap_unswapped"] > 100 * TOL, r  # input_proj's halves in megatron's order would show


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_trainers_gradient_norm_equals_transformers(measured, layout):
    for r in measured[layout]:
        assert r["grad_norm_rel"] <= GRAD_REL, f"mimo at {layout}: {r}"


def test_hf_to_megatron_to_hf_is_bit_equal_with_input_projs_halves_swapped_in_megatron(checkpoint, tmp_path):
    from miles.ckpt.shards import CheckpointReader
    from miles.ckpt.torch_dist import RELEASE, convert_to_torch_dist
    from miles.families import family, read_config
    from miles.megatron.export import _to_hf
    from tests.e2e.test_train_mtp_speculative import read_torch_dist

    dist = tmp_path / "dist"
    dist.mkdir()
    convert_to_torch_dist(checkpoint, dist, "mimo")
    config = read_config(checkpoint)
    state = {}
    for name, tensor in read_torch_dist(dist / RELEASE).items():  # the decoder's layers saved stacked
        stacked = name.removeprefix("decoder.layers.")
        if stacked == name:
            state[name] = tensor
        else:
            state |= {f"decoder.layers.{i}.{stacked}": tensor[i] for i in range(config["num_hidden_layers"])}
    back = dict(_to_hf(family("mimo").weights(config), state))
    with CheckpointReader(checkpoint) as reader:
        names = sorted(reader.files.weight_map)
        assert sorted(back) == names, sorted(set(back) ^ set(names))
        for name in names:
            assert torch.equal(back[name], reader.read(name)), name
        input_proj = reader.read("model.mtp_layers.0.input_proj.weight")
    token, hidden = input_proj.chunk(2, dim=1)[::-1]  # input_proj takes [hidden; token]
    assert torch.equal(state["mtp.layers.0.eh_proj.weight"], torch.cat([token, hidden], dim=1))
    assert not torch.equal(token, hidden)


def _published(**changes) -> dict:
    from miles.families import family

    return {"model_type": "mimo", "num_hidden_layers": 2, **family("mimo").tiny_dims, **changes}


@pytest.mark.parametrize(
    ("key", "value", "rule"),
    [
        ("num_nextn_predict_layers", -1, "whole number >= 0 (MTP layers)"),
        ("num_nextn_predict_layers", "1", "whole number"),
    ],
)
def test_a_bad_mtp_count_is_refused_naming_the_key_and_the_rule(key, value, rule):
    from miles.families import family
    from miles.families.schema import ConfigRefused

    with pytest.raises(ConfigRefused) as err:
        family("mimo").check_config(_published(**{key: value}))
    assert err.value.key == key and rule in err.value.rule, str(err.value)
    assert str(err.value).startswith(f"{key} = {value!r}: ")


def test_a_config_without_q_k_v_biases_is_refused_by_name():
    from miles.families import UnmappedModel, family

    with pytest.raises(
        UnmappedModel, match="attention_bias=false: MiMo's q, k and v projections have biases"
    ):
        family("mimo").refuse_unmapped(_published(attention_bias=False))
    family("mimo").refuse_unmapped(_published(attention_bias=True))  # MiMo-7B-RL's own value


def test_transformers_loads_the_trunk_as_qwen2_and_never_the_remote_code():
    from miles.families import transformers_config, trunk_config

    config = {**_published(), "architectures": ["MiMoForCausalLM"], "auto_map": {"AutoConfig": "x.Y"}}
    trunk = trunk_config(config)
    assert trunk["model_type"] == "qwen2" and trunk["architectures"] == ["Qwen2ForCausalLM"]
    assert "auto_map" not in trunk and trunk["num_nextn_predict_layers"] == 1
    assert type(transformers_config(config)).__name__ == "Qwen2Config"
