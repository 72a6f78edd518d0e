"""Multi-token prediction (MTP) layers carried by a model that does not train them.

A checkpoint's MTP layers (DeepSeek-V3 style: an embedding norm, a hidden-state norm, the
projection of both, one decoder layer and a final norm) draft tokens for the rollout engine's
speculative decoding. miles keeps them through conversion, training and weight sync, frozen and
outside the forward: transformers' model has no MTP forward to compare with, and megatron-core's
GPTModel, once given MTP layers, returns their loss instead of the logits the trainer needs. So
the block is megatron-core's own `MultiTokenPredictionBlock`, built on the last pipeline stage
and attached under the name GPTModel gives it (`mtp`), which puts its weights at the keys a
Megatron-LM job with --mtp-num-layers saves and loads (`mtp.layers.{k}.*`).

Trained (`train_mtp`) on the last of several pipeline stages, the block reads the first stage's
word embedding: that stage sends it over megatron-core's embedding group before each training
step (`share_word_embedding`) into a copy the last stage holds outside its parameters.
"""

from __future__ import annotations

import copy


def carry_mtp(
    model,
    tc,
    count: int,
    impl: str,
    vp_stage: int | None = None,
    *,
    masks_first_position: bool = False,
) -> None:
    """Attach `count` frozen MTP layers to `model` when it is a GPTModel chunk of the last pipeline
    stage (nothing otherwise): each decoder layer built like the chunk's last one, the norms and
    projection from the `impl` modules' provider; with `masks_first_position` the layers read a zero
    embedding at position 0 (MiMo's, `block_embedding`)."""
    if not count or not model.post_process:
        return
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )

    from miles.megatron.spec import layer_provider

    config = copy.copy(tc)
    config.mtp_num_layers = (
        count  # this block's own config: the model's keeps no MTP, so its forward runs none
    )
    layer_spec = model.decoder.submodules.layer_specs[-1]
    layer = get_mtp_layer_spec_for_backend(layer_spec, backend=layer_provider(impl))
    block = MultiTokenPredictionBlock(
        config=config,
        spec=MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * count),
        vp_stage=vp_stage,
    )
    block.requires_grad_(False)
    block.masks_first_position = masks_first_position
    model.add_module("mtp", block.to(tc.params_dtype))


def block_embedding(block, word_embedding, position_ids, *, detach: bool = False):
    """The embedding callable megatron-core's MTP block reads the next tokens' embeddings through:
    `word_embedding`'s ([s, b, h], this rank's part of the sequence under sequence parallelism), zero
    where the position the block's hidden state comes from (`position_ids` [b, s], before the block
    rolls them) is 0 when the block masks the first position (MiMo's MTP layer, as SGLang runs it)."""

    first_positions = position_ids

    def embedding(input_ids, position_ids):  # megatron-core's rolled ids and positions
        out = word_embedding(input_ids=input_ids, position_ids=position_ids)
        out = out.detach() if detach else out
        if getattr(block, "masks_first_position", False):
            keep = (first_positions != 0).transpose(0, 1).unsqueeze(-1).to(out.dtype)
            if block.config.sequence_parallel:
                from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

                keep = scatter_to_sequence_parallel_region(keep)
            out = out * keep
        return out

    return embedding


class MtpRefused(ValueError):
    """--enable-mtp-training where the model or layout cannot train the MTP layers; says why."""


def train_mtp(model) -> None:
    """Train the MTP block carried by `model` (a last-stage GPTModel): in a training forward the
    model returns (logits, [each MTP layer's logits]) instead of the logits alone.

    megatron-core's block runs as GPTModel runs it (the decoder's normed output and the next
    token's embedding in, its layers chained), but its loss is the trainer's to weigh and its
    gradient reaches the MTP parameters alone: the trunk's hidden states, the embedding and the
    shared output layer enter it detached, so the policy's update is the RL loss's only.
    GPTModel's own MTP path is not used: given labels it returns the loss instead of the logits
    the RL loss needs.
    """
    own = getattr(model, "train_mtp", None)
    if own is not None:  # a model of miles' own runs its MTP layers itself (DeepSeek-V4's)
        own()
        return
    block = getattr(model, "mtp", None)
    if block is None:
        raise MtpRefused("this model chunk carries no MTP layers")
    block.requires_grad_(True)
    if not model.pre_process:
        _give_word_embedding(model)
    original = model._postprocess

    def postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                    rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None,
                    attention_mask=None, inference_params=None, packed_seq_params=None,
                    sequence_len_offset=None, runtime_gather_output=None, extra_block_kwargs=None,
                    inference_context=None):  # fmt: skip
        logits = original(
            hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
            mtp_in_postprocess=False, loss_mask=loss_mask, decoder_input=decoder_input,
            attention_mask=attention_mask, inference_params=inference_params, packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset, runtime_gather_output=runtime_gather_output,
            extra_block_kwargs=extra_block_kwargs, inference_context=inference_context,
        )  # fmt: skip
        if not model.training:
            return logits
        return logits, mtp_logits(
            model, hidden_states, input_ids, position_ids, attention_mask, rotary_pos_emb, rotary_pos_cos,
            rotary_pos_sin, packed_seq_params, sequence_len_offset, runtime_gather_output, extra_block_kwargs,
        )  # fmt: skip

    model._postprocess = postprocess


