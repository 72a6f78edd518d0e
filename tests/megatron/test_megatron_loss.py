"""Logprobs and entropy on vocabulary-parallel logits equal the full-vocabulary ones.

Two gloo ranks each hold half of the vocabulary's logits (the last rows being megatron's
vocabulary padding); the per-token logprob, the entropy and the gradient each rank gets for
its half must be what the unsharded computation gives (and zero for the padding), and the
fused form must give what the unfused one does, values and gradients, to 1e-6 in float32.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=20, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("tp_logprobs_worker.py")


def test_vocab_parallel_logprobs_entropy_and_gradients_match_the_full_vocabulary():
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    assert result["logp"] < 1e-5 and result["entropy"] < 1e-5, result
    assert result["grad"] < 1e-5, result
    assert result["padded_grad"] == 0.0, result
    # the fused form (block by block) against the unfused one it replaces: logprob, entropy, the
    # gradient, and the logprob-only pass, each to 1e-6 in float32
    assert result["fused_vs_unfused"] == [True, True, True, True], result
