"""Custom generate functions (--custom-generate-function-path): how prompts become training samples.

The default turns each request into one sample. A custom function gets the batch of requests
(token ids, each prompt's --n-samples-per-prompt copies in a row) and a `GenerateContext`
(the engine, the run's sampling settings and seed, the tokenizer) and returns, for each
request, the pieces its execution is trained as: usually one; a function may split an
execution into several (the seed framework's compact rollout, radixark/miles 31f1ca961
tests/manual/compact_split_generate.py), each piece with its own loss mask over its response
tokens. Pieces of one execution are siblings: they share its reward and advantage, stay in one
optimizer step (--global-batch-size counts executions), and weigh 1/siblings in the loss, so an
execution counts once however it is split. `module.func` or `module:func`; see
miles.train.generate_hub for the compact split.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from miles.train.config import SamplingConfig
from miles.train.rollout import Generation


@dataclass(frozen=True)
class Piece:
    """One training sample of an execution."""

    generation: Generation
    loss_mask: tuple[int, ...] | None = None  # one 0/1 per response token; None: train on all


@dataclass(frozen=True)
class GenerateContext:
    engine: object  # the run's RolloutEngine
    sampling: SamplingConfig
    seed: int
    tokenizer: object

    def generate(self, prompts: Sequence[Sequence[int]]) -> list[Generation]:
        return self.engine.generate(prompts, self.sampling, seed=self.seed)


GenerateFn = Callable[[GenerateContext, list[list[int]]], list[list[Piece]]]


def single_turn(context: GenerateContext, prompts: list[list[int]]) -> list[list[Piece]]:
    """The default: one sampled response per request, trained whole."""
    return [[Piece(g)] for g in context.generate(prompts)]


class GenerateFunctionError(ValueError):
    """--custom-generate-function-path names nothing callable, or it returned the wrong shape."""

    same_on_every_rank = True


def load_generate(path: str | None) -> GenerateFn:
    if not path:
        return single_turn
    module, sep, name = path.partition(":")
    if not sep:
        module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise GenerateFunctionError(
            f"--custom-generate-function-path {path}: cannot import it ({exc}); give module.func or module:func"
        ) from None
    if not callable(fn):
        raise GenerateFunctionError(f"--custom-generate-function-path {path} is not callable")
    return fn


def checked(path: str, prompts: list[list[int]], result) -> list[list[Piece]]:
    """The function's answer, or one line saying how it is not one list of pieces per request."""
    where = f"--custom-generate-function-path {path or 'single_turn'}"
    if not isinstance(result, list) or len(result) != len(prompts):
        raise GenerateFunctionError(
            f"{where} returned {type(result).__name__}, not a list of {len(prompts)} lists"
        )
    for i, pieces in enumerate(result):
        if not pieces or not all(isinstance(p, Piece) for p in pieces):
            raise GenerateFunctionError(
                f"{where}: request {i} got no Piece list (at least one piece per request)"
            )
        for p in pieces:
            if p.loss_mask is not None and len(p.loss_mask) != len(p.generation.response_ids):
                raise GenerateFunctionError(
                    f"{where}: request {i}: a loss mask of {len(p.loss_mask)} for {len(p.generation.response_ids)} "
                    "response tokens"
                )
    return result
