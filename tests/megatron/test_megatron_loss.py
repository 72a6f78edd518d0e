"""Logprobs and entropy on vocabulary-parallel logits equal the full-vocabulary ones.

Two gloo ranks each hold half of the vocabulary's logits (the last rows being megatron's
vocabulary padding); the per-token logprob, the entropy and the gradient each rank gets for
its half must be what the unsharded computation gives (and zero for the padding), and the
fused form must give what the unfused one does, values and gradients, to 1e-6 in float32.
"""

from __future__ import annotations

from pathlib import Path

from miles.ci.register import register_cpu_ci
from tests.support import ranks, results

register_cpu_ci(est_time=5, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("tp_logprobs_worker.py")


def test_vocab_parallel_logprobs_entropy_and_gradients_match_the_full_vocabulary():
    result = results.result(ranks.launch(WORKER, timeout=300, preload=ranks.MEGATRON_PRELOAD))
    assert result["logp"] < 1e-5 and result["entropy"] < 1e-5, result
    assert result["grad"] < 1e-5, result
    assert result["padded_grad"] == 0.0, result
    # the fused form (block by block) against the unfused one it replaces: logprob, entropy, the
    # gradient, and the logprob-only pass, each to 1e-6 in float32
    assert result["fused_vs_unfused"] == [True, True, True, True], result
