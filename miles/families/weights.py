"""A family's weight mapping as data: where every row of every megatron weight comes from.

A family's `weights(config)` (miles.families.family) yields (megatron state-dict name, pieces)
for the whole model. A piece is a run of Hugging Face rows placed at a row of the megatron
tensor, and the few shapes a mapping is written in are the functions here: q, k and v become
one `linear_qkv` whose rows are grouped per query group ([q heads of the group, k, v] for each
group: `qkv_pieces`), gate and up become `linear_fc1` ([gate; up]: `gate_up_pieces`), norms fused
into a linear take that linear's `layer_norm_weight` name (`dense_mlp`); one expert of a stacked
HF expert tensor is a piece of that tensor's sub-tensor (`index`); interleaved gate/up rows are
two pieces of step 2; a weight whose column blocks are ordered otherwise (MiMo's MTP input_proj takes
[hidden; token] where megatron's eh_proj takes [embedding; hidden]) is pieces of `dim` 1. Conversion
reads the pieces in (miles.ckpt.torch_dist); the weight export (miles.megatron.export) cuts them back
out. Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of a Hugging Face tensor, every `step`-th one, placed one after
    another from row `at` of a megatron tensor; with `index`, rows of sub-tensor `index` of a
    stacked one (transformers' fused experts [experts, rows, ...]). A step of 2 reads one half of
    row-interleaved [gate, up] pairs (Inkling's release checkpoint). With `dim` 1 the "rows" are
    columns: columns [start, stop) of every row, placed from column `at`."""

    hf_name: str
    start: int
    stop: int
    at: int
    index: int | None = None
    step: int = 1
    dim: int = 0

    @property
    def rows(self) -> int:
        """How many megatron rows the piece fills."""
        return len(range(self.start, self.stop, self.step))

    @property
    def hf_rows(self) -> slice:
        return slice(self.start, self.stop, self.step)

    @property
    def hf_index(self) -> tuple:
        """The index of the piece's part of its HF tensor (of sub-tensor `index`, if any)."""
        return (slice(None),) * self.dim + (self.hf_rows,)

    def of_megatron(self, tensor):
        """The part of the megatron tensor the piece fills (a view)."""
        return tensor.narrow(self.dim, self.at, self.rows)


def swapped_halves(hf_name: str, width: int) -> tuple[Piece, Piece]:
    """A [rows, 2 x width] megatron weight whose two column blocks are the HF tensor's, swapped."""
    return Piece(hf_name, width, 2 * width, 0, dim=1), Piece(hf_name, 0, width, width, dim=1)


Weights = Iterator[tuple[str, tuple[Piece, ...]]]


def whole(hf_name: str, rows: int, at: int = 0) -> Piece:
    return Piece(hf_name, 0, rows, at)


def qkv_pieces(prefix: str, heads: int, groups: int, dim: int, leaf: str = "weight") -> tuple[Piece, ...]:
    """linear_qkv holds, for each query group, its q heads, then its k head, then its v head (the
    weights' rows, or with `leaf` "bias" the biases' entries)."""
    q_rows = heads // groups * dim
    block = q_rows + 2 * dim
    pieces = []
    for g in range(groups):
        pieces.append(Piece(f"{prefix}q_proj.{leaf}", g * q_rows, (g + 1) * q_rows, g * block))
        pieces.append(Piece(f"{prefix}k_proj.{leaf}", g * dim, (g + 1) * dim, g * block + q_rows))
        pieces.append(Piece(f"{prefix}v_proj.{leaf}", g * dim, (g + 1) * dim, g * block + q_rows + dim))
    return tuple(pieces)


def gate_up_pieces(prefix: str, rows: int) -> tuple[Piece, ...]:
    """linear_fc1 is [gate; up]: megatron's SwiGLU activates the first half."""
    return (whole(prefix + "gate_proj.weight", rows), whole(prefix + "up_proj.weight", rows, rows))


def dense_mlp(mg: str, hf: str, post_norm: tuple[Piece, ...], width: int, hidden: int) -> Weights:
    """A dense SwiGLU MLP in the TE spec: its norm fused into linear_fc1, [gate; up], then down."""
    yield mg + "mlp.linear_fc1.layer_norm_weight", post_norm
    yield mg + "mlp.linear_fc1.weight", gate_up_pieces(hf + "mlp.", width)
    yield mg + "mlp.linear_fc2.weight", (whole(hf + "mlp.down_proj.weight", hidden),)


# The checkpoint's names of the word embedding, the final norm and the output layer, unless the
# family names them otherwise (Family.outer_names).
OUTER_NAMES = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
