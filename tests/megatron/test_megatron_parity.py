"""The megatron GPTModel built from an HF config computes what the HF model computes.

For each config switch that changes the math, a tiny random checkpoint with that switch set
is converted to torch_dist, loaded back into megatron-core's GPTModel (the Transformer Engine
layer spec, on CPU) and its float32 logits on a fixed sequence are compared with the HF
model's: at most 1e-5 apart. A switch the mapping ignored would show here (Qwen3-MoE with
norm_topk_prob false once gave cosine 0.996 when megatron renormalised the top-k weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=6, suite="stage-b-cpu")

TOL = 1e-5

VARIANTS = {
    # family, tiny dims overriding the family's (which follow the real models)
    "qwen3 tied embeddings, heads x head_dim != hidden": ("qwen3", {}),
    "qwen3 untied embeddings": ("qwen3", {"tie_word_embeddings": False}),
    "qwen3 heads x head_dim == hidden": ("qwen3", {"head_dim": 16}),
    "qwen3 rope theta 1e4": ("qwen3", {"rope_theta": 10_000}),
    "qwen3 linear rope scaling": (
        "qwen3",
        {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1_000_000}},
    ),
    "qwen3_moe renormalised top-k (norm_topk_prob true)": ("qwen3_moe", {}),
    "qwen3_moe raw top-k weights (norm_topk_prob false)": ("qwen3_moe", {"norm_topk_prob": False}),
    "qwen3_moe dense first layer": ("qwen3_moe", {"mlp_only_layers": [0]}),
    "qwen3_moe tied embeddings": ("qwen3_moe", {"tie_word_embeddings": True}),
}


def _converted(tmp_path: Path, family: str, dims: dict) -> tuple[Path, dict]:
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    hf = make_tiny_checkpoint(family, 3, tmp_path / "hf", **dims)
    dst = tmp_path / "torch_dist"
    dst.mkdir()
    # verify=False: this test makes the comparison itself, at a tighter tolerance
    convert_to_torch_dist(hf, dst, family, verify=False)
    return hf, json.loads((hf / "config.json").read_text())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_logits_match_hf_logits(variant, tmp_path):
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from miles.families.facts import rope_parameters
    from miles.families.model import build_model, hf_logit_gap
    from miles.families.transformer import transformer_config
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    family, dims = VARIANTS[variant]
    hf, config = _converted(tmp_path, family, dims)
    for key, value in dims.items():  # the switch really is in the checkpoint under test
        written = rope_parameters(config)["rope_theta"] if key == "rope_theta" else config[key]
        assert written == value, key
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model_parallel_cuda_manual_seed(0)
        model = build_model(config, transformer=transformer_config(config, dtype=torch.float32))
        state = dist_checkpointing.load(model.sharded_state_dict(), str(tmp_path / "torch_dist" / "release"))
        model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
        gap = hf_logit_gap(hf, model, config)
    assert gap <= TOL, f"{variant}: megatron and HF logits differ by up to {gap:.3g}"


def test_a_config_the_mapping_cannot_express_is_refused_by_name():
    from miles.families import UnmappedModel
    from miles.families.transformer import transformer_config

    config = {"model_type": "qwen3", "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(UnmappedModel, match="rope_type 'yarn' is not mapped"):
        transformer_config(config)
