"""Inkling (inkling_text) built by megatron-core computes what transformers' InklingForCausalLM computes.

A tiny random Inkling checkpoint with every switch of the published model (a sliding-window
layer and a global one with their own relative-bias extents, log scaling of the global layer,
short convolutions on k, v and both branches, the embedding norm, a dense first layer with
its global scale, then an MoE layer whose router normalises over the top-k and two shared
experts, the logits divided by the width multiplier 16, untied head) is converted to
torch_dist by the converter prepare-ckpt runs, loaded into megatron-core's GPTModel on CPU and
compared in float32 with the HF model: at most 1e-5 apart (and at most 1e-4 of the largest
logit), at 24 tokens and at 80 (past the window, 32, and the global extent, 64).

Tiny checkpoints start every norm and global scale at 1, the expert bias at 0 and the
convolutions and relative-bias bank at values too small to matter, which hides bugs (a
dropped embedding norm, a swapped scale), so those tensors are perturbed first, and the head is
scaled up so the logits are of order 1. The published log-scaling floor (128000 tokens) never
acts at test lengths: a variant sets it to 2 (and its alpha to 0.5, so tau reaches 2.8).
"""

from __future__ import annotations

import json

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import dry_start as dry
from tests.support.inkling import make_release_checkpoint, perturbed_checkpoint

register_cpu_ci(est_time=15, suite="stage-b-cpu")


TOL = 1e-5
LENGTHS = (24, 80)

VARIANTS = {
    "published switches": {},
    "log scaling from position 2, alpha 0.5": {"log_scaling_n_floor": 2, "log_scaling_alpha": 0.5},
    # sliding layers with their own geometry (4 kv heads of 16), one shared expert, every layer MoE
    "sliding geometry, one shared expert, all MoE": {
        "swa_num_key_value_heads": 4, "swa_head_dim": 16, "n_shared_experts": 1, "dense_mlp_idx": 0,
    },
    # a global layer first, every layer dense, 8 heads of 16 over 4 kv heads, global extent 16
    "global first, all dense, other heads": {
        "dense_mlp_idx": 2, "local_layer_ids": [1], "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 16, "rel_extent": 16,
    },
}  # fmt: skip


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_megatron_inkling_logits_match_hf_logits(variant, tmp_path):
    from transformers import AutoModelForCausalLM

    from miles.ckpt.torch_dist import convert_to_torch_dist
    from miles.families.model import load_model, logits, probe_tokens
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    dims = VARIANTS[variant]
    hf = perturbed_checkpoint(tmp_path, **dims)
    config = json.loads((hf / "config.json").read_text())
    for key, value in dims.items():  # the switch really is in the checkpoint under test
        if key == "dense_mlp_idx":
            assert config["mlp_layer_types"] == ["dense"] * value + ["sparse"] * (2 - value), key
        elif key == "local_layer_ids":
            assert [i for i, t in enumerate(config["layer_types"]) if t == "hybrid_sliding"] == value, key
        else:
            assert config[key] == value, key
    dst = tmp_path / "torch_dist"
    dst.mkdir()
    convert_to_torch_dist(hf, dst, "inkling", verify=False)  # compared here, at a tighter tolerance
    reference = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    gaps, largest = {}, 0.0
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model = load_model(config, dst / "release", dtype=torch.float32)
        for length in LENGTHS:
            tokens = probe_tokens(config, length)
            with torch.no_grad():
                want = reference(input_ids=tokens).logits.float()
            gaps[length] = float((want - logits(model, tokens, config["vocab_size"])).abs().max())
            largest = max(largest, float(want.abs().max()))
    print(f"{variant}: max |logit gap| by length {gaps}, largest |logit| {largest:.3g}")
    assert max(gaps.values()) <= min(TOL, 1e-4 * largest), (
        f"{variant}: logits differ by up to {gaps} (by length)"
    )


