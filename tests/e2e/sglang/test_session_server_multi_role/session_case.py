"""The multi-role session check of the seed's tests/e2e/sglang/test_session_server_multi_role/
(radixark/miles 31f1ca961, _common.py and its per-model files) on an SGLang server, for the GPU
twins here: miles' own verifier (miles.train.remote.session_verify: system, user, tool and
assistant turns in one engine session; the trainer keeps the token ids), whose metrics the
twins gate. The seed runs its session server in two versions (v1, v2) inside a training
harness; miles has one, driven straight against the engine. Not a test module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "sglang_server", Path(__file__).parents[1] / "sglang_server.py"
)
sglang_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sglang_server)


def verify(
    repo: str, *, tp: int, cycles: int, assistant_text_threshold: float, extra: tuple[str, ...] = ()
) -> None:
    from miles.metrics import capture
    from miles.train.config import SamplingConfig
    from miles.train.model import eos_token_ids, load_tokenizer
    from miles.train.remote import session_verify

    with sglang_server.started(repo, tp=tp, extra=extra) as (model, client):
        tokenizer = load_tokenizer(model)
        sampling = SamplingConfig(1.0, 1.0, -1, 256, eos_token_ids(model, tokenizer))
        conversations = [
            session_verify.converse(client, tokenizer, sampling, seed, cycles, builtin=False)
            for seed in range(4)
        ]
    metrics = session_verify.metrics(conversations)
    capture.log(0, metrics)
    assert metrics["rollout/session_context_mismatch_rate"] == 0.0, metrics
    assert metrics["rollout/session_prefix_miss_rate"] == 0.0, metrics
    assert metrics["rollout/tito_session_mismatch_rate/assistant_text"] <= assistant_text_threshold, metrics
