"""LoRA's merge: the engine's weights are W + (alpha / r) B A, as peft's own merge makes them."""

from __future__ import annotations

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.train.args import parse_config
from miles.train.lora import is_adapter, merged, wrap

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


@pytest.mark.parametrize(("targets", "adapted"), [(None, 7), ("q_proj,down_proj", 2)])
def test_merged_weights_are_the_base_plus_the_scaled_adapters_as_peft_merges_them(targets, adapted):
    argv = ["--hf-checkpoint", "m", "--lora-rank", "4", "--lora-alpha", "8"]
    settings = parse_config(argv + (["--target-modules", targets] if targets else [])).lora
    model = wrap(_model(), settings, "m")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_()  # B starts at zero; give the adapters something to add
    base = model.get_base_model()
    ours = dict(merged(base.state_dict().items(), settings.scaling))
    layers = {k.split(".lora_A.")[0] for k in base.state_dict() if ".lora_A." in k}
    assert len(layers) == adapted * 2  # per decoder layer
    for module in layers:
        w = base.get_submodule(module).base_layer.weight
        a, b = (
            base.get_submodule(module).lora_A["default"].weight,
            base.get_submodule(module).lora_B["default"].weight,
        )
        assert torch.equal(ours[f"{module}.weight"], w + (b @ a) * 2.0)
    peft_merged = model.merge_and_unload().state_dict()
    assert ours.keys() == peft_merged.keys()
    for name, tensor in peft_merged.items():
        assert torch.allclose(ours[name], tensor, rtol=1e-6, atol=1e-7), name
    assert not any(is_adapter(n) for n in ours)


def test_lora_shape_flags_without_a_rank_are_refused(capsys):
    with pytest.raises(SystemExit):
        parse_config(["--hf-checkpoint", "m", "--lora-alpha", "32"])
    assert "--lora-alpha shape LoRA adapters, but --lora-rank is 0" in capsys.readouterr().err
