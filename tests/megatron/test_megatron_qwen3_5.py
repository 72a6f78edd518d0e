"""Qwen3.5-MoE (qwen3_5_moe) built by megatron-core computes what transformers' Qwen3.5-MoE computes.

A tiny random checkpoint in the release's form (a vision-language model: the decoder under
`model.language_model.*`, a one-block vision tower `model.visual.*`, the MTP block `mtp.*`) with every
switch of Qwen3.5-35B-A3B (three gated-delta-net layers then a full-attention one, two value heads
per key head, gated attention with zero-centred q/k norms and a quarter of each head rotated, rope
theta 1e7 with M-RoPE sections, softmax top-k MoE with a gated shared expert, one MTP layer) and
every norm moved off its start is converted to torch_dist by prepare-ckpt's converter, the vision
tower left out by name, and loaded into megatron-core's GPTModel on CPU (megatron-core's own
GatedDeltaNet with its torch gated delta rule): float32 logits at most 1e-5 from transformers' on a
probe shorter than and one longer than the rule's 64-token chunk. On two gloo ranks, in one launch,
at DP 2 (CP 1), TP 2 with sequence parallelism and EP 2, PP 2, and CP 2 (the gated delta net over
the gathered sequence), the logits equal transformers', the gradient norm of the mean token
cross-entropy as megatron's DDP, schedule and distributed optimizer get it equals transformers' own
on the same tokens (what FSDP computes over the HF model) within 1e-5 relative, and CP 2 equals
CP 1 (tests/megatron/qwen3_5_parallel_worker.py). At DP 2, at TP 2 + SP + EP 2 and at CP 2 (the MTP
block rolling its inputs across the context-parallel chunks), set up as
--enable-mtp-training sets it up, the training forward's MTP logits are within 1e-5 of Qwen3.5's MTP
formula computed with transformers' own decoder layer and the checkpoint's mtp.* tensors, and so are
the built-in engine's drafter's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import ranks
from tests.support.ckpt import move_mtp_shard, off_start
from tests.support.ckpt import tiny as cached
from tests.support.results import results

register_cpu_ci(est_time=15, suite="stage-b-cpu")

TOL = 1e-5
GRAD_REL = 1e-5
LAYERS = 4
WORKER = Path(__file__).with_name("qwen3_5_parallel_worker.py")
LAYOUTS = ("dp2", "tp2sp_ep2", "pp2", "cp2")


@pytest.fixture(scope="module")
def made():
    return cached("qwen3_5_moe", LAYERS, dtype="float32", torch_dist=True)


@pytest.fixture(scope="module")
def config(made) -> dict:
    from miles.families import read_config

    return read_config(made.hf)


def test_the_tiny_checkpoint_is_the_releases_form_with_its_switches(made, config):
    from miles.ckpt.shards import read_weight_map

    written = json.loads((made.hf / "config.json").read_text())
    assert written["model_type"] == "qwen3_5_moe" and config["model_type"] == "qwen3_5_moe_text"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert config["linear_num_value_heads"] == 2 * config["linear_num_key_heads"]
    assert config["rope_parameters"]["partial_rotary_factor"] == 0.25 and config["mtp_num_hidden_layers"] == 1
    names = read_weight_map(made.hf).weight_map
    assert any(n.startswith("model.visual.") for n in names)
    assert "mtp.fc.weight" in names and "mtp.layers.0.self_attn.q_proj.weight" in names
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in names


def test_every_decoder_and_mtp_tensor_has_one_place_and_the_vision_tower_none(made, config):
    from miles.ckpt.shards import read_weight_map
    from miles.families import layout

    placed = [(name, piece.hf_name) for name, pieces in layout(config) for piece in pieces]
    hf_names = {hf for _, hf in placed}
    checkpoint = set(read_weight_map(made.hf).weight_map)
    assert hf_names == {n for n in checkpoint if not n.startswith("model.visual.")}
    whole = [hf for name, hf in placed if not name.endswith("linear_qkv.weight")]  # q_proj: 2 pieces a head
    assert len(whole) == len(set(whole)), "an HF tensor feeds two megatron tensors"
    megatron = {name for name, _ in placed}
    assert "decoder.layers.0.self_attention.in_proj.weight" in megatron
    assert "decoder.layers.3.self_attention.linear_qkv.weight" in megatron
    assert "mtp.layers.0.eh_proj.weight" in megatron
    assert "mtp.layers.0.transformer_layer.mlp.shared_experts.gate_weight" in megatron


def test_megatron_logits_match_hf_logits_on_one_rank(made, config):
    from transformers import AutoModelForCausalLM

    from miles.ckpt.torch_dist import RELEASE
    from miles.families.model import load_model, logits, probe_tokens
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    reference = AutoModelForCausalLM.from_pretrained(made.hf, dtype=torch.float32).eval()
    gaps = {}
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model = load_model(config, made.torch_dist / RELEASE, dtype=torch.float32)
        assert "decoder.layers.0.self_attention.conv1d.weight" in model.state_dict()
        assert "mtp.layers.0.eh_proj.weight" in model.state_dict()  # the MTP layer is carried
        for length in (24, 80):  # within one chunk of the gated delta rule, and across two
            tokens = probe_tokens(config, length)
            with torch.no_grad():
                want = reference(input_ids=tokens).logits.float()
            gaps[length] = float((want - logits(model, tokens, config["vocab_size"])).abs().max())
    assert max(gaps.values()) <= TOL, f"megatron and HF logits differ by up to {gaps} (by length)"


def stacked_experts_copy(source: Path, out: Path) -> Path:
    """The checkpoint as the release stores it: each decoder layer's experts stacked into
    mlp.experts.gate_up_proj [experts, 2 x width, hidden] and mlp.experts.down_proj (the MTP layer's
    stay one tensor per expert), in one shard with its index."""
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(
        source, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json", ".miles-ckpt.json")
    )
    tensors = {}
    for shard in source.glob("*.safetensors"):
        tensors |= load_file(shard)
    expert = re.compile(r"^(model\.language_model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(\w+)\.weight$")
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    out_tensors = {}
    for name, tensor in tensors.items():
        found = expert.match(name)
        if found:
            parts.setdefault(found[1], {}).setdefault(int(found[2]), {})[found[3]] = tensor
        else:
            out_tensors[name] = tensor
    for base, experts in parts.items():
        order = sorted(experts)
        out_tensors[base + "gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in order]
        )
        out_tensors[base + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in order])
    save_file(out_tensors, out / "model.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {name: "model.safetensors" for name in sorted(out_tensors)}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return out


def test_the_releases_stacked_experts_convert_to_the_same_model(made, config, tmp_path):
    """Qwen3.5-35B-A3B's release stacks its decoder layers' experts (transformers saves them apart):
    the converter reads expert e's rows of the stacked tensors, and the model computes transformers' logits."""
    from transformers import AutoModelForCausalLM

    from miles.ckpt.shards import read_weight_map
    from miles.ckpt.torch_dist import RELEASE, convert_to_torch_dist
    from miles.families.model import load_model, logits, probe_tokens
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    hf = stacked_experts_copy(made.hf, tmp_path / "hf")
    names = read_weight_map(hf).weight_map
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.language_model.layers.0.mlp.experts.0.gate_proj.weight" not in names
    dst = tmp_path / "torch_dist"
    dst.mkdir()
    convert_to_torch_dist(hf, dst, "qwen3_5_moe", verify=False)
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokens = probe_tokens(config, 80)
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model = load_model(config, dst / RELEASE, dtype=torch.float32)
        with torch.no_grad():
            want = reference(input_ids=tokens).logits.float()
        gap = float((want - logits(model, tokens, config["vocab_size"])).abs().max())
    assert gap <= TOL, gap


def mtp_norms_moved(source: Path, out: Path) -> Path:
    """A copy of the checkpoint whose MTP block's norms are off their start: the tiny checkpoint's are
    all one constant, so a norm applied to the wrong tensor (the embedding's to the hidden state)
    would not show."""
    from safetensors.torch import load_file

    from miles.ckpt.tiny import MTP_SHARD

    shutil.copytree(source, out, ignore=shutil.ignore_patterns(".miles-ckpt.json"))
    move_mtp_shard(out, off_start())
    moved = load_file(out / MTP_SHARD)
    assert not torch.equal(moved["mtp.pre_fc_norm_embedding.weight"], moved["mtp.pre_fc_norm_hidden.weight"])
    return out


@pytest.fixture(scope="module")
def two_ranks(made, tmp_path_factory) -> dict[str, list[dict]]:
    """Each layout's ranks' results (one launch serves every layout)."""
    hf = mtp_norms_moved(made.hf, tmp_path_factory.mktemp("qwen3_5") / "hf")
    found = results(ranks.launch(WORKER, str(hf), *LAYOUTS, timeout=900))
    by_layout = {r["layout"]: r["ranks"] for r in found}
    assert sorted(by_layout) == sorted(LAYOUTS), by_layout
    print({k: [{n: v for n, v in r.items() if n != "logits"} for r in rs] for k, rs in by_layout.items()})
    return by_layout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_ranks_give_transformers_logits_and_gradient_norm(two_ranks, layout):
    found = two_ranks[layout]
    assert any("gap" in r for r in found)  # the last pipeline stage compared the logits
    for result in found:
        if "gap" in result:
            assert result["gap"] <= TOL, result
        assert result["grad_norm_rel"] <= GRAD_REL, result


@pytest.mark.parametrize("layout", ["dp2", "tp2sp_ep2", "cp2"])
def test_the_trained_mtp_layer_and_the_engines_drafter_give_the_mtp_formulas_logits(two_ranks, layout):
    found = [r for r in two_ranks[layout] if "mtp_gap" in r]
    assert found, f"no rank of {layout} computed the MTP layer's logits: {two_ranks[layout]}"
    for result in found:
        assert result["mtp_gap"] <= TOL, result
        assert result["drafter_gap"] <= TOL, result
        assert result["mtp_vs_main"] > 100 * TOL, result  # the MTP layer's logits are its own


def test_context_parallel_two_equals_one(two_ranks):
    """The seed's tests/e2e/precision/test_qwen3_5_cp_correctness.py, on the whole model: CP 2's logits
    and gradient norm are CP 1's (DP 2 on the same two ranks)."""
    one = next(r for r in two_ranks["dp2"] if "logits" in r)
    two = next(r for r in two_ranks["cp2"] if "logits" in r)
    gap = float((torch.tensor(one["logits"]) - torch.tensor(two["logits"])).abs().max())
    assert gap <= TOL, gap
    assert abs(one["grad_norm"] - two["grad_norm"]) <= GRAD_REL * one["grad_norm"], (one, two)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e7}}, "rope_type 'yarn'"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads 3 is not a multiple"),
        ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings=true"),
        ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers 2"),
        ({"layer_types": ["full_attention"] * 3 + ["linear_attention"]}, "linear-attention last layer"),
    ],
)
def test_a_config_the_mapping_cannot_express_is_refused_by_name(config, change, message):
    from miles.families import UnmappedModel, family

    with pytest.raises(UnmappedModel, match=message):
        family("qwen3_5_moe").refuse_unmapped({**config, **change})


def test_tensor_parallelism_must_divide_the_gated_delta_nets_heads(config):
    from miles.families import model_shape

    limits = model_shape({**config, "linear_num_key_heads": 3, "linear_num_value_heads": 6}, "tiny").limits
    assert "linear_num_key_heads 3" in limits.tp_problem(2)
    assert limits.tp_problem(3) is None and limits.cp_problem(2) is None
