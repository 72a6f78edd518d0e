"""GPU twin of the seed's tests/e2e/sglang/test_session_server_multi_role/test_qwen3.py
(radixark/miles 31f1ca961): multi-turn, multi-role sessions on Qwen3-30B-A3B-FP8 (one GPU per
engine, 2 cycles), the context kept in the engine and the token ids equal to the trainer's;
the assistant-text mismatch within the seed's 0.25 for this family. Its CPU twin is
tests/e2e/test_remote_engine_server.py (the built-in engine). Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=700, suite="stage-c-2-gpu-h200", labels=["sglang"])
register_rocm_ci(est_time=500, suite="nightly-stage-c-2-gpu-mi350", labels=["sglang"])
register_ci_gate(metric_key="rollout/tito_session_mismatch_rate/assistant_text")

_spec = importlib.util.spec_from_file_location("session_case", Path(__file__).with_name("session_case.py"))
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)


def test_qwen3():
    case.verify(
        "Qwen/Qwen3-30B-A3B-FP8", tp=1, cycles=2, assistant_text_threshold=0.25,
        extra=("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen25"),
    )  # fmt: skip
