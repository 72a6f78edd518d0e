"""Building blocks a family's own megatron-core modules share.

`DuplicatedLinear` is a linear every tensor-parallel rank holds whole (what Transformer
Engine's TELinear with parallel_mode "duplicated" builds, under the same parameter name), for
down-projections whose outputs every rank needs. `check_chunk_start` refuses a model chunk
(pipeline or virtual stage) whose first layer reads state another chunk's layer leaves (GLM-5.2's
shared DSA layers reuse the top-k of the nearest full layer below), on megatron-core's own
layer offsets; the layout proof (miles.megatron.ranks) runs the same check.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.module import MegatronModule

FULL, SHARED = "full", "shared"


class StageStartsOnSharedLayer(ValueError):
    """A model chunk's first layer reuses the top-k of a layer another chunk holds."""


class DuplicatedLinear(MegatronModule):
    """A linear layer every tensor-parallel rank holds whole (TELinear with parallel_mode
    "duplicated" has the same parameter name, `weight`); returns (output, None) like megatron's."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method=None):
        super().__init__(config=config)
        self.weight = torch.nn.Parameter(torch.zeros(output_size, input_size, dtype=config.params_dtype))
        if config.perform_initialization and init_method is not None:
            init_method(self.weight)

    def forward(self, x: torch.Tensor):
        return F.linear(x, self.weight), None


def check_chunk_start(
    tc, kinds: Sequence[str], vp_stage: int | None = None, pp_rank: int | None = None
) -> None:
    """Refuse a model chunk whose first layer is a shared DSA layer (its source is in another chunk)."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    first = get_transformer_layer_offset(tc, vp_stage=vp_stage, pp_rank=pp_rank)
    if first < len(kinds) and first < tc.num_layers and kinds[first] == SHARED:
        stage = "pipeline stage" if vp_stage is None else f"virtual stage {vp_stage} of a pipeline stage"
        shared = ", ".join(str(i) for i, k in enumerate(kinds[: tc.num_layers]) if k == SHARED)
        raise StageStartsOnSharedLayer(
            f"a {stage} starts at layer {first}, which reuses the DSA top-k of an earlier layer "
            f"(cross-layer index sharing) held by another stage; every stage must start on a layer that "
            f"runs its own indexer (shared layers: {shared}): change --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers or the virtual stages (python -m miles.parallel check names one)"
        )
