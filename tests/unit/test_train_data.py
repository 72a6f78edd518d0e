"""Prompt data: files load with clear errors; batches are a pure function of (seed, rollout)."""

from __future__ import annotations

import json

import pytest

from miles.ci.register import register_cpu_ci
from miles.train.data import DataError, batch_for_rollout, load_prompts, synthetic_prompts

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_prompts_load_with_custom_keys(tmp_path):
    path = _jsonl(
        tmp_path / "p.jsonl", [{"q": "1+1?", "a": 2}, {"q": "2+2?", "a": 4, "metadata": {"src": "x"}}]
    )
    prompts = load_prompts(str(path), input_key="q", label_key="a")
    assert [(p.index, p.content, p.label) for p in prompts] == [(0, "1+1?", "2"), (1, "2+2?", "4")]
    assert prompts[1].metadata == {"src": "x"}


def test_chat_messages_load_as_a_tuple(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": messages, "label": "x"}])
    assert load_prompts(str(path))[0].content == tuple(messages)


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "label": "b"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:2: not valid JSON"):
        load_prompts(str(path))


def test_missing_key_lists_the_keys_and_the_flag(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"question": "a", "label": "b"}])
    with pytest.raises(
        DataError, match=r"p\.jsonl:1: no key 'prompt' \(keys: label, question\); pass --input-key"
    ):
        load_prompts(str(path))


def test_parquet_prompts_load(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "label": ["1", "2"]}), path)
    assert [p.label for p in load_prompts(str(path))] == ["1", "2"]


def test_missing_file_suggests_the_synthetic_tasks():
    with pytest.raises(DataError, match="no such file .*synthetic:<fixed|copy>"):
        load_prompts("/nonexistent/p.jsonl")


def test_synthetic_copy_task_answers_with_the_prompt_digits():
    prompt = synthetic_prompts("copy", size=3)[0]
    assert prompt.content == f"copy {prompt.label}:" and prompt.label.isdigit()


def test_batches_are_reproducible_and_wrap_epochs():
    prompts = synthetic_prompts("fixed", size=5)
    first = batch_for_rollout(prompts, 2, 3, seed=1, shuffle=True)
    assert first == batch_for_rollout(prompts, 2, 3, seed=1, shuffle=True)
    epoch0 = [p.index for r in (0, 1) for p in batch_for_rollout(prompts, r, 3, seed=1, shuffle=False)]
    assert epoch0 == [0, 1, 2, 3, 4, 0]


def test_shuffle_changes_the_order_by_seed():
    prompts = synthetic_prompts("fixed", size=64)
    a = [p.index for p in batch_for_rollout(prompts, 0, 64, seed=1, shuffle=True)]
    b = [p.index for p in batch_for_rollout(prompts, 0, 64, seed=2, shuffle=True)]
    assert sorted(a) == sorted(b) == list(range(64)) and a != b
