"""GPU twin of the seed's tests/e2e/short/test_run_megatron.py (radixark/miles 31f1ca961): the Megatron
model alone (`python -m miles.train.standalone run-and-compare`), Qwen3-30B-A3B-5layer at TP1
against TP2·PP2·CP2 (EP1) with sequence parallelism and 3+2 layers over the pipeline stages, a
128-token math prompt; the target's per-token logprobs must be the baseline's to 0.06 (mean) and
the tensors both dump with one shape to 0.002. The seed's source patcher config is left out (miles
dumps through module hooks and refuses source patching). The CPU twin (TP1 vs TP2 of the tiny
Qwen3, logprobs equal to transformers', a moved logprob failing the comparison) is
tests/e2e/test_megatron_standalone.py. Untested on GPU: est_time is the seed's.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from miles.ci.register import register_cuda_ci, register_rocm_ci

register_cuda_ci(est_time=200, suite="stage-c-8-gpu-h100", labels=["short"])
register_rocm_ci(est_time=2000, suite="nightly-stage-c-8-gpu-mi350", labels=["short"])

_spec = importlib.util.spec_from_file_location("seed_flags", Path(__file__).parents[1] / "seed_flags.py")
twins = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(twins)


def test_tp1_and_tp2_pp2_cp2_agree(tmp_path):
    from miles.ckpt.hub import parse_source, resolve_hub
    from miles.ckpt.torch_dist import convert_to_torch_dist

    hf, _ = resolve_hub(parse_source("fzyzcjy/Qwen3-30B-A3B-5layer"))
    ref = tmp_path / "Qwen3-30B-A3B-5layer_torch_dist"
    ref.mkdir()
    convert_to_torch_dist(hf, ref, "qwen3_moe")
    out = tmp_path / "dumps"
    cmd = [
        sys.executable, "-m", "miles.train.standalone", "run-and-compare",
        "--hf-checkpoint", str(hf), "--ref-load", str(ref), "--output-base-dir", str(out),
        "--baseline", "--tp 1", "--target", "--tp 2 --pp 2 --cp 2 --ep 1",
        "--seq-length", "128", "--batch-size", "1", "--prompt-mode", "math", "--sp",
        "--dumper-filter", "layer_id is None or layer_id < 3", "--diff-threshold", "0.002",
        "--logprob-threshold", "0.06",
        "--target-extra-args", "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 2",
        "--extra-args", "--attention-backend flash",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=twins.ROOT, capture_output=True, text=True, check=False)
    sys.stdout.write(proc.stdout[-20000:])
    sys.stderr.write(proc.stderr[-20000:])
    assert proc.returncode == 0, "the comparison failed (its report is above)"
    assert "logprobs passed: 127 positions" in proc.stdout
    assert "tensors passed:" in proc.stdout
    assert (out / "tp2_pp2_cp2" / "logprobs" / "rank_7.json").is_file()
