"""The Megatron backend hands the rollout engine exactly the weights it holds, under either name set.

A tiny checkpoint is converted to torch_dist and loaded by two gloo ranks at a model-parallel
layout; the exported weights must equal the checkpoint files tensor for tensor under their
file names (what SGLang loads, GLM-5.2's MTP layer included) and the transformers model's state
dict under its names (fused experts, what the built-in engine loads): TP shards gathered (gate
and up apart, the shared expert's too), PP stages broadcast, experts gathered over EP with their
global indices. GLM-5.2's tiny has 4 layers, the last reusing the DSA top-k of layer 2, so its
PP=2 split (2 + 2) starts each stage on a layer with its own indexer. Inkling's tiny (a sliding
and a global layer, dense then MoE) exports its stacked experts and shared experts, its
convolutions (split over TP on k and v) and its embedding norm. Inkling's release form
(inkling_mm_model, tests/megatron/inkling_release.py) exports under the release's names, gate and
up interleaved again, equal to its checkpoint's decoder tensors: what SGLang's
InklingForConditionalGeneration loads (the built-in engine's AutoModelForCausalLM loads no release).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=200, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("weights_worker.py")
sys.path.insert(0, str(Path(__file__).parent))
from inkling_release import make_release_checkpoint  # noqa: E402  (this directory's helper)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    made = {}
    for family, layers in (
        ("qwen3", 2),
        ("qwen3_moe", 2),
        ("glm_moe_dsa", 4),
        ("inkling", 2),
        ("release", 2),
        ("deepseek_v4", 4),
    ):
        root = tmp_path_factory.mktemp(family)
        if family == "release":
            hf = make_release_checkpoint(root / "hf")
        else:
            hf = make_tiny_checkpoint(family, layers, root / "hf")
        dist = root / "torch_dist"
        dist.mkdir()
        convert_to_torch_dist(hf, dist, "inkling" if family == "release" else family)
        made[family] = (hf, dist)
    return made


@pytest.mark.parametrize(
    ("family", "tp", "pp", "ep"),
    [
        ("qwen3", 2, 1, 1),
        ("qwen3", 1, 2, 1),
        ("qwen3_moe", 1, 1, 2),
        ("qwen3_moe", 2, 1, 2),
        ("glm_moe_dsa", 2, 1, 2),
        ("glm_moe_dsa", 1, 2, 1),
        ("inkling", 2, 1, 2),
        ("inkling", 1, 2, 1),
        ("release", 2, 1, 2),
        ("deepseek_v4", 2, 1, 2),
        ("deepseek_v4", 1, 2, 1),
    ],
    ids=[
        "dense-tp2",
        "dense-pp2",
        "moe-ep2",
        "moe-tp2-ep2",
        "glm-tp2-ep2",
        "glm-pp2",
        "inkling-tp2-ep2",
        "inkling-pp2",
        "inkling-release-tp2-ep2",
        "dsv4-tp2-ep2",
        "dsv4-pp2",
    ],
)
def test_exported_weights_equal_the_checkpoint_under_both_name_sets(converted, family, tp, pp, ep):
    hf, dist = converted[family]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           str(hf), str(dist), str(tp), str(pp), str(ep)]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(lines[0].removeprefix("RESULT "))
    if family == "glm_moe_dsa":  # the MTP layer is handed over under its checkpoint names
        assert "model.layers.4.eh_proj.weight" in result["checkpoint_names"], result
    if family == "deepseek_v4":  # its MTP layer too, and the hash-routing tables under both name sets
        assert "mtp.0.e_proj.weight" in result["checkpoint_names"], result
        assert "model.layers.0.ffn.gate.tid2eid" in result["checkpoint_names"], result
    assert result["checkpoint_names_missing"] == [] and result["checkpoint_names_extra"] == [], result
    if family == "release":  # SGLang's names (InklingForConditionalGeneration.load_weights reads model.llm.*)
        assert result["left_out"] == ["audio", "mtp", "visual"], result
        names = result["checkpoint_names"]
        for name in ("model.llm.layers.1.mlp.experts.w13_weight", "model.llm.layers.0.mlp.w13_dn.weight",
                     "model.llm.unembed.weight", "model.llm.embed_norm.weight"):  # fmt: skip
            assert name in names, name
        assert not any(n.startswith(("model.layers.", "lm_head")) for n in names), names
        assert result["checkpoint_max_diff"] == 0.0, result
        return
    assert result["model_names_missing"] == [] and result["model_names_extra"] == [], result
    assert result["checkpoint_max_diff"] == 0.0 and result["model_max_diff"] == 0.0, result
