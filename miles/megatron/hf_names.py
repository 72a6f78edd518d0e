"""Where every row of every megatron-core GPT weight comes from in a Hugging Face checkpoint.

`layout(config)` yields (megatron state-dict name, pieces) for the whole model: the embedding,
each decoder layer as its family's mapping places it (`miles.megatron.families`), the final
norm, unless tied the output layer, and what the family adds (carried MTP layers). A piece is a run of HF rows placed at a row of the
megatron tensor: q, k and v become one `linear_qkv` whose rows are grouped per query group
([q heads of the group, k, v] for each group), gate and up become `linear_fc1` ([gate; up]),
and norms fused into a linear take that linear's `layer_norm_weight` name. Conversion reads
the pieces in; the weight export (`miles.megatron.export`) cuts them back out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a Hugging Face tensor, placed at row `at` of a megatron tensor."""

    hf_name: str
    start: int
    stop: int
    at: int


Weights = Iterator[tuple[str, tuple[Piece, ...]]]


def whole(hf_name: str, rows: int, at: int = 0) -> Piece:
    return Piece(hf_name, 0, rows, at)


def qkv_pieces(prefix: str, heads: int, groups: int, dim: int) -> tuple[Piece, ...]:
    """linear_qkv holds, for each query group, its q heads, then its k head, then its v head."""
    q_rows = heads // groups * dim
    block = q_rows + 2 * dim
    pieces = []
    for g in range(groups):
        pieces.append(Piece(prefix + "q_proj.weight", g * q_rows, (g + 1) * q_rows, g * block))
        pieces.append(Piece(prefix + "k_proj.weight", g * dim, (g + 1) * dim, g * block + q_rows))
        pieces.append(Piece(prefix + "v_proj.weight", g * dim, (g + 1) * dim, g * block + q_rows + dim))
    return tuple(pieces)


def gate_up_pieces(prefix: str, rows: int) -> tuple[Piece, ...]:
    """linear_fc1 is [gate; up]: megatron's SwiGLU activates the first half."""
    return (whole(prefix + "gate_proj.weight", rows), whole(prefix + "up_proj.weight", rows, rows))


def dense_mlp(mg: str, hf: str, post_norm: tuple[Piece, ...], width: int, hidden: int) -> Weights:
    """A dense SwiGLU MLP in the TE spec: its norm fused into linear_fc1, [gate; up], then down."""
    yield mg + "mlp.linear_fc1.layer_norm_weight", post_norm
    yield mg + "mlp.linear_fc1.weight", gate_up_pieces(hf + "mlp.", width)
    yield mg + "mlp.linear_fc2.weight", (whole(hf + "mlp.down_proj.weight", hidden),)


def layer_layout(config: Mapping[str, Any], i: int, mg: str) -> Weights:
    """The weights of decoder layer `i` of the HF model, under megatron layer prefix `mg`."""
    from miles.megatron.families import mapping_of

    yield from mapping_of(config).layer_weights(config, i, mg)


def extra_layout(config: Mapping[str, Any]) -> Weights:
    """The weights a family adds outside the decoder layers (its carried MTP layers), if any."""
    from miles.megatron.families import mapping_of

    extra = mapping_of(config).extra_weights
    if extra is not None:
        yield from extra(config)


def layout(config: Mapping[str, Any]) -> Weights:
    """(megatron state-dict name, where each of its rows comes from) for every weight of the
    whole model (one pipeline stage, one expert-parallel rank); a family that lays its whole
    model out itself (its mapping's `weights`) gives them all."""
    from miles.megatron.families import mapping_of

    own = mapping_of(config).weights
    if own is not None:
        yield from own(config)
        return
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    yield "embedding.word_embeddings.weight", (whole("model.embed_tokens.weight", vocab),)
    for i in range(config["num_hidden_layers"]):
        yield from layer_layout(config, i, f"decoder.layers.{i}.")
    yield "decoder.final_layernorm.weight", (whole("model.norm.weight", hidden),)
    if not config.get("tie_word_embeddings"):
        yield "output_layer.weight", (whole("lm_head.weight", vocab),)
    yield from extra_layout(config)
