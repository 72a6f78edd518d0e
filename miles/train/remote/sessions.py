"""Multi-turn sessions on the built-in engine server, with SGLang's API (sglang 0.5.23,
srt/session/session_controller.py): `/open_session` names a session, and a `/generate` whose
`session_params` are `{"id": session, "rid": earlier request}` continues that request: its
context is the earlier request's input and output tokens followed by the new input (a leading
BOS of the new input dropped), whatever role the new messages have. A request without `rid`
starts a new branch from its own input. `replace`, `offset` and `drop_previous_output`, which
rewrite history, are refused here.

What SGLang's radix cache does for a session's prefix, the server does by keeping the KV cache
of a session's latest turn: the next turn that continues it feeds only the tokens the cache
does not hold (the previous turn's last output token and the new input), and its output
reports them as `cached_tokens`; the server counts prefilled tokens (`/get_server_info`). A
weight load drops every cache (they were computed with the old weights): the next turn
prefills its whole context, as SGLang's flush after an update makes it.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

from miles.train.config import SamplingConfig
from miles.train.rollout import Generation, sample_tokens


class SessionRefused(Exception):
    """A session request the engine answers with success false."""


@dataclass
class Turn:
    rid: str
    tokens: list[int]  # the context the next turn continues: its input and output
    cache: object | None = None  # KV of tokens[:cached]; only a session's latest turn keeps one
    cached: int = 0


class Sessions:
    def __init__(self):
        self._sessions: dict[str, dict[str, Turn]] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str | None) -> str:
        session_id = session_id or uuid.uuid4().hex
        with self._lock:
            if session_id in self._sessions:
                raise SessionRefused(f"session {session_id} is already open")
            self._sessions[session_id] = {}
        return session_id

    def close(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def flush(self) -> None:
        """Drop every kept cache (the weights changed)."""
        with self._lock:
            for turns in self._sessions.values():
                for turn in turns.values():
                    turn.cache, turn.cached = None, 0

    def start(self, params: dict, input_ids: list[int], bos: int | None) -> tuple[list[int], object, int]:
        """The context of a session request, and the cache (and its length) it may reuse."""
        for rewrite in ("replace", "offset", "drop_previous_output"):
            if params.get(rewrite):
                raise SessionRefused(f"session_params.{rewrite} is not supported by this engine")
        with self._lock:
            turns = self._sessions.get(params.get("id"))
            if turns is None:
                raise SessionRefused(f"session {params.get('id')} is not open")
            parent_rid = params.get("rid")
            if parent_rid is None:
                return list(input_ids), None, 0
            parent = turns.get(parent_rid)
            if parent is None:
                raise SessionRefused("Invalid request session id")
            if input_ids and bos is not None and input_ids[0] == bos:
                input_ids = input_ids[1:]
            cache, cached = parent.cache, parent.cached
            parent.cache, parent.cached = None, 0  # the continuing turn takes it over
            return parent.tokens + list(input_ids), cache, cached

    def finish(self, params: dict, rid: str, turn: Turn) -> None:
        with self._lock:
            turns = self._sessions.get(params.get("id"))
            if turns is not None:
                turns[rid] = Turn(rid, turn.tokens, turn.cache, turn.cached)


def extend(engine, context: list[int], cache, cached: int, sampling: SamplingConfig, seed: int, control=None):
    """Sample one response to `context` with the built-in engine, reusing `cache` (the KV of
    context[:cached]); returns (generation, its finished turn's cache and its length, tokens prefilled)."""
    import torch
    from transformers import DynamicCache

    model = engine.model
    device = next(model.parameters()).device
    if cache is None or cached > len(context):
        cache, cached = DynamicCache(config=model.config), 0
    generator = torch.Generator(device=device).manual_seed(seed)
    stop = set(sampling.stop_token_ids)
    tokens: list[int] = []
    logprobs: list[float] = []
    finish = "length"
    with torch.inference_mode():
        feed = context[cached:]
        logits = _forward(engine, cache, feed, cached, device)
        prefilled = len(feed)
        for step in range(sampling.max_response_len):
            next_id, logprob = sample_tokens(logits / sampling.temperature, sampling, generator)
            tokens.append(int(next_id[0]))
            logprobs.append(float(logprob[0]))
            if tokens[-1] in stop:
                finish = "stop"
                break
            if step == sampling.max_response_len - 1:
                break
            stopped = control() if control is not None else None
            if stopped:
                finish = stopped
                break
            logits = _forward(engine, cache, tokens[-1:], len(context) + len(tokens) - 1, device)
    generation = Generation(tuple(context), tuple(tokens), tuple(logprobs), finish)
    return generation, cache, len(context) + len(tokens) - 1, prefilled


def _forward(engine, cache, ids: list[int], start: int, device):
    """Feed `ids` at positions start.. against `cache`; the last position's logits (float32)."""
    import torch

    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
    attention = torch.ones((1, start + len(ids)), dtype=torch.long, device=device)
    out = engine.model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{engine.cache_keyword: cache},
    )
    return out.logits[:, -1, :].float()
