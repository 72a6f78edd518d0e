"""GPU twin of the seed's tests/fast-gpu/test_run_megatron_worker_main.py (radixark/miles 31f1ca961): the
Megatron worker's entry point on 2 GPUs. The seed unit-tests its worker's helpers with megatron
mocked (--ref-load becomes the weights loaded, forward only unless --run-backward, dumps finished
after the pass); here `python -m miles.train.standalone run` runs for real at TP2 on a tiny
Qwen3 read from --ref-load: forward only it writes both ranks' logprobs and dumps no gradient;
with --run-backward it dumps the gradients, and its logprobs are the forward's (learning rate 0).
The CPU twin is tests/e2e/test_megatron_standalone.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=30, suite="stage-b-2-gpu-h200", labels=["megatron"])
register_rocm_ci(est_time=20, suite="nightly-stage-c-2-gpu-mi350", labels=["megatron"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    root = tmp_path_factory.mktemp("tiny")
    hf = make_tiny_checkpoint("qwen3", 2, root / "hf", progress=False)
    (root / "torch_dist").mkdir()
    convert_to_torch_dist(hf, root / "torch_dist", "qwen3")
    return hf, root / "torch_dist"


def _run(tiny, out, *extra: str) -> dict[int, list[dict]]:
    hf, ref = tiny
    cmd = [sys.executable, "-m", "miles.train.standalone", "run", "--hf-checkpoint", str(hf),
           "--ref-load", str(ref), "--layout", "--tp 2", "--output-dir", str(out), "--seq-length", "16", *extra]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return {r: json.loads((out / "logprobs" / f"rank_{r}.json").read_text())["entries"] for r in (0, 1)}


def _names(out, rank: int) -> set[str]:
    manifest = json.loads((out / "standalone" / "rollout_0" / f"manifest_rank={rank}.json").read_text())
    return {f["name"] for f in manifest["files"]}


def test_forward_only_then_backward(tiny, tmp_path):
    forward = _run(tiny, tmp_path / "fwd")
    assert forward[0] == forward[1] and len(forward[0]) == 15
    assert not any(n.startswith("grad__") for n in _names(tmp_path / "fwd", 0))
    backward = _run(tiny, tmp_path / "bwd", "--run-backward")
    assert any(n.startswith("grad__param__") for n in _names(tmp_path / "bwd", 0))
    for a, b in zip(forward[0], backward[0], strict=True):
        assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-2
