"""PPO's critic on Megatron: the policy's GPTModel with its vocabulary output layer replaced by a
one-output value head, as the seed framework builds it (radixark/miles 31f1ca961,
miles/backends/megatron_utils/model_provider.py: LinearForLastLayer(hidden, 1) on the last stage).

The head is replicated on every tensor-parallel rank. Under sequence parallelism each rank holds
a slice of the sequence, so the head first gathers it, and the gather's backward hands each rank
the gradient of its own slice (not a sum over the ranks: every rank computed the same values).
The head starts at zero, so the first values are 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.tensor_parallel.layers import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.module import MegatronModule


class ValueHead(MegatronModule):
    """hidden [s, b, h] -> values [s, b, 1], called as GPTModel calls its output layer."""

    def __init__(self, config):
        super().__init__(config)
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)
        self.sequence_parallel = config.sequence_parallel

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return torch.nn.functional.linear(hidden, self.weight.to(hidden.dtype)), None


class NoValueHead(ValueError):
    """The model's last stage has no output layer a value head can replace."""


def attach_value_head(chunks: Sequence, config) -> None:
    """Every chunk that ends the model gets a value head in place of its output layer; none keeps
    its output tied to the embedding (the critic's head is its own)."""
    for chunk in chunks:
        if getattr(chunk, "post_process", False):
            if not hasattr(chunk, "output_layer"):
                raise NoValueHead(
                    f"{type(chunk).__name__} has no output_layer to replace with PPO's value head; the critic "
                    "needs a GPTModel family (or train it with --train-backend fsdp)"
                )
            chunk.output_layer = ValueHead(config)
        if hasattr(chunk, "share_embeddings_and_output_weights"):
            chunk.share_embeddings_and_output_weights = False