@pytest.mark.parametrize("form", ["inkling_text", "release"])
def test_every_checkpoint_tensor_has_one_place(form, tmp_path):
    """Every row of every decoder tensor (of each expert of a stacked one; the release's
    interleaved gate/up rows one by one) is placed exactly once; the release's towers and MTP
    layers are the tensors left out."""
    from safetensors import safe_open

    from miles.ckpt.shards import read_weight_map
    from miles.families import layout, megatron_family, read_config
    from tests.support.ckpt import tiny_hf

    if form == "release":
        hf = make_release_checkpoint(tmp_path / "hf")
    else:
        hf = tiny_hf("inkling", 2)
    config = read_config(hf)
    assert config["layer_types"] == ["hybrid_sliding", "hybrid"]
    assert config["mlp_layer_types"] == ["dense", "sparse"]
    placed = [(name, piece) for name, pieces in layout(config) for piece in pieces]
    files = read_weight_map(hf).weight_map
    left = {
        n for n in files if any(n.startswith(prefix) for prefix, _ in megatron_family(config).not_decoder)
    }
    assert bool(left) == (form == "release")
    assert sorted({p.hf_name for _, p in placed}) == sorted(set(files) - left)
    rows: dict[tuple, list] = {}
    for _, p in placed:
        rows.setdefault((p.hf_name, p.index), []).extend(range(p.start, p.stop, p.step))
    shapes = {}
    for f in hf.glob("*.safetensors"):
        with safe_open(f, "pt") as s:
            shapes.update({k: s.get_slice(k).get_shape() for k in s.keys()})
    for (name, index), got in rows.items():
        shape = shapes[name]
        count = (shape[1] if index is not None else shape[0]) if shape else 1
        assert sorted(got) == list(range(count)), (name, index, shape)
    stacked = {name for name, index in rows if index is not None}
    for name in stacked:
        assert sorted(i for n, i in rows if n == name) == list(range(shapes[name][0])), name
    if form == "release":  # gate/up interleaved: two pieces of step 2 per expert
        fc1 = dict(layout(config))["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
        assert [(p.start, p.at, p.step, p.index) for p in fc1] == [(0, 0, 2, 3), (1, 64, 2, 3)]


def test_configs_transformers_computes_otherwise_are_refused_by_name():
    from miles.families import UnmappedModel, family
    from miles.families.transformer import transformer_config

    base = {"model_type": "inkling_text", "num_hidden_layers": 2, **family("inkling").tiny_dims}
    for key, value, says in (
        ("use_sconv", False, "use_sconv=false"),
        ("final_logit_softcapping", 30.0, "final_logit_softcapping=30.0"),
        ("tie_word_embeddings", True, "tie_word_embeddings=True"),
        ("gate_activation", "softmax", "gate_activation 'softmax'"),
        ("unpadded_vocab_size", 500, "unpadded_vocab_size 500"),
    ):
        with pytest.raises(UnmappedModel, match=says):
            transformer_config({**base, key: value})
    # a release's config.json as it is (its decoder under text_config) is not read as the decoder's
    release = {"model_type": "inkling_mm_model", "text_config": base}
    with pytest.raises(UnmappedModel, match="text_config: the family reads the decoder's config"):
        transformer_config(release)


def test_the_release_checkpoint_computes_what_transformers_multimodal_class_computes(tmp_path, capsys):
    """The published checkpoint's form (inkling_mm_model: model.llm.* names, interleaved gate/up
    rows, the release's config keys, vision and audio towers and an MTP tensor beside the
    decoder), converted by prepare-ckpt's converter (with its own load-back and logit checks),
    computes InklingForConditionalGeneration's text-only logits within 1e-5."""
    from transformers import InklingForConditionalGeneration

    from miles.ckpt.torch_dist import convert_to_torch_dist
    from miles.families import read_config
    from miles.families.model import load_model, logits, probe_tokens
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    hf = make_release_checkpoint(tmp_path / "hf")
    raw = json.loads((hf / "config.json").read_text())
    assert raw["model_type"] == "inkling_mm_model" and "dense_intermediate_size" in raw["text_config"]
    dst = tmp_path / "torch_dist"
    dst.mkdir()
    convert_to_torch_dist(hf, dst, "inkling")
    report = capsys.readouterr().err
    for part in (
        "the vision tower (model.visual.*): 8 tensor(s)",
        "(model.mtp.*): 1 tensor(s)",
        "audio tower",
    ):
        assert part in report, report
    config = read_config(hf)
    assert (config["intermediate_size"], config["moe_intermediate_size"]) == (384, 64)
    reference = InklingForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    gaps, largest = {}, 0.0
    with single_process_group(), torch.random.fork_rng(devices=[]), cpu_placed():
        model = load_model(config, dst / "release", dtype=torch.float32)
        for length in LENGTHS:
            tokens = probe_tokens(config, length)
            with torch.no_grad():
                want = reference(input_ids=tokens).logits.float()
            gaps[length] = float((want - logits(model, tokens, config["vocab_size"])).abs().max())
            largest = max(largest, float(want.abs().max()))
    print(f"release names: max |logit gap| by length {gaps}, largest |logit| {largest:.3g}")
    assert max(gaps.values()) <= min(TOL, 1e-4 * largest), f"logits differ by up to {gaps} (by length)"


def test_the_release_config_is_read_as_transformers_normalises_it():
    """decoder_config of a release config.json (text_config in the release's keys, mtp_config at
    the top) gives every key transformers' InklingConfig gives its text config."""
    from transformers import InklingConfig

    from miles.families import decoder_config, family

    text = {**family("inkling").tiny_dims, "num_hidden_layers": 3}
    text["dense_intermediate_size"], text["intermediate_size"] = 96, 32
    del text["moe_intermediate_size"], text["local_layer_ids"]
    text["sconv_kernel_size"] = 3
    text["local_layer_ids"], text["dense_mlp_idx"] = [0, 1], 1
    raw = {
        "model_type": "inkling_mm_model", "text_config": text, "dtype": "bfloat16",
        "mtp_config": {"num_nextn_predict_layers": 1, "chain_hidden_post_norm": True, "local_layer_ids": [0]},
    }  # fmt: skip
    ours = decoder_config(raw)
    theirs = InklingConfig(**json.loads(json.dumps(raw))).text_config
    for key in (
        "intermediate_size", "moe_intermediate_size", "conv_kernel_size", "layer_types", "mlp_layer_types",
        "num_mtp_layers", "chain_hidden_post_norm", "mtp_local_layer_ids", "hidden_size", "n_routed_experts",
    ):  # fmt: skip
        assert ours[key] == getattr(theirs, key), key
    assert (ours["intermediate_size"], ours["moe_intermediate_size"]) == (96, 32)
    assert ours["layer_types"] == ["hybrid_sliding", "hybrid_sliding", "hybrid"]
    assert ours["model_type"] == "inkling_mm_model" and ours["dtype"] == "bfloat16"
    assert decoder_config(ours) == ours


def test_a_release_is_not_handed_over_under_names_no_engine_loads():
    """The built-in engine loads AutoModelForCausalLM's names, which a release (inkling_mm_model)
    does not have: its weights go to SGLang under the checkpoint's names, and asking for the
    class's names is refused before any tensor is gathered."""
    from types import SimpleNamespace

    from miles.families import decoder_config, family
    from miles.train.backends.megatron import MegatronBackend, MegatronSetupError

    text = {**family("inkling").tiny_dims, "num_hidden_layers": 2, "model_type": "inkling_text"}
    release = decoder_config({"model_type": "inkling_mm_model", "text_config": text})
    backend = SimpleNamespace(config=release, hf_checkpoint="/m/Inkling-Small")  # only what it reads first
    with pytest.raises(
        MegatronSetupError, match="inkling_mm_model is a multimodal release .*--rollout-engine sglang"
    ):
        next(MegatronBackend.full_weights(backend, "model"))


def test_context_parallelism_is_refused_before_a_model_runs():
    from types import SimpleNamespace

    from miles.families import UnmappedModel, family, megatron_family

    config = {"model_type": "inkling_text", "num_hidden_layers": 2, **family("inkling").tiny_dims}
    with pytest.raises(UnmappedModel, match="--context-parallel-size 2: Inkling's short convolutions"):
        megatron_family(config).finish_model(
            SimpleNamespace(), SimpleNamespace(context_parallel_size=2), config
        )


@pytest.mark.parametrize("form", ["inkling_text", "release"])
def test_the_recipes_gpu_form_dry_starts_on_two_cpu_ranks(form, tmp_path):
    """The command the recipe renders for 4 H200s (Megatron, TP 4 with sequence parallelism, EP 4,
    the torch_dist as --ref-load) passes miles.train's argument and checkpoint checks: at the same
    layout scaled to 2 ranks (TP 2, EP 2) and the model flags at a 4-layer tiny Inkling's sizes,
    every rank builds its model chunk and loads the converted checkpoint, then stops (--dry-start).
    The flags that act only through Transformer Engine's layer spec on a GPU (which the CPU
    start refuses, miles.megatron.options) are left out: this is the CPU, and only those. The
    checkpoint is a tiny inkling_text, and the release's form (inkling_mm_model, what the recipe's
    slice of the published checkpoint is)."""
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist
    from miles.families import read_config

    argv, hf, ref = dry.gpu_command("inkling", tmp_path)
    assert ref.name == "Inkling-Small-4layer_torch_dist"
    # under the name the plan gives the prepared checkpoint: the published layer pattern at 4 layers
    # (dense layers 0-1, global layer 3 with the window every 6th... of a 4-layer slice: all sliding but
    # one global layer here, so both kinds are loaded)
    if form == "release":
        make_release_checkpoint(hf, layers=4, dense=2, local=(0, 1, 2))
    else:
        make_tiny_checkpoint("inkling", 4, hf, dense_mlp_idx=2, local_layer_ids=[0, 1, 2])
    ref.mkdir()
    convert_to_torch_dist(hf, ref, "inkling")
    dry.scale(argv, "inkling", read_config(hf))
    gpu_only = dry.without_gpu_only(argv)
    assert all("Transformer Engine" in why for why in gpu_only.values()), gpu_only
    out = dry.dry_start(argv)
    assert "tp2·pp1·cp1·ep2·etp1+sp" in out and f"holds {ref}; no rollout" in out, out[-3000:]
    assert "stand-in layer spec" in out and "attention InklingAttention" in out, out[-3000:]


def test_the_key_names_transformers_accepts_for_a_key_are_read_as_that_key():
    import torch

    from miles.families import family
    from miles.families.transformer import transformer_config
    from miles.megatron.checkpoint import single_process_group

    config = {"model_type": "inkling_text", "num_hidden_layers": 2, **family("inkling").tiny_dims}
    config["num_local_experts"] = config.pop("n_routed_experts")  # InklingTextConfig.attribute_map
    config["embedding_multiplier"] = config.pop("logits_mup_width_multiplier")
    tc = transformer_config(config, dtype=torch.float32)
    assert tc.num_moe_experts == 8
    with single_process_group():
        assert family("inkling").block_spec(tc, config).layer_norm.params["mup"] == 16.0
