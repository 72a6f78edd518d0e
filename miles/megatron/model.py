"""megatron-core GPTModel of a Hugging Face config: this rank's model chunks, and its logits.

`build_model` builds the GPTModel of one pipeline stage (and virtual stage) with the
Transformer Engine layer spec (`miles.megatron.spec`), so its keys are those of a TE job;
`build_chunks` builds one per virtual pipeline stage. `hf_logit_gap` compares a model built
for one process with the HF model it was converted from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from miles.megatron.config import transformer_config
from miles.models.facts import rope_parameters


def build_model(
    config: Mapping[str, Any],
    vocab_size: int | None = None,
    *,
    transformer=None,
    vp_stage: int | None = None,
    impl: str = "local",
):
    """An uninitialised GPTModel of this rank's pipeline stage (and virtual stage), shaped like
    the HF config, with the Transformer Engine layer spec's module tree and keys: TE's own
    modules with `impl` "transformer_engine", the stand-in ones by default (miles.megatron.spec);
    and what the family's mapping adds (its own attention, carried MTP layers). A family whose
    model is not a GPTModel (its mapping's `build_model`) builds its own chunk instead."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from miles.megatron.families import mapping_of
    from miles.megatron.spec import decoder_block_spec

    mapping = mapping_of(config)
    tc = transformer if transformer is not None else transformer_config(config)
    if mapping.build_model is not None:
        return mapping.build_model(tc, config, vocab_size or config["vocab_size"], vp_stage, impl=impl)
    rope = rope_parameters(config)
    interpolation = float(rope["factor"]) if rope.get("rope_type") == "linear" else None
    pp_initialized = parallel_state.model_parallel_is_initialized()
    first = (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        if pp_initialized
        else True
    )
    last = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        if pp_initialized
        else True
    )
    if mapping.block_spec is not None:
        spec = mapping.block_spec(tc, config, vp_stage, impl=impl)
    else:
        spec = decoder_block_spec(tc, impl=impl, vp_stage=vp_stage)
    model = GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=vocab_size or config["vocab_size"],
        max_sequence_length=config.get("max_position_embeddings", 4096),
        pre_process=first,
        post_process=last,
        position_embedding_type=mapping.position_embedding_type,
        rotary_base=rope["rope_theta"],
        seq_len_interpolation_factor=interpolation,
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings")),
        vp_stage=vp_stage,
    )
    model = model.to(tc.params_dtype)
    if mapping.finish_model is not None:
        mapping.finish_model(model, tc, config, vp_stage, impl=impl)
    return model


def build_chunks(config: Mapping[str, Any], tc, vocab_size: int, impl: str = "local") -> list:
    """This rank's model: one GPTModel per virtual pipeline stage (one without VPP)."""
    if not tc.virtual_pipeline_model_parallel_size:
        return [build_model(config, vocab_size, transformer=tc, impl=impl)]
    return [
        build_model(config, vocab_size, transformer=tc, vp_stage=stage, impl=impl)
        for stage in range(tc.virtual_pipeline_model_parallel_size)
    ]


def freeze_padding_embedding(chunks: Sequence, pad_token_id: int | None) -> None:
    """Hugging Face builds the input embedding with padding_idx = pad_token_id: a lookup of that
    token passes no gradient to its row. Megatron's embedding has no such notion, so the same
    is done here with a forward hook, for the trainer to learn what the HF model would."""
    if pad_token_id is None:
        return
    import torch

    def stop_pad_gradient(module, inputs, output):
        pad = inputs[0] == pad_token_id  # [batch, seq]
        if not bool(pad.any()):
            return output
        if module.reduce_scatter_embeddings:  # output is this rank's sequence slice, [seq/tp, batch, h]
            rows = output.shape[0]
            rank = torch.distributed.get_rank(module.tp_group)
            pad = pad.transpose(0, 1)[rank * rows : (rank + 1) * rows]
        return torch.where(pad.unsqueeze(-1), output.detach(), output)

    for chunk in chunks:
        embedding = getattr(chunk, "embedding", None)
        if embedding is not None:
            embedding.word_embeddings.register_forward_hook(stop_pad_gradient)


def probe_tokens(config: Mapping[str, Any], length: int | None = None, seed: int = 0):
    """A fixed [1, length] sequence of ordinary token ids to compare two models on (by default as
    long as the family's mapping asks, `probe_length`)."""
    import torch

    from miles.megatron.families import mapping_of

    length = length or mapping_of(config).probe_length

    vocab = min(int(config["vocab_size"]), 500)
    return torch.randint(3, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def logits(model, tokens, vocab_size: int):
    """Logits [batch, seq, vocab] of a GPTModel built for one process (tensor parallel size 1)."""
    import torch

    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model.eval()(tokens, positions, None)[..., :vocab_size].float()


def hf_class(config: Mapping[str, Any]):
    """transformers' auto class of a checkpoint: its causal LM, else (a multimodal release such as
    Inkling's inkling_mm_model, which the causal-LM mapping does not list) its image-text-to-text
    class, whose text-only forward is the decoder's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def hf_logit_gap(hf_dir, model, config: Mapping[str, Any], device: str = "cpu") -> float:
    """Max |logit difference| between the HF checkpoint in `hf_dir` and a world-of-one megatron
    `model` holding its converted weights, both in float32 on `device`, on `probe_tokens`."""
    import torch
    from transformers.utils import logging as hf_logging

    tokens = probe_tokens(config).to(device)
    shown, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()  # a check inside prepare-ckpt, whose output is one line per step
    hf_logging.set_verbosity_error()  # nor its load report (checkpoint tensors the class has no use for: MTP)
    try:
        hf = hf_class(config).from_pretrained(hf_dir, dtype=torch.float32).to(device)
    finally:
        hf_logging.set_verbosity(verbosity)
        if shown:
            hf_logging.enable_progress_bar()
    with torch.no_grad():
        want = hf.eval()(input_ids=tokens).logits.float()
    got = logits(model, tokens, config["vocab_size"])
    return float((want - got).abs().max())
