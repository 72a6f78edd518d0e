"""GLM-4.7-Flash (glm4_moe_lite) built by megatron-core computes what transformers' Glm4MoeLiteForCausalLM computes, MTP layer included.

A tiny random GLM-4.7-Flash checkpoint with every switch of the published model (MLA with a q
latent, interleaved rope at theta 1e6, a dense first layer, sigmoid routing of 4 experts with
expert bias, routed scaling 1.8, a shared expert, untied embeddings, one MTP layer) and one with
the other switches the mapping carries (no q latent, group-limited routing, two shared experts,
tied embeddings, rope theta 1e4), their norms and expert biases moved off transformers' initial
constants (tests/support/ckpt.py perturbed), run split over two gloo ranks at TP 1 (two
data-parallel ranks), TP 2 with sequence parallelism and EP 2, and PP 2, every (checkpoint, layout)
in one launch (tests/megatron/mtp_layout_worker.py). In float32, at every layout:

- the logits are within 1e-5 of transformers';
- the MTP layer's logits (megatron-core's MTP block as the last stage carries it, fed the decoder's
  final hidden state) are within 1e-5 of DeepSeek-V3's formula computed with transformers' own
  decoder layer and the checkpoint's enorm, hnorm, eh_proj and shared_head.norm, and of the first
  layout's MTP logits;
- the gradient norm of the mean token cross-entropy, as the trainer gets it, equals transformers'
  within 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import perturbed
from tests.support.results import results

register_cpu_ci(est_time=15, suite="stage-b-cpu")

TOL = 1e-5
GRAD_REL = 1e-5
LAYERS = 2
WORKER = Path(__file__).with_name("mtp_layout_worker.py")
LAYOUTS = ("tp1", "tp2sp_ep2", "pp2")
VARIANTS = {  # name: the tiny dims beyond the published switches
    "published switches": {},
    "other switches": {
        "q_lora_rank": None, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "n_shared_experts": 2,
        "tie_word_embeddings": True, "rope_theta": 10_000,
    },
}  # fmt: skip


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict[tuple[str, str], list[dict]]:
    """(variant, layout) -> the ranks' results."""
    root = tmp_path_factory.mktemp("glm4_moe_lite")
    checkpoints = {}
    for i, (variant, dims) in enumerate(VARIANTS.items()):
        checkpoints[variant] = perturbed("glm4_moe_lite", LAYERS, root / str(i), **dims)
        config = json.loads((checkpoints[variant] / "config.json").read_text())
        for key, value in dims.items():  # the switch really is in the checkpoint under test
            found = config["rope_parameters"]["rope_theta"] if key == "rope_theta" else config[key]
            assert found == value, (variant, key, found)
    cases = [[str(checkpoints[v]), layout] for v in VARIANTS for layout in LAYOUTS]
    found = results(ranks.launch(WORKER, json.dumps(cases)))
    by_path = {str(path): variant for variant, path in checkpoints.items()}
    out = {(by_path[r["checkpoint"]], r["layout"]): r["ranks"] for r in found}
    for (variant, layout), got in out.items():
        worst = {
            k: max(r[k] for r in got if k in r)
            for k in ("gap", "mtp_gap", "mtp_gap_to_first_layout", "grad_norm_rel")
        }
        print(f"{variant} at {layout}: {worst}")
    return out


def _last_stage(ranks_: list[dict]) -> list[dict]:
    found = [r for r in ranks_ if "gap" in r]
    assert found, ranks_
    return found


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_equal_transformers(measured, variant, layout):
    gaps = [r["gap"] for r in _last_stage(measured[variant, layout])]
    assert max(gaps) <= TOL, f"{variant} at {layout}: megatron and transformers' logits differ by {gaps}"


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_mtp_layer_computes_deepseek_v3s_formula_with_transformers_layer(measured, variant, layout):
    for r in _last_stage(measured[variant, layout]):
        assert r["mtp_gap"] <= TOL, f"{variant} at {layout}: MTP logits differ from the reference by {r}"
        assert r["mtp_gap_to_first_layout"] <= TOL, (
            f"{variant} at {layout}: MTP logits differ from tp1's: {r}"
        )
        assert r["mtp_vs_main"] > 100 * TOL, r  # the MTP layer is not the model's own prediction


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_trainers_gradient_norm_equals_transformers(measured, variant, layout):
    for r in measured[variant, layout]:
        assert r["grad_norm_rel"] <= GRAD_REL, f"{variant} at {layout}: {r}"
