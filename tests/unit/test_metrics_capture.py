"""Capture in the training process, and reading the records back (miles.metrics.capture/records)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.metrics import capture
from miles.metrics.records import RecordError, merge_records, read_record

register_cpu_ci(est_time=2, suite="stage-a-cpu")


@pytest.fixture
def record_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "records"
    monkeypatch.setenv(capture.RECORD_DIR_ENV, str(directory))
    return directory


def test_log_without_the_record_dir_variable_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(capture.RECORD_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    capture.log(0, {"train/grad_norm": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_log_writes_one_line_per_metric_in_the_record_format(record_dir):
    capture.log(0, {"train/grad_norm": 1.5, "rollout/raw_reward": 0.25})
    capture.log(1, {"train/grad_norm": 1.25})
    (path,) = record_dir.glob("*.jsonl")
    assert path.name.startswith(f"{os.getpid()}-")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {"metric": "train/grad_norm", "series": [[0, 1.5], [1, 1.25]]},
        {"metric": "rollout/raw_reward", "series": [[0, 0.25]]},
    ]


def test_a_step_logged_out_of_order_or_twice_keeps_the_series_sorted_with_the_latest_value(record_dir):
    for step, value in [(0, 1.0), (2, 2.0), (1, 3.0), (1, 4.0), (3, 5.0)]:
        capture.log(step, {"train/grad_norm": value})
    (path,) = record_dir.glob("*.jsonl")
    assert read_record(path) == {"train/grad_norm": {0: 1.0, 1: 4.0, 2: 2.0, 3: 5.0}}
    assert json.loads(path.read_text())["series"] == [[0, 1.0], [1, 4.0], [2, 2.0], [3, 5.0]]


def test_non_finite_values_are_written_as_strings_and_read_back(record_dir):
    capture.log(3, {"a": math.nan, "b": math.inf, "c": -math.inf})
    (path,) = record_dir.glob("*.jsonl")
    assert '"NaN"' in path.read_text() and '"Infinity"' in path.read_text()
    series = read_record(path)
    assert math.isnan(series["a"][3]) and series["b"][3] == math.inf and series["c"][3] == -math.inf


def test_non_numeric_values_are_skipped_and_numeric_ones_kept(record_dir):
    capture.log(0, {"note": "warming up", "train/ppo_kl": 0.01, "flag": None})
    (path,) = record_dir.glob("*.jsonl")
    assert read_record(path) == {"train/ppo_kl": {0: 0.01}}


def test_every_standard_metric_logged_is_captured(record_dir):
    capture.log(0, dict.fromkeys(capture.STANDARD_METRICS, 1.0))
    assert set(merge_records(record_dir)) == set(capture.STANDARD_METRICS)


_LOGGER = """
import sys, time
from miles.metrics.capture import log
step = 0
while True:
    log(step, {"train/grad_norm": float(step), "rollout/raw_reward": 0.5})
    step += 1
    if step == 50:
        print("ready", flush=True)
"""


def test_a_process_killed_while_logging_leaves_a_complete_record(tmp_path):
    directory = tmp_path / "records"
    env = {**os.environ, capture.RECORD_DIR_ENV: str(directory)}
    proc = subprocess.Popen([sys.executable, "-c", _LOGGER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # keep it rewriting its record for a while, then kill it mid-flight
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    series = merge_records(directory)["train/grad_norm"]
    assert len(series.points) >= 50
    assert series.steps == tuple(range(len(series.points)))  # no gap, no partial line


def test_a_forked_child_writes_its_own_record(record_dir):
    capture.log(0, {"parent": 1.0})
    pid = os.fork()
    if pid == 0:  # child: log and leave without running the parent's cleanup
        try:
            capture.log(0, {"child": 2.0})
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    records = [read_record(p) for p in record_dir.glob("*.jsonl")]
    assert sorted(map(sorted, records)) == [["child"], ["parent"]]


def test_a_record_cut_mid_line_is_refused_with_its_file_and_line(tmp_path):
    path = tmp_path / "123-abc.jsonl"
    path.write_text('{"metric": "a", "series": [[0, 1.0]]}\n{"metric": "b", "series": [[0, 1')
    with pytest.raises(RecordError, match=r"123-abc.jsonl:2: the record ends mid-line"):
        merge_records(tmp_path)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("not json\n", "not valid JSON"),
        ('{"metric": "a"}\n', 'expected {"metric"'),
        ('{"metric": "a", "series": [[0.5, 1.0]]}\n', "integer step"),
        ('{"metric": "a", "series": [[0, "oops"]]}\n', "integer step and a number"),
        ('{"metric": "a", "series": []}\n{"metric": "a", "series": []}\n', "appears twice"),
    ],
)
def test_malformed_records_are_refused_with_the_reason(tmp_path, line, expected):
    (tmp_path / "1-x.jsonl").write_text(line)
    with pytest.raises(RecordError, match="1-x.jsonl:") as info:
        merge_records(tmp_path)
    assert expected in str(info.value)


def test_records_of_several_processes_merge_into_one_series(tmp_path):
    (tmp_path / "1-a.jsonl").write_text('{"metric": "m", "series": [[0, 1.0], [1, 2.0]]}\n')
    (tmp_path / "2-b.jsonl").write_text('{"metric": "m", "series": [[1, 2.0], [2, 3.0]]}\n')
    (tmp_path / ".3-c.jsonl.tmp").write_text('{"metric": "m", "series": [[0')  # a writer's temp file
    assert merge_records(tmp_path)["m"].points == ((0, 1.0), (1, 2.0), (2, 3.0))


def test_two_processes_disagreeing_on_a_step_is_an_error(tmp_path):
    (tmp_path / "1-a.jsonl").write_text('{"metric": "m", "series": [[1, 2.0]]}\n')
    (tmp_path / "2-b.jsonl").write_text('{"metric": "m", "series": [[1, 5.0]]}\n')
    with pytest.raises(RecordError, match="'m' at step 1 is 5.0 here but 2.0 in 1-a.jsonl"):
        merge_records(tmp_path)


def test_a_missing_record_directory_is_an_error(tmp_path):
    with pytest.raises(RecordError, match="no such record directory"):
        merge_records(tmp_path / "nope")
