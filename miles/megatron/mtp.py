"""Multi-token prediction (MTP) layers carried by a model that does not train them.

A checkpoint's MTP layers (DeepSeek-V3 style: an embedding norm, a hidden-state norm, the
projection of both, one decoder layer and a final norm) draft tokens for the rollout engine's
speculative decoding. miles keeps them through conversion, training and weight sync, frozen and
outside the forward: transformers' model has no MTP forward to compare with, and megatron-core's
GPTModel, once given MTP layers, returns their loss instead of the logits the trainer needs. So
the block is megatron-core's own `MultiTokenPredictionBlock`, built on the last pipeline stage
and attached under the name GPTModel gives it (`mtp`), which puts its weights at the keys a
Megatron-LM job with --mtp-num-layers saves and loads (`mtp.layers.{k}.*`).
"""

from __future__ import annotations

import copy


def carry_mtp(model, tc, layer_spec, count: int, provider, vp_stage: int | None = None) -> None:
    """Attach `count` frozen MTP layers whose decoder layer is built from `layer_spec` to `model`
    (a GPTModel of the last pipeline stage), with the norms and projection from `provider`."""
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )

    config = copy.copy(tc)
    config.mtp_num_layers = (
        count  # this block's own config: the model's keeps no MTP, so its forward runs none
    )
    layer = get_mtp_layer_spec_for_backend(layer_spec, backend=provider)
    block = MultiTokenPredictionBlock(
        config=config,
        spec=MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * count),
        vp_stage=vp_stage,
    )
    block.requires_grad_(False)
    model.add_module("mtp", block.to(tc.params_dtype))
