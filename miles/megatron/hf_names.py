"""Where every row of every megatron-core GPT weight comes from in a Hugging Face checkpoint.

`layout(config)` yields (megatron state-dict name, pieces) for the whole model: the embedding,
each decoder layer as its family's mapping places it (`miles.megatron.families`), the final
norm, unless tied the output layer, and what the family adds (carried MTP layers). A piece is a run of HF rows placed at a row of the
megatron tensor: q, k and v become one `linear_qkv` whose rows are grouped per query group
([q heads of the group, k, v] for each group), gate and up become `linear_fc1` ([gate; up]),
and norms fused into a linear take that linear's `layer_norm_weight` name; one expert of a
stacked HF expert tensor is a piece of that tensor's sub-tensor; interleaved gate/up rows are
two pieces of step 2. The embedding, final norm and head have the family's names for them
(`outer_names`). Conversion reads
the pieces in; the weight export (`miles.megatron.export`) cuts them back out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a Hugging Face tensor, every `step`-th one, placed one after
    another from row `at` of a megatron tensor; with `index`, rows of sub-tensor `index` of a
    stacked one (transformers' fused experts [experts, rows, ...]). A step of 2 reads one half of
    row-interleaved [gate, up] pairs (Inkling's release checkpoint)."""

    hf_name: str
    start: int
    stop: int
    at: int
    index: int | None = None
    step: int = 1

    @property
    def rows(self) -> int:
        """How many megatron rows the piece fills."""
        return len(range(self.start, self.stop, self.step))

    @property
    def hf_rows(self) -> slice:
        return slice(self.start, self.stop, self.step)


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


def embedding_layout(config: Mapping[str, Any]) -> Weights:
    """The first stage's weights a family adds beyond the word embedding (an embedding norm), if any."""
    from miles.megatron.families import mapping_of

    extra = mapping_of(config).embedding_weights
    if extra is not None:
        yield from extra(config)


OUTER_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


def outer_names(config: Mapping[str, Any]) -> tuple[str, str, str]:
    """The checkpoint's names of the word embedding, the final norm and the output layer."""
    from miles.megatron.families import mapping_of

    names = mapping_of(config).outer_names
    return OUTER_NAMES if names is None else names(config)


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
    embed, norm, head = outer_names(config)
    yield "embedding.word_embeddings.weight", (whole(embed, vocab),)
    yield from embedding_layout(config)
    for i in range(config["num_hidden_layers"]):
        yield from layer_layout(config, i, f"decoder.layers.{i}.")
    yield "decoder.final_layernorm.weight", (whole(norm, hidden),)
    if not config.get("tie_word_embeddings"):
        yield "output_layer.weight", (whole(head, vocab),)
    yield from extra_layout(config)
