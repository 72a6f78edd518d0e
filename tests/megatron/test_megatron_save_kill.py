"""No checkpoint-writer process outlives a Megatron trainer killed with SIGKILL in the middle of a save.

megatron-core's writer forks a process per write bucket and reports through a queue served by a
manager process it spawns on first use. Killed mid-save, a trainer used to leave the manager
behind every time (reparented to PID 1, holding the caller's output pipes open) and a forked
writer about one time in four (a copy of the trainer's memory); miles.children ties both to the
trainer. The kills are real: save_kill_worker.py forks trainers (each the Megatron backend of a
user's command, saving through the trainer's own checkpoint path) and sends each SIGKILL while
a writer of its second save is alive, twelve times, so that a one-in-four survivor is seen with
probability 1 - 0.75**12 = 97% even without the manager.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks

register_cpu_ci(est_time=8, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("save_kill_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and relies on PR_SET_PDEATHSIG")
def test_no_writer_process_outlives_a_trainer_killed_mid_save(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = ranks.run([sys.executable, str(WORKER), "12", str(tmp_path)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["killed_mid_save"] == 12, result  # every kill came while a writer was alive
    assert result["survivors"] == [], result
