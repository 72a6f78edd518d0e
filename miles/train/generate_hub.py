"""Generate functions for --custom-generate-function-path (see miles.train.generate)."""

from __future__ import annotations

from miles.train.generate import GenerateContext, Piece
from miles.train.rollout import Generation


def compact_split(context: GenerateContext, prompts: list[list[int]]) -> list[list[Piece]]:
    """Each execution as two training samples of one rollout (the seed framework's compact
    rollout fixture, radixark/miles 31f1ca961 tests/manual/compact_split_generate.py): the first
    half of the response on its own, then the whole response trained on its second half only.
    A response shorter than 2 tokens, or one the engine did not finish, stays whole."""
    out = []
    for g in context.generate(prompts):
        n = len(g.response_ids)
        if n < 2 or g.finish_reason not in ("stop", "length"):
            out.append([Piece(g)])
            continue
        cut = n // 2
        first = Generation(g.prompt_ids, g.response_ids[:cut], g.logprobs[:cut], "length")
        out.append([Piece(first), Piece(g, (0,) * cut + (1,) * (n - cut))])
    return out
