"""The Megatron worker's entry point (`python -m miles.train.standalone`) on the tiny Qwen3 under gloo.

The seed's command (radixark/miles 31f1ca961, tests/e2e/short/test_run_megatron.py:
`run-and-compare --baseline '--tp 1' --target ... --seq-length --batch-size 1 --prompt-mode math
--dumper-filter ... --diff-threshold --logprob-threshold`) runs TP=1 on one rank against TP=2 on
two, forward and backward. Each layout's per-token logprobs must be transformers' own logprobs of
the same prompt tokens from the same checkpoint; the forward's tensors are dumped per rank (the
filter's layers only, gradients too); the comparison passes, and it fails when a logprob moves.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import recipes as runs

register_cpu_ci(est_time=20, suite="stage-b-cpu")

STANDALONE = [sys.executable, "-m", "miles.train.standalone"]
SEQ = 24


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("standalone")
    plan = runs.tiny_plan("qwen3_4b", workdir, train_backend="megatron")
    hf, out = plan.checkpoint.hf_dir, workdir / "out"
    proc = subprocess.run(
        [*STANDALONE, "run-and-compare", "--hf-checkpoint", str(hf), "--ref-load", f"{hf}_torch_dist",
         "--output-base-dir", str(out), "--baseline", "--tp 1", "--target", "--tp 2",
         "--seq-length", str(SEQ), "--batch-size", "1", "--prompt-mode", "math", "--run-backward",
         "--dumper-filter", "layer_id is None or layer_id < 1", "--diff-threshold", "1e-4",
         "--logprob-threshold", "1e-5", "--extra-args", "--distributed-backend gloo --num-threads 1"],
        capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    return hf, out, proc


def test_the_layouts_agree_and_the_comparison_says_so(compared):
    _, _, proc = compared
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"logprobs passed: {SEQ - 1} positions" in proc.stdout
    assert "tensors passed:" in proc.stdout


@pytest.mark.parametrize("layout, ranks", [("tp1", 1), ("tp2", 2)])
def test_each_layouts_logprobs_are_the_models_own(compared, layout, ranks):
    from transformers import AutoModelForCausalLM

    hf, out, _ = compared
    tokens = json.loads((out / layout / "token_ids.json").read_text())
    assert len(tokens) == SEQ
    model = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    for rank in range(ranks):
        entries = json.loads((out / layout / "logprobs" / f"rank_{rank}.json").read_text())["entries"]
        assert [(e["position"], e["token_id"]) for e in entries] == list(enumerate(tokens))[1:]
        got = torch.tensor([e["logprob"] for e in entries])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_forward_and_the_gradients_are_dumped_per_rank_with_the_filters_layers(compared):
    _, out, _ = compared
    for rank in (0, 1):
        manifest = json.loads(
            (out / "tp2" / "standalone" / "rollout_0" / f"manifest_rank={rank}.json").read_text()
        )
        names = {f["name"] for f in manifest["files"]}
        assert "input_ids" in names and "decoder.layers.0.output.0" in names
        assert "grad__param__decoder.layers.0.mlp.linear_fc2.weight" in names
        assert not any("decoder.layers.1." in n for n in names)  # layer 1 filtered out, its gradients too


def test_the_comparison_fails_when_a_logprob_moves(compared, tmp_path):
    _, out, _ = compared
    moved = tmp_path / "tp2"
    shutil.copytree(out / "tp2", moved)
    for path in (moved / "logprobs").glob("rank_*.json"):
        record = json.loads(path.read_text())
        for entry in record["entries"]:
            entry["logprob"] -= 1.0
        path.write_text(json.dumps(record))
    proc = subprocess.run(
        [*STANDALONE, "compare", "--baseline-dir", str(out / "tp1"), "--target-dir", str(moved),
         "--logprob-threshold", "1e-5", "--diff-threshold", "1e-4"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "logprobs FAILED" in proc.stdout and "tensors passed" in proc.stdout
