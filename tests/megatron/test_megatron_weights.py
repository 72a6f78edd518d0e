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
(inkling_mm_model, tests/support/inkling.py) exports under the release's names, gate and
up interleaved again, equal to its checkpoint's decoder tensors: what SGLang's
InklingForConditionalGeneration loads (the built-in engine's AutoModelForCausalLM loads no release).
Qwen3-MoE's export at TP 2 + EP 2, quantized as miles.train.fp8_export streams it to an engine
started from the FP8 checkpoint prepare-ckpt writes, equals that checkpoint bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import tiny
from tests.support.inkling import make_release_checkpoint
from tests.support.results import results

register_cpu_ci(est_time=15, suite="stage-b-cpu")

WORKER = Path(__file__).with_name("weights_worker.py")


CASES = {
    "dense-tp2": ("qwen3", 2, 1, 1),
    "dense-pp2": ("qwen3", 1, 2, 1),
    "moe-ep2": ("qwen3_moe", 1, 1, 2),
    "moe-tp2-ep2": ("qwen3_moe", 2, 1, 2),
    # what an FP8 engine is pushed when the experts are EP-sharded (the seed's mori/DeepEP FP8 cases)
    "moe-tp2-ep2-fp8": ("qwen3_moe", 2, 1, 2),
    "glm-tp2-ep2": ("glm_moe_dsa", 2, 1, 2),
    "glm-pp2": ("glm_moe_dsa", 1, 2, 1),
    "inkling-tp2-ep2": ("inkling", 2, 1, 2),
    "inkling-pp2": ("inkling", 1, 2, 1),
    "inkling-release-tp2-ep2": ("release", 2, 1, 2),
    "dsv4-tp2-ep2": ("deepseek_v4", 2, 1, 2),
    "dsv4-pp2": ("deepseek_v4", 1, 2, 1),
}
LAYERS = {"qwen3": 2, "qwen3_moe": 2, "glm_moe_dsa": 4, "inkling": 2, "deepseek_v4": 4}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, dict]:
    """Every case's export against its checkpoint, from one launch of the two ranks."""
    from miles.ckpt.fp8 import convert_to_fp8
    from miles.ckpt.torch_dist import convert_to_torch_dist

    made = {family: tiny(family, layers, torch_dist=True) for family, layers in LAYERS.items()}
    made = {family: (entry.hf, entry.torch_dist) for family, entry in made.items()}
    root = tmp_path_factory.mktemp("release")
    release = make_release_checkpoint(root / "hf")
    (root / "torch_dist").mkdir()
    convert_to_torch_dist(release, root / "torch_dist", "inkling")
    made["release"] = (release, root / "torch_dist")
    fp8 = tmp_path_factory.mktemp("fp8") / "hf_fp8"
    fp8.mkdir()
    convert_to_fp8(made["qwen3_moe"][0], fp8)  # prepare-ckpt's fp8 step
    cases = [
        {
            "id": case,
            "hf": str(made[family][0]),
            "torch_dist": str(made[family][1]),
            "tp": tp,
            "pp": pp,
            "ep": ep,
            **({"fp8": str(fp8)} if case.endswith("-fp8") else {}),
        }
        for case, (family, tp, pp, ep) in CASES.items()
    ]
    found = {
        r["case"]: r
        for r in results(ranks.launch(WORKER, json.dumps(cases), timeout=900, preload=ranks.MEGATRON_PRELOAD))
    }
    assert sorted(found) == sorted(CASES), sorted(found)
    return found


@pytest.mark.parametrize("case", list(CASES))
def test_exported_weights_equal_the_checkpoint_under_both_name_sets(exported, case):
    family = CASES[case][0]
    result = exported[case]
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


def test_an_fp8_engine_is_pushed_what_prepare_ckpt_wrote_with_the_experts_ep_sharded(exported):
    """At TP 2 + EP 2 the export, quantized as miles.train.fp8_export streams it to an engine started
    from the FP8 checkpoint, equals that checkpoint's files bit for bit, expert weights and scales
    included: the CPU twin of tests/e2e/megatron/test_qwen3_30B_A3B/test_amd_moriep_fp8_bridge.py."""
    result = exported["moe-tp2-ep2-fp8"]
    assert result["fp8_missing"] == [] and result["fp8_extra"] == [], result
    assert result["fp8_not_quantized"] == [] and result["fp8_differing"] == [], result
    assert (
        result["fp8_quantized_experts"] > 0 and result["fp8_quantized"] > result["fp8_quantized_experts"]
    ), result
