"""GLM-5.2 (glm_moe_dsa) built by megatron-core computes what transformers' GlmMoeDsaForCausalLM computes.

A tiny random GLM checkpoint with every switch of the published model (MLA with the DSA
indexer, cross-layer top-k sharing at index_topk_freq 4 / offset 3 so layer 3 reuses layer 2's
top-k, rope theta 8e6, a dense first layer, sigmoid routing with expert bias, a shared expert,
routed scaling 2.5, untied embeddings, one MTP layer) is converted to torch_dist by the
converter prepare-ckpt runs, loaded into megatron-core's GPTModel on CPU and compared in float32
with the HF model: at most 1e-5 apart, at a length where the indexer keeps 8 of 32 keys (sparse)
and one where it keeps them all.

Tiny checkpoints start every norm at 1, every norm bias and the expert bias at 0, which hides
bugs (the indexer fed the q latent before its norm gives the same top-k when the norm is the
identity, 0.3 apart once it is not), so every norm, the indexer's k_norm bias and the expert
bias are perturbed first. The comparison runs on identical sequences: `relu(q·k)` ties at zero
make transformers' own top-k depend on the padded length.

The recipe's GPU form (Megatron at TP 4 with sequence parallelism and EP 4, the torch_dist as
--ref-load) passes miles.train's argument and checkpoint checks on two CPU ranks (--dry-start).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import dry_start as dry

register_cpu_ci(est_time=18, suite="stage-b-cpu")


TOL = 1e-5
LAYERS = 4
SPARSE_TOPK = 8  # the indexer keeps 8 keys per query: a 32-token probe is sparse, an 8-token one dense

VARIANTS = {
    "published switches": {},
    # what the mapping must carry that GLM-5 does not set: group-limited routing (4 groups, top 2, whose
    # top-k // topk_group is 2, as megatron-core's group score needs), two shared experts, two dense
    # layers, tied embeddings, an indexer on every layer, rope theta 1e4
    "other switches": {
        "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4, "n_shared_experts": 2, "first_k_dense_replace": 2,
        "tie_word_embeddings": True, "index_topk_freq": 1, "rope_theta": 10_000,
    },
}  # fmt: skip


def perturbed_checkpoint(root: Path, **dims) -> Path:
    """A float32 tiny GLM whose norms, k_norm biases and expert biases are not at their initial values."""
    from tests.support.ckpt import perturbed

    return perturbed("glm_moe_dsa", LAYERS, root, index_topk=SPARSE_TOPK, **dims)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_glm_logits_match_hf_logits(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.ckpt.torch_dist import convert_to_torch_dist
    from miles.families.model import load_model, logits, probe_tokens
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    hf = perturbed_checkpoint(tmp_path, **VARIANTS[variant])
    config = json.loads((hf / "config.json").read_text())
    for key, value in VARIANTS[variant].items():  # the switch really is in the checkpoint under test
        assert (config["rope_parameters"]["rope_theta"] if key == "rope_theta" else config[key]) == value, key
    dst = tmp_path / "torch_dist"
    dst.mkdir()
    convert_to_torch_dist(hf, dst, "glm_moe_dsa", verify=False)  # compared here, at a tighter tolerance
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    gaps = {}
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model = load_model(config, dst / "release", dtype=torch.float32)
        for length in (SPARSE_TOPK, 4 * SPARSE_TOPK):
            tokens = probe_tokens(config, length)
            with torch.no_grad():
                want = reference(input_ids=tokens).logits.float()
            gaps[length] = float((want - logits(model, tokens, config["vocab_size"])).abs().max())
    assert max(gaps.values()) <= TOL, f"{variant}: megatron and HF logits differ by up to {gaps} (by length)"


def test_every_checkpoint_tensor_has_one_place_and_shared_layers_have_no_indexer(tmp_path):
    from miles.ckpt.shards import read_weight_map
    from miles.families import layout
    from tests.support.ckpt import tiny_hf

    hf = tiny_hf("glm_moe_dsa", LAYERS)
    config = json.loads((hf / "config.json").read_text())
    assert config["indexer_types"] == ["full", "full", "full", "shared"]
    placed = [(name, piece.hf_name) for name, pieces in layout(config) for piece in pieces]
    hf_names = [hf_name for _, hf_name in placed]
    gate_up = {n for n in hf_names if n.endswith(("gate_proj.weight", "up_proj.weight"))}  # one piece each
    assert sorted(set(hf_names)) == sorted(read_weight_map(hf).weight_map)
    assert len(hf_names) == len(set(hf_names)), "an HF tensor feeds two megatron tensors"
    assert all(hf_names.count(n) == 1 for n in gate_up)
    megatron = [name for name, _ in placed]
    assert not [n for n in megatron if n.startswith("decoder.layers.3.") and ".indexer." in n]
    assert "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in megatron
    assert "mtp.layers.0.final_layernorm.weight" in megatron  # the MTP layer's shared_head.norm


MTP_LAYOUTS = ("tp1", "tp2sp_ep2", "pp2")
MTP_WORKER = Path(__file__).with_name("mtp_layout_worker.py")


def test_the_shared_mtp_layer_trains_and_drafts_with_the_policys_top_k(tmp_path):
    """At 4 layers GLM-5.2's MTP layer (index 4) is a "shared" DSA layer: it reuses the top-k of
    layer 2, the nearest full layer below. Over 48 tokens, where the indexer keeps 8 keys per
    query, megatron-core's MTP block (as the trainer runs it, at TP 1, TP 2 with sequence
    parallelism and EP 2, and PP 2 on two gloo ranks; tests/megatron/mtp_layout_worker.py) gives
    the logits of transformers' decoder layer L handed the top-k transformers' own layer 2
    returned, and so does the built-in engine's drafter handed that top-k."""
    from tests.support import ranks
    from tests.support.results import results

    hf = perturbed_checkpoint(tmp_path / "ckpt")
    config = json.loads((hf / "config.json").read_text())
    assert config["indexer_types"][2:] == ["full", "shared"] and config["index_topk"] == SPARSE_TOPK
    found = results(ranks.launch(MTP_WORKER, json.dumps([[str(hf), layout] for layout in MTP_LAYOUTS])))
    assert sorted(r["layout"] for r in found) == sorted(MTP_LAYOUTS)
    for r in found:
        last = [rank for rank in r["ranks"] if "mtp_gap" in rank]
        assert last, r
        for rank in last:
            print(r["layout"], {k: rank[k] for k in ("gap", "mtp_gap", "drafter_gap", "mtp_vs_main")})
            for gap in ("gap", "mtp_gap", "drafter_gap"):
                assert rank[gap] <= TOL, (r["layout"], gap, rank)
            assert rank["mtp_gap_to_first_layout"] <= TOL, (r["layout"], rank)
            assert rank["mtp_vs_main"] > 1e-2, rank  # the MTP layer's logits are not the model's


