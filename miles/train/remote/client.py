"""One rollout engine's HTTP API, from the trainer's side (sglang 0.5.23's routes and shapes).

Answers are JSON; SGLang answers a refused control call with HTTP 400 and
`{"success": false, "message": ...}`, or 200 with success false, both of which become one
`RolloutEngineError` naming the engine, the route and SGLang's message. An engine that cannot
be reached (its process died, the connection was reset) is `EngineUnreachable`, which the
fleet may retry elsewhere. Standard library only.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from miles.train.config import SamplingConfig
from miles.train.rollout import Generation, RolloutEngineError
from miles.train.sglang_engine import sampling_params  # SGLang's request format, one definition

# A finish reason other than these means the engine did not complete the request.
FINISHED = ("stop", "length")


class EngineUnreachable(RolloutEngineError):
    """The engine's process does not answer (dead, or its connection was reset)."""


@dataclass(frozen=True)
class Output:
    """One generated row as the engine returned it."""

    generation: Generation
    spans: tuple[tuple[int, int, int], ...]  # (weight version, first token, end): who made which tokens
    cached_tokens: int
    prompt_tokens: int

    @property
    def versions(self) -> tuple[int, ...]:
        """The weight versions that produced its tokens, oldest first."""
        return tuple(sorted({v for v, _, _ in self.spans}))

    @property
    def aborted(self) -> bool:
        return self.generation.finish_reason not in FINISHED


@dataclass
class EngineClient:
    url: str
    name: str
    timeout: float = 3600.0

    def post(self, route: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(
            self.url + route, data=data, headers={"Content-Type": "application/json"}, method="POST"
        )
        return self._send(request, route, timeout)

    def get(self, route: str, *, timeout: float | None = None) -> Any:
        return self._send(urllib.request.Request(self.url + route, method="GET"), route, timeout)

    def _send(self, request, route: str, timeout: float | None) -> Any:
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                answer = _decoded(response.read())
        except urllib.error.HTTPError as exc:
            raise RolloutEngineError(f"{self.name} ({self.url}) refused {route}: {_message(exc)}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EngineUnreachable(f"{self.name} ({self.url}) did not answer {route}: {reason}") from None
        if isinstance(answer, dict) and answer.get("success") is False:
            raise RolloutEngineError(
                f"{self.name} ({self.url}) refused {route}: {answer.get('message') or '-'}"
            )
        return answer

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, seed: int | None
    ) -> list[Output]:
        if not prompts:
            return []
        params = sampling_params(sampling, seed)
        answers = self.post(
            "/generate",
            {"input_ids": [list(p) for p in prompts], "sampling_params": params, "return_logprob": True},
        )
        return [to_output(p, a) for p, a in zip(prompts, answers, strict=True)]


def to_output(prompt: Sequence[int], answer: Mapping[str, Any]) -> Output:
    meta = answer["meta_info"]
    finish = meta.get("finish_reason") or {}
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    entries = meta.get("output_token_logprobs") or []
    generation = Generation(
        prompt_ids=tuple(prompt),
        response_ids=tuple(int(e[1]) for e in entries),
        logprobs=tuple(float(e[0]) for e in entries),
        finish_reason=kind if kind in FINISHED else "abort",
    )
    n = len(generation.response_ids)
    spans = meta.get("weight_versions") or [
        {"version": meta.get("weight_version", "default"), "start": 0, "end": n}
    ]
    spans = tuple((_version(s["version"]), int(s["start"]), int(s["end"])) for s in spans)
    return Output(generation, spans, int(meta.get("cached_tokens") or 0), int(meta.get("prompt_tokens") or 0))


def _version(text) -> int:
    try:
        return int(text)
    except (TypeError, ValueError):
        return -1  # SGLang's "default": the weights it started with, before any sync


def _decoded(body: bytes):
    """JSON, or the text of a route that answers in plain text (SGLang's /flush_cache)."""
    try:
        return json.loads(body or b"null")
    except json.JSONDecodeError:
        return body.decode(errors="replace")


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        body = _decoded(exc.read())
    except OSError:
        return f"HTTP {exc.code}"
    if isinstance(body, str):
        return body.strip() or f"HTTP {exc.code}"
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body.get("detail") or f"HTTP {exc.code}")
    return f"HTTP {exc.code}"