def mtp_logits(model, hidden_states, input_ids, position_ids, attention_mask, rotary_pos_emb, rotary_pos_cos,
               rotary_pos_sin, packed_seq_params, sequence_len_offset, runtime_gather_output,
               extra_block_kwargs) -> list:  # fmt: skip
    """Each MTP layer's logits [rows, S, V/tp]: layer j at position i predicts token i + 2 + j."""
    block = model.mtp
    word_embedding = model.embedding if model.pre_process else model._mtp_embedding
    embedding = block_embedding(block, word_embedding, position_ids, detach=True)
    out = block(
        input_ids=input_ids,
        position_ids=position_ids,
        hidden_states=hidden_states.detach(),
        attention_mask=attention_mask,
        rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos,
        rotary_pos_sin=rotary_pos_sin,
        packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset,
        extra_block_kwargs=extra_block_kwargs,
        embedding=embedding,
    )
    layers = out.chunk(1 + len(block.layers), dim=0)[1:]
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
    return [
        model.output_layer(h, weight=weight.detach(), runtime_gather_output=runtime_gather_output)[0]
        .transpose(0, 1)
        .contiguous()
        for h in layers
    ]


def mtp_targets(tokens, loss_mask, width: int, depth: int):
    """(targets [rows, S], mask [rows, width - 1]) of MTP layer `depth`: the token 2 + depth
    positions ahead (0 past the end) and whether it is a response token (the loss mask, which
    marks the token one ahead, moved `1 + depth` positions)."""
    import torch

    shift = 2 + depth
    targets = torch.cat([tokens[:, shift:], torch.zeros_like(tokens[:, :shift])], dim=1)
    mask = torch.zeros_like(loss_mask)
    mask[:, : max(0, width - 1 - (shift - 1))] = loss_mask[:, shift - 1 :]
    return targets, mask


def _give_word_embedding(model) -> None:
    """A last pipeline stage's own copy of the word embedding for its MTP block (megatron-core builds
    one there when GPTModel has MTP layers; the carried block has none). It is no parameter of the
    model (not saved, not exported, not trained: the MTP block reads the embedding detached);
    `share_word_embedding` fills it from the first stage."""
    import copy

    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    config = copy.copy(model.config)
    config.perform_initialization = False  # filled from the first stage: draw nothing from the RNG
    embedding = LanguageModelEmbedding(
        config=config,
        vocab_size=model.vocab_size,
        max_sequence_length=model.max_sequence_length,
        position_embedding_type=model.position_embedding_type,
        tp_group=model.pg_collection.tp,
    )
    embedding.requires_grad_(False)
    object.__setattr__(model, "_mtp_embedding", embedding)  # not a submodule: outside the state dict


def share_word_embedding(chunks) -> None:
    """The first pipeline stage's word embedding, sent to the last stage's MTP block (over
    megatron-core's embedding group, each tensor-parallel rank its own vocabulary rows). Every
    rank calls it; a stage that is neither first nor last, and a model without pipeline
    parallelism, has nothing to do."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not ps.is_rank_in_embedding_group(
        ignore_virtual=True
    ):
        return
    if ps.is_pipeline_first_stage(ignore_virtual=True):
        weight = chunks[0].embedding.word_embeddings.weight.data
    else:
        copy_ = chunks[-1]._mtp_embedding
        own = next(chunks[-1].mtp.parameters())
        copy_.to(device=own.device)
        weight = copy_.word_embeddings.weight.data
    dist.broadcast(weight, src=ps.get_pipeline_model_parallel_first_rank(), group=ps.get_embedding_group())