def test_the_recipes_gpu_form_dry_starts_on_two_cpu_ranks(tmp_path):
    """The command the recipe renders for 4 H200s (Megatron, TP 4 with sequence parallelism, EP 4,
    the torch_dist as --ref-load) passes miles.train's argument and checkpoint checks: at the same
    layout scaled to 2 ranks (TP 2, EP 2) and the model flags at a 5-layer tiny GLM's sizes, every
    rank builds its model chunk and loads the converted checkpoint, then stops (--dry-start).
    The flags that act only through Transformer Engine's layer spec on a GPU (which the CPU
    start refuses, miles.megatron.options) are left out: this is the CPU, and only those."""
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    argv, hf, ref = dry.gpu_command("glm5_2_744b_a40b", tmp_path)
    assert ref.name == "GLM-5.2-744B-A40B-5layer_torch_dist"
    make_tiny_checkpoint("glm_moe_dsa", 5, hf)  # under the name the plan gives the prepared checkpoint
    ref.mkdir()
    convert_to_torch_dist(hf, ref, "glm_moe_dsa")
    dry.scale(argv, "glm_moe_dsa", json.loads((hf / "config.json").read_text()))
    gpu_only = dry.without_gpu_only(argv)
    assert set(gpu_only) == {"--moe-grouped-gemm", "--moe-permute-fusion", "--attention-backend"}, gpu_only
    assert all("Transformer Engine" in why for why in gpu_only.values()), gpu_only
    out = dry.dry_start(argv)
    assert "tp2·pp1·cp1·ep2·etp1+sp" in out and f"holds {ref}; no rollout" in out, out[-3000:]
    assert "stand-in layer spec" in out and "linear_q_up_proj " in out, out[-3000:]  # the first line, for MLA
