"""The megatron-core model of a Hugging Face config: this rank's model chunks, and its logits.

`build_model` builds the model of one pipeline stage (and virtual stage) as its family builds
it (a GPTModel with the Transformer Engine layer spec's keys, or the family's own model);
`build_chunks` builds one per virtual pipeline stage; `load_model` builds a world-of-one model
holding a converted torch_dist release. `hf_logit_gap` compares a model built for one process
with the HF model it was converted from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from miles.families.transformer import transformer_config


def build_model(
    config: Mapping[str, Any],
    vocab_size: int | None = None,
    *,
    transformer=None,
    vp_stage: int | None = None,
    impl: str = "local",
):
    """An uninitialised model of this rank's pipeline stage (and virtual stage), shaped like the
    HF config, as its family builds it: a GPTModel with the Transformer Engine layer spec's module
    tree and keys (TE's own modules with `impl` "transformer_engine", the stand-in ones by
    default: miles.megatron.spec) and what the family adds, or the family's own model."""
    from miles.families import megatron_family

    tc = transformer if transformer is not None else transformer_config(config)
    return megatron_family(config).build_model(
        tc, config, vocab_size or config["vocab_size"], vp_stage, impl=impl
    )


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
    long as the family asks, `probe_length`)."""
    import torch

    from miles.families import megatron_family

    length = length or megatron_family(config).probe_length

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

    from miles.families import trunk_loads

    if config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or trunk_loads(config):
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
        from miles.families import transformers_config, trunk_loads

        given = {"config": transformers_config(config)} if trunk_loads(config) else {}
        hf = hf_class(config).from_pretrained(hf_dir, dtype=torch.float32, **given).to(device)
    finally:
        hf_logging.set_verbosity(verbosity)
        if shown:
            hf_logging.enable_progress_bar()
    with torch.no_grad():
        want = hf.eval()(input_ids=tokens).logits.float()
    got = logits(model, tokens, config["vocab_size"])
    return float((want - got).abs().max())


def load_model(
    config: Mapping[str, Any], release: Path, vocab: int | None = None, *, dtype=None, on_cpu=True
):
    """A world-of-one model of `config` holding the weights of a converted `release` (inside
    miles.megatron.checkpoint.single_process_group()); its RNG streams are seeded in a forked
    RNG state."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from miles.megatron.checkpoint import SHARDED_METADATA

    with torch.random.fork_rng(devices=[]):  # megatron's attention forks its RNG streams
        model_parallel_cuda_manual_seed(0)
        tc = transformer_config(config, dtype=dtype, on_cpu=on_cpu)
        model = build_model(config, vocab, transformer=tc)
    state = dist_checkpointing.load(model.sharded_state_dict(metadata=dict(SHARDED_METADATA)), str(release))
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    return model
