"""Multi-turn, multi-role sessions against an engine, checked token by token (tokens in, tokens out).

A conversation runs in one engine session (SGLang's API: /open_session, then each turn a
/generate whose session_params continue the previous turn): system and user messages, then
the assistant's turn, then a tool result, the assistant again, a user message, the assistant
again, for --cycles rounds. The trainer side keeps the conversation's token ids itself (TITO):
the ids the engine generated, and between turns only the chat template's tokens for the new
messages (`delta_ids`), so the ids it would train on are the ones the engine conditioned on,
never a re-tokenised text. Each turn checks, on any engine:

- the engine's context is the trainer's ids: its prompt_tokens is their count, and (with
  --score, the HF model loaded here) the engine's logprobs of its tokens equal the model's over
  the trainer's ids, which they would not if one token of the context differed;
- the engine reused the session's prefix: cached_tokens is the previous turn's context less
  its last token (the built-in server also counts the tokens it prefilled: only the new ones).

`rollout/tito_session_mismatch_rate/assistant_text` is the share of assistant turns whose
text, rendered by the chat template from messages again, does not give the same ids (the
seed framework's metric, radixark/miles 31f1ca961 session_verify_runner): what a trainer that
re-tokenised the conversation would get wrong.

    python -m miles.train.remote.session_verify --hf-checkpoint DIR --engine-url URL [--score]
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from dataclasses import dataclass, field

from miles.train.config import SamplingConfig
from miles.train.remote.client import EngineClient, sampling_params, to_output

ROLES_SCRIPT = (  # (role, content) of the messages before each assistant turn of a cycle
    (("system", "You answer in one short line."), ("user", "Add 2 and 3.")),
    (("tool", '{"result": 5}'),),
    (("user", "And times 4?"),),
)


@dataclass
class TurnCheck:
    prompt_tokens: int  # the engine's context length
    expected_tokens: int  # the trainer's ids before the turn
    cached_tokens: int
    expected_cached: int  # the previous turn's context less its last token (0 on the first turn)
    prefilled: int | None  # tokens the built-in server prefilled for the turn
    text_matches: bool  # the template over the decoded text gives the same ids
    logprob_gap: float | None = None


@dataclass
class Conversation:
    ids: list[int] = field(default_factory=list)  # the trainer's ids of the whole conversation
    messages: list[dict] = field(default_factory=list)
    checks: list[TurnCheck] = field(default_factory=list)
    outputs: list = field(default_factory=list)  # (start in ids, Output) of each assistant turn


def render(tokenizer, messages: list[dict], *, generation: bool) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)


def delta_ids(tokenizer, history: list[dict], new: list[dict], finished: bool) -> list[int]:
    """The chat template's tokens between the end of the assistant's generated ids (`finished`:
    they end with its end-of-turn token) and the next generation prompt, for the `new` messages."""
    closing = render(tokenizer, [{"role": "assistant", "content": "\x00"}], generation=False).split(
        "\x00", 1
    )[1]
    prefix = render(tokenizer, history, generation=False)
    full = render(tokenizer, history + new, generation=True)
    if not full.startswith(prefix):
        raise ValueError(
            "the chat template rewrites earlier turns when messages are added; TITO needs it append-only"
        )
    eos = tokenizer.eos_token or ""
    after_output = closing[len(eos) :] if finished and eos and closing.startswith(eos) else closing
    return list(tokenizer.encode(after_output + full[len(prefix) :], add_special_tokens=False))


def converse(
    client: EngineClient, tokenizer, sampling: SamplingConfig, seed: int, cycles: int, *, builtin: bool
) -> Conversation:
    """One conversation of `cycles` rounds of ROLES_SCRIPT in one session (see the module docstring)."""
    session = client.post("/open_session", {"capacity_of_str_len": 1 << 16, "session_id": uuid.uuid4().hex})
    conv, parent, parent_rid = Conversation(), None, None
    try:
        for cycle in range(cycles):
            for step, script in enumerate(ROLES_SCRIPT):
                if cycle and step == 0:
                    script = script[1:]  # one system message per conversation
                new = [{"role": r, "content": c} for r, c in script]
                if parent is None:
                    turn_input = list(
                        tokenizer.apply_chat_template(
                            new, add_generation_prompt=True, tokenize=True, return_dict=False
                        )
                    )
                else:
                    finished = parent.generation.finish_reason == "stop"
                    turn_input = delta_ids(tokenizer, conv.messages, new, finished)
                conv.messages += new
                before = client.get("/get_server_info")["prefilled_tokens"] if builtin else None
                rid = uuid.uuid4().hex
                params = {"id": session, "rid": parent_rid} if parent is not None else {"id": session}
                answer = client.post(
                    "/generate",
                    {"input_ids": turn_input, "sampling_params": sampling_params(sampling, seed), "rid": rid,
                     "return_logprob": True, "session_params": params},
                )  # fmt: skip
                expected_cached = len(conv.ids) + len(parent.generation.response_ids) - 1 if parent else 0
                if parent is not None:
                    conv.ids += list(parent.generation.response_ids)
                conv.ids += turn_input
                out = to_output(conv.ids, answer)
                prefilled = client.get("/get_server_info")["prefilled_tokens"] - before if builtin else None
                text = tokenizer.decode(list(out.generation.response_ids), skip_special_tokens=True)
                conv.checks.append(
                    TurnCheck(
                        out.prompt_tokens, len(conv.ids), out.cached_tokens, expected_cached, prefilled, False
                    )
                )
                conv.outputs.append((len(conv.ids), out))
                conv.messages.append({"role": "assistant", "content": text})
                conv.checks[-1].text_matches = _text_matches(tokenizer, conv, out)
                parent, parent_rid = out, rid
        conv.ids += list(parent.generation.response_ids)
    finally:
        client.post("/close_session", {"session_id": session})
    return conv


def _text_matches(tokenizer, conv: Conversation, out) -> bool:
    """The template over the messages (the assistant's text decoded) gives the trainer's ids."""
    rendered = tokenizer.apply_chat_template(conv.messages, tokenize=True, return_dict=False)
    mine = conv.ids + list(out.generation.response_ids)
    return list(rendered[: len(mine)]) == mine


def score(model, conv: Conversation) -> None:
    """Each turn's logprob gap: the engine's logprobs of its tokens against the model's over the
    trainer's ids of the whole conversation (teacher-forced, one forward)."""
    import torch

    ids = torch.tensor([conv.ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
    for check, (start, out) in zip(conv.checks, conv.outputs, strict=True):
        n = len(out.generation.response_ids)
        mine = logp[start - 1 : start - 1 + n]
        engine = torch.tensor(out.generation.logprobs)
        check.logprob_gap = float((mine - engine).abs().max())


def metrics(conversations: list[Conversation]) -> dict[str, float]:
    checks = [c for conv in conversations for c in conv.checks]
    out = {
        "rollout/tito_session_mismatch_rate/assistant_text": sum(not c.text_matches for c in checks)
        / len(checks),
        "rollout/session_context_mismatch_rate": sum(c.prompt_tokens != c.expected_tokens for c in checks)
        / len(checks),
        "rollout/session_prefix_miss_rate": sum(c.cached_tokens < c.expected_cached for c in checks)
        / len(checks),
        "rollout/session_turns": float(len(checks)),
    }
    gaps = [c.logprob_gap for c in checks if c.logprob_gap is not None]
    if gaps:
        out["rollout/session_logprob_abs_diff_max"] = max(gaps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m miles.train.remote.session_verify", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--hf-checkpoint", required=True, help="the engine's model (its tokenizer and chat template)"
    )
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--score", action="store_true", help="load the HF model here and compare logprobs")
    parser.add_argument("--builtin", action="store_true", help="the engine is miles' built-in server")
    args = parser.parse_args(argv)
    from miles.train.model import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(args.hf_checkpoint)
    sampling = SamplingConfig(
        args.temperature, 1.0, -1, args.max_new_tokens, eos_token_ids(args.hf_checkpoint, tokenizer)
    )
    client = EngineClient(args.engine_url, "engine")
    conversations = [
        converse(client, tokenizer, sampling, seed, args.cycles, builtin=args.builtin)
        for seed in range(args.conversations)
    ]
    if args.score:
        import torch

        from miles.train.model import load_causal_lm

        model = load_causal_lm(args.hf_checkpoint, dtype=torch.float32)
        for conv in conversations:
            score(model, conv)
    result = metrics(conversations)
    from miles.metrics import capture

    capture.log(0, result)
    print(
        json.dumps({"metrics": result, "turns": [c.__dict__ for conv in conversations for c in conv.checks]})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
