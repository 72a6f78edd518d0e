"""GPU twin of the seed's tests/e2e/sglang/test_chat_input_ids_equivalence.py (radixark/miles
31f1ca961), its assertions on an SGLang server of Qwen3-0.6B: /generate with the chat template's
token ids (the trainer's, miles.train.data.encode_prompt) and /v1/chat/completions with the
messages give the same text, the same token ids, logprobs within 1e-6, and the chat endpoint's
prompt ids are the trainer's. Its CPU twin is in tests/e2e/test_remote_engine_server.py.
Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=190, suite="stage-c-4-gpu-h200", labels=["sglang"])
register_rocm_ci(est_time=80, suite="nightly-stage-c-4-gpu-mi350", labels=["sglang"])

_spec = importlib.util.spec_from_file_location("sglang_server", Path(__file__).with_name("sglang_server.py"))
sglang_server = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sglang_server)

SEED, MAX_NEW_TOKENS, LOGPROB_TOL = 1234, 100, 1e-6
MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Answer with one word: 2+2?"},
]


def test_generate_and_chat_completions_equivalence():
    from miles.train.data import Prompt, encode_prompt
    from miles.train.model import load_tokenizer

    with sglang_server.started("Qwen/Qwen3-0.6B") as (model, client):
        tokenizer = load_tokenizer(model)
        ids = encode_prompt(
            Prompt(0, tuple(MESSAGES), "", {}), tokenizer, apply_chat_template=True, system_prompt=None
        )
        gen = client.post(
            "/generate",
            {"input_ids": ids, "return_logprob": True,
             "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS, "sampling_seed": SEED}},
        )  # fmt: skip
        chat = client.post(
            "/v1/chat/completions",
            {"model": model, "messages": MESSAGES, "temperature": 0, "max_completion_tokens": MAX_NEW_TOKENS,
             "seed": SEED, "logprobs": True, "return_prompt_token_ids": True},
        )["choices"][0]  # fmt: skip
    text = chat["message"]["content"]
    assert gen["text"] == text
    gen_ids = [t[1] for t in gen["meta_info"]["output_token_logprobs"]]
    assert gen_ids == list(tokenizer.encode(text, add_special_tokens=False))
    chat_logprobs = [t["logprob"] for t in chat["logprobs"]["content"]]
    gen_logprobs = [t[0] for t in gen["meta_info"]["output_token_logprobs"]]
    assert len(gen_logprobs) == len(chat_logprobs)
    assert all(
        math.isclose(g, c, abs_tol=LOGPROB_TOL) for g, c in zip(gen_logprobs, chat_logprobs, strict=True)
    )
    assert chat["prompt_token_ids"] == ids
