"""Prompts: loaded from JSONL or Parquet, or generated for a built-in synthetic task.

The order of prompts is a pure function of (seed, rollout id), so a resumed run draws the
same batches as an uninterrupted one without saving any loader state.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SYNTHETIC_PREFIX = "synthetic:"
SYNTHETIC_TASKS = ("fixed", "copy", "echo", "arith")
ECHO_ANSWERS = "2468"
SYNTHETIC_SIZE = 512
FIXED_ANSWER = "7777"


class DataError(ValueError):
    """A prompt file is unreadable or lacks what the flags ask for; names file and line."""


@dataclass(frozen=True)
class Prompt:
    index: int  # position in the dataset
    content: str | tuple[Mapping[str, str], ...]  # text, or chat messages
    label: str
    metadata: Mapping[str, Any] = field(default_factory=dict)


def synthetic_prompts(task: str, size: int = SYNTHETIC_SIZE, seed: int = 0) -> list[Prompt]:
    """Built-in tasks a tiny random model can learn in a few dozen GRPO steps.

    fixed: every prompt has the same answer; the policy only has to find and keep it.
    copy: the answer is the digits of the prompt; the policy must read its input.
    echo: the prompt ends with one of four digits and the answer is that digit (one token). A
        policy that ignores its input is right on a quarter of the prompts at best, so an exact
        match rate well above 0.25 shows it reads the prompt, whatever the graded reward says.
    arith: `a+b=` with a and b in 1..4, the answer their sum; graded by a math-answer reward
        (`--rm-type gsm8k`: the response's final number), which gives no credit for a near miss.
    """
    rng = random.Random(seed)
    prompts = []
    for i in range(size):
        digits = "".join(rng.choice("0123456789") for _ in range(4))
        if task == "fixed":
            prompts.append(Prompt(i, f"code {digits}:", FIXED_ANSWER))
        elif task == "copy":
            prompts.append(Prompt(i, f"copy {digits}:", digits))
        elif task == "arith":
            a, b = rng.randint(1, 4), rng.randint(1, 4)
            prompts.append(Prompt(i, f"{a}+{b}=", str(a + b)))
        elif task == "echo":
            answer = rng.choice(ECHO_ANSWERS)
            prompts.append(Prompt(i, f"echo {answer}", answer))
        else:
            raise DataError(f"unknown synthetic task '{task}'; known: {', '.join(SYNTHETIC_TASKS)}")
    return prompts


def load_prompts(
    source: str, *, input_key: str = "prompt", label_key: str = "label", metadata_key: str = "metadata"
) -> list[Prompt]:
    """Read prompts from `synthetic:<task>`, a `.jsonl`/`.json` file, or a `.parquet` file."""
    if source.startswith(SYNTHETIC_PREFIX):
        return synthetic_prompts(source[len(SYNTHETIC_PREFIX) :])
    path = Path(source)
    if not path.is_file():
        raise DataError(
            f"--prompt-data {source}: no such file (or use synthetic:<{'|'.join(SYNTHETIC_TASKS)}>)"
        )
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    prompts = [
        _prompt_from_row(i, where, row, input_key, label_key, metadata_key)
        for i, (where, row) in enumerate(rows)
    ]
    if not prompts:
        raise DataError(f"{path}: no prompts in the file")
    return prompts


def _jsonl_rows(path: Path) -> list[tuple[str, Mapping[str, Any]]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object"
                ) from exc
            if not isinstance(row, dict):
                raise DataError(
                    f"{where}: a JSON {type(row).__name__}, expected an object with the prompt keys"
                )
            rows.append((where, row))
    return rows


def _parquet_rows(path: Path) -> list[tuple[str, Mapping[str, Any]]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: cannot read as Parquet: {exc}") from exc
    return [(f"{path}: row {i}", row) for i, row in enumerate(table.to_pylist())]


def _prompt_from_row(
    index: int, where: str, row: Mapping[str, Any], input_key: str, label_key: str, metadata_key: str
) -> Prompt:
    if input_key not in row:
        raise DataError(f"{where}: no key '{input_key}' (keys: {', '.join(sorted(row))}); pass --input-key")
    content = row[input_key]
    if isinstance(content, list):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in content):
            raise DataError(
                f"{where}: '{input_key}' is a list but not chat messages ({{role, content}} objects)"
            )
        content = tuple(dict(m) for m in content)
    elif not isinstance(content, str):
        raise DataError(f"{where}: '{input_key}' must be text or chat messages, got {type(content).__name__}")
    if label_key not in row:
        raise DataError(f"{where}: no key '{label_key}' (keys: {', '.join(sorted(row))}); pass --label-key")
    label = row[label_key]
    metadata = row.get(metadata_key) or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata) if metadata.strip().startswith("{") else {"value": metadata}
    return Prompt(index, content, "" if label is None else str(label), metadata)


def batch_for_rollout(
    prompts: Sequence[Prompt], rollout_id: int, batch_size: int, *, seed: int, shuffle: bool
) -> list[Prompt]:
    """Prompts of rollout `rollout_id`: consecutive slices of an epoch order, wrapping epochs."""
    out: list[Prompt] = []
    start = rollout_id * batch_size
    for position in range(start, start + batch_size):
        epoch, offset = divmod(position, len(prompts))
        out.append(prompts[_epoch_order(len(prompts), epoch, seed, shuffle)[offset]])
    return out


_ORDER_CACHE: dict[tuple[int, int, int, bool], list[int]] = {}


def _epoch_order(size: int, epoch: int, seed: int, shuffle: bool) -> list[int]:
    key = (size, epoch, seed, shuffle)
    if key not in _ORDER_CACHE:
        order = list(range(size))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        _ORDER_CACHE.clear()  # one epoch at a time is all a run needs
        _ORDER_CACHE[key] = order
    return _ORDER_CACHE[key]


def encode_prompt(
    prompt: Prompt, tokenizer, *, apply_chat_template: bool, system_prompt: str | None
) -> list[int]:
    """Token ids of a prompt, through the chat template when asked (generation prompt added)."""
    if apply_chat_template:
        messages = (
            list(prompt.content)
            if isinstance(prompt.content, tuple)
            else [{"role": "user", "content": prompt.content}]
        )
        if system_prompt and messages[0].get("role") != "system":
            messages.insert(0, {"role": "system", "content": system_prompt})
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "--apply-chat-template was given but the tokenizer of --hf-checkpoint has no chat_template"
            )
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if isinstance(prompt.content, tuple):
        raise DataError(
            f"prompt {prompt.index} is a list of chat messages; pass --apply-chat-template to render it"
        )
    return list(tokenizer.encode(prompt.content, add_special_tokens=True))
