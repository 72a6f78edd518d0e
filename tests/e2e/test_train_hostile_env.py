"""A training process given a CI gate record folder it cannot write says so in one line at start.

The issue's case: MILES_CI_GATE_RECORD_DIR naming a file, or a folder that cannot take a file,
was a traceback in the training process once its first rollout logged its metrics. The run is
`python -m miles.train` on a tiny qwen3 checkpoint, as the CI runner starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=9, suite="stage-b-cpu")

RUN = (
    "--prompt-data synthetic:fixed --rm-type synthetic --num-rollout 1 --rollout-batch-size 2 "
    "--n-samples-per-prompt 2 --rollout-max-response-len 4 --global-batch-size 4 --micro-batch-size 4 "
    "--rollout-engine torch --train-backend fsdp --num-threads 1"
).split()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from miles.ckpt.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint("qwen3", 1, tmp_path_factory.mktemp("record-dir") / "qwen3", progress=False)


def train(hf: Path, record_dir: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MILES_CI_GATE_RECORD_DIR": record_dir,
           "MILES_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "miles.train", "--hf-checkpoint", str(hf), *RUN],
                          capture_output=True, text=True, timeout=300, env=env, check=False)  # fmt: skip


def refusal(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("miles.train:")]
    assert "rollout 1/1" not in done.stdout  # refused at start, before any rollout
    return line


def test_a_record_dir_that_is_a_file_is_one_line_at_start(tiny, tmp_path):
    blocker = tmp_path / "records"
    blocker.write_text("a file")
    line = refusal(train(tiny, str(blocker), tmp_path))
    assert line == (
        f"miles.train: RecordDirError: MILES_CI_GATE_RECORD_DIR={blocker} is a file, not a folder: the CI gate's "
        "metric record cannot be written there; point it at a folder this user can write (the runner sets it "
        "for each attempt), or unset it"
    )
    assert blocker.read_text() == "a file"


def test_a_record_dir_that_cannot_take_a_file_is_one_line_at_start(tiny, tmp_path):
    """/proc/self is a folder no user, root included, can create a file in."""
    line = refusal(train(tiny, "/proc/self", tmp_path))
    assert line.startswith(
        "miles.train: RecordDirError: MILES_CI_GATE_RECORD_DIR=/proc/self cannot take a file"
    ), line


def test_a_record_dir_below_a_file_is_one_line_at_start(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = refusal(train(tiny, str(blocker / "records"), tmp_path))
    assert f"MILES_CI_GATE_RECORD_DIR={blocker / 'records'} cannot take a file" in line, line


def test_a_missing_record_dir_is_made_and_the_record_written(tiny, tmp_path):
    records = tmp_path / "new" / "records"
    done = train(tiny, str(records), tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(records.glob("*.jsonl"))) == 1
