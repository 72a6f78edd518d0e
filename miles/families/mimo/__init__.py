"""MiMo (MiMo-7B-RL; model_type mimo, the release's remote-code MiMoForCausalLM) as megatron-core GPTModel.

MiMo's decoder is Qwen2's (q/k/v biases, no q/k norms, SwiGLU, RMSNorm; MiMo-7B: untied embeddings,
GQA 32:8, rope theta 640000, eps 1e-5), so its trunk is the qwen2 family's mapping and transformers
loads it as Qwen2ForCausalLM (transformers has no MiMo class; `trunk_model_type`). Beside it the
checkpoint holds `num_nextn_predict_layers` MTP layers, `model.mtp_layers.{k}.*`: token_layernorm,
hidden_layernorm, input_proj (2h -> h, no bias), a Qwen2 decoder layer's own tensors directly under
the prefix, and final_layernorm. The layer's math (SGLang's mimo_mtp.py, MiMoMultiTokenPredictorLayer
.forward, sgl-project/sglang 87d624054f8aa6c610438f96e1395371d8061c08):

    e = embed(t_{i+1}), zeroed at position 0
    x = input_proj([hidden_layernorm(h_i); token_layernorm(e)])
    y = final_layernorm(decoder_layer(x))       (the layer's residual included)

which is megatron-core's MTP layer (DeepSeek-V3's formula) with eh_proj's column halves swapped:
megatron concatenates [embedding; hidden]. The MTP block is carried as megatron-core's
`mtp.layers.{k}.{enorm [token_layernorm], hnorm [hidden_layernorm], eh_proj [input_proj, halves
swapped], final_layernorm, transformer_layer.* [the decoder layer]}` (miles.megatron.mtp), built
like the last decoder layer, and its embedding input is zeroed at position 0 as SGLang's forward
does (`mtp_masks_first_position`). The seed framework's mapping (radixark/miles 31f1ca961,
miles_plugins/mbridge/mimo.py and megatron_to_hf/mimo.py) names the same tensors and swaps the
same halves; its Megatron arguments for MiMo-7B-RL are scripts/models/mimo-7B-rl.py's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from miles.families.facts import MTP
from miles.families.family import UnmappedModel
from miles.families.qwen2 import Qwen2
from miles.families.schema import QWEN_SCHEMA, Int
from miles.families.weights import Weights, swapped_halves, whole

RELEASE_CLASS = "MiMoForCausalLM"
# what MiMo-7B-RL's config.json names for AutoConfig and AutoModelForCausalLM (remote code, which
# miles never runs: its trunk loads as Qwen2ForCausalLM)
AUTO_MAP = {
    "AutoConfig": "configuration_mimo.MiMoConfig",
    "AutoModel": "modeling_mimo.MiMoModel",
    "AutoModelForCausalLM": "modeling_mimo.MiMoForCausalLM",
}


def mtp_layers(config: Mapping[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


class MiMo(Qwen2):
    name = "mimo"
    model_types = ("mimo",)
    keys = (*Qwen2.keys, *MTP)
    schema = (*QWEN_SCHEMA, Int("num_nextn_predict_layers", 0, required=False, why="MTP layers"))
    tiny_model_type = "qwen2"  # transformers' class the tiny trunk is saved from
    trunk_model_type = "qwen2"
    release_architectures = (RELEASE_CLASS,)
    # MiMo-7B-RL's switches at tiny sizes: untied embeddings, 4 query heads per KV head (32:8), rope
    # theta 640000, rms eps 1e-5, no sliding window, one MTP layer
    tiny_dims = {
        "vocab_size": 512, "hidden_size": 128, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 384, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "rope_theta": 640_000, "rms_norm_eps": 1e-5, "use_sliding_window": False, "num_nextn_predict_layers": 1,
    }  # fmt: skip
    mtp_style = "mimo"
    mtp_masks_first_position = True
    # the MTP layer's projection stays bf16 (SGLang's MiMo MTP builds it as a plain nn.Linear)
    fp8_keep = frozenset({"input_proj"})

    def refuse_unmapped(self, config: Mapping[str, Any]) -> None:
        super().refuse_unmapped(config)
        if config.get("attention_bias") is False:
            raise UnmappedModel(
                "config.json attention_bias=false: MiMo's q, k and v projections have biases (its trunk is "
                "transformers' Qwen2ForCausalLM, which always builds them); remove the key"
            )

    def trunk_config(self, config: Mapping[str, Any]) -> dict:
        """config.json as transformers' Qwen2ForCausalLM reads the trunk (its MTP layers are no part
        of that class): model_type qwen2, no remote code."""
        out = {k: v for k, v in config.items() if k not in ("auto_map", "architectures")}
        return {**out, "model_type": self.trunk_model_type, "architectures": ["Qwen2ForCausalLM"]}

    def release_config(self, config: Mapping[str, Any]) -> dict:
        """A tiny checkpoint's config.json as MiMo-7B-RL's names its model: model_type mimo, the
        remote-code class and its auto_map."""
        return {**config, "model_type": "mimo", "architectures": [RELEASE_CLASS], "auto_map": dict(AUTO_MAP)}

    def lm_args(self, config: Mapping[str, Any]) -> dict:
        return {"mtp_num_layers": mtp_layers(config) or None}

    def extra_weights(self, config: Mapping[str, Any]) -> Weights:
        hidden = int(config["hidden_size"])
        for k in range(mtp_layers(config)):
            hf, mg = f"model.mtp_layers.{k}.", f"mtp.layers.{k}."
            yield mg + "enorm.weight", (whole(hf + "token_layernorm.weight", hidden),)
            yield mg + "hnorm.weight", (whole(hf + "hidden_layernorm.weight", hidden),)
            # input_proj takes [hidden; token], megatron's eh_proj [embedding; hidden]
            yield mg + "eh_proj.weight", swapped_halves(hf + "input_proj.weight", hidden)
            yield mg + "final_layernorm.weight", (whole(hf + "final_layernorm.weight", hidden),)
            yield from self.layer_weights(config, -1, mg + "transformer_layer.", hf=hf)

    def mtp_extras(self, prefix: str, config: Mapping[str, Any], hidden: int) -> Iterator[tuple]:
        """The MTP layer's projection of [hidden state; embedding] and its three norms."""
        yield prefix + "input_proj.weight", (hidden, 2 * hidden), "model"
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            yield f"{prefix}{norm}.weight", (hidden,), "norm"

    def tiny_mtp_values(self, tensors: dict, gen) -> None:
        """The MTP layers' norms and biases seeded away from 1 and 0, as `tiny_values` seeds the trunk's."""
        import torch

        for name in sorted(tensors):
            if name.endswith("norm.weight") or name.endswith("proj.bias"):
                tensors[name] = (tensors[name] + torch.randn(tensors[name].shape, generator=gen) * 0.2).to(
                    tensors[name].dtype
                )

    def finish_model(
        self, model, tc, config: Mapping[str, Any], vp_stage: int | None = None, *, impl: str = "local"
    ) -> None:
        """On the last stage, carry the MTP layers (built like the last decoder layer)."""
        from miles.megatron.mtp import carry_mtp

        carry_mtp(
            model, tc, mtp_layers(config), impl, vp_stage, masks_first_position=self.mtp_masks_first_position
        )


FAMILY = MiMo()
