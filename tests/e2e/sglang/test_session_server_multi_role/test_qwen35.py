"""GPU twin of the seed's tests/e2e/sglang/test_session_server_multi_role/test_qwen35.py
(radixark/miles 31f1ca961): multi-turn, multi-role sessions on Qwen3.5-35B-A3B-FP8 (TP 2, 2
cycles), the seed's default assistant-text threshold (0.2). The seed also turns speculative
decoding on (enable_spec); this twin serves without it. Its CPU twin is
tests/e2e/test_remote_engine_server.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from miles.ci.register import register_ci_gate, register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=800, suite="stage-c-4-gpu-h200", labels=["sglang"])
register_rocm_ci(est_time=500, suite="nightly-stage-c-4-gpu-mi350", labels=["sglang"])
register_ci_gate(metric_key="rollout/tito_session_mismatch_rate/assistant_text")

_spec = importlib.util.spec_from_file_location("session_case", Path(__file__).with_name("session_case.py"))
case = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(case)


def test_qwen35():
    case.verify(
        "Qwen/Qwen3.5-35B-A3B-FP8", tp=2, cycles=2, assistant_text_threshold=0.2,
        extra=("--reasoning-parser", "qwen3", "--tool-call-parser", "qwen3_coder"),
    )  # fmt: skip
