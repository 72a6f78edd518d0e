"""torch_dist checkpoints: Megatron's layout, loaded back by megatron-core equal to the HF weights.

For Qwen3 and Qwen3-MoE the loaded megatron-core modules (local layer spec, on CPU) must
compute what the Hugging Face modules compute: that is what proves the fused QKV and
gate/up layouts, not just that bytes round-trip.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.ci.register import register_cpu_ci
from miles.ckpt.plan import FAMILIES
from miles.ckpt.shards import CheckpointReader
from miles.ckpt.torch_dist import RELEASE, SHARDED_METADATA, TRACKER, convert_to_torch_dist
from miles.families import layout
from miles.families.model import build_model
from miles.megatron.checkpoint import single_process_group

register_cpu_ci(est_time=10, suite="stage-b-cpu")


@pytest.fixture(scope="module")
def torch_dist_of(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("torch_dist")
    made = {}

    def get(name: str):
        if name not in made:
            out = root / name
            out.mkdir()
            convert_to_torch_dist(tiny(name), out, name)
            made[name] = out
        return made[name]

    return get


@pytest.mark.parametrize("name", FAMILIES)
def test_torch_dist_has_megatrons_layout_and_loads_back_equal(tiny, torch_dist_of, name):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    out = torch_dist_of(name)
    assert (out / TRACKER).read_text() == RELEASE
    release = out / RELEASE
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    assert {"common.pt", ".metadata"} <= {p.name for p in release.iterdir()}
    assert any(p.suffix == ".distcp" for p in release.iterdir())
    with single_process_group(), CheckpointReader(tiny(name)) as hf:
        if name in ("qwen2", "qwen3", "qwen3_moe"):  # GPTModel's keys, layers stacked
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert "decoder.layers.self_attention.linear_qkv.weight" in keys
            assert ("decoder.layers.self_attention.linear_qkv.bias" in keys) is (name == "qwen2")
            assert "embedding.word_embeddings.weight" in keys
            tied = json.loads((tiny(name) / "config.json").read_text())["tie_word_embeddings"]
            # Qwen3-4B ties its output layer to the embedding; Qwen3-30B-A3B has its own
            assert ("output_layer.weight" in keys) is (not tied)
            return
        if name == "mimo":
            # Qwen2's layers stacked, and the carried MTP layer (its q/k/v biases) under megatron-core's MTP keys
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert {"decoder.layers.self_attention.linear_qkv.bias", "output_layer.weight", "mtp.layers.0.eh_proj.weight",
                    "mtp.layers.0.transformer_layer.self_attention.linear_qkv.bias"} <= keys  # fmt: skip
            return
        if name == "glm4_moe_lite":
            # a dense and MoE layers of megatron-core's own MLA, the carried MTP layer: keyed layer by layer
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert "decoder.layers.0.mlp.linear_fc1.weight" in keys
            assert not any(".indexer." in k for k in keys)
            assert {"decoder.layers.1.mlp.router.expert_bias", "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                    "mtp.layers.0.eh_proj.weight", "mtp.layers.0.transformer_layer.mlp.router.weight"} <= keys  # fmt: skip
            return
        if name == "glm_moe_dsa":
            # dense and MoE layers, with and without an indexer: megatron keys them layer by layer
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert "decoder.layers.2.self_attention.core_attention.indexer.linear_wq_b.weight" in keys
            assert not any(
                k.startswith("decoder.layers.3.") and ".indexer." in k for k in keys
            )  # a shared layer
            assert {"decoder.layers.1.mlp.router.expert_bias", "mtp.layers.0.eh_proj.weight"} <= keys
            return
        if name == "inkling":
            # a sliding and a global layer (their relative-bias banks differ in extent), a dense and
            # an MoE layer: megatron keys them layer by layer
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert {
                "embedding.embed_norm.weight", "decoder.layers.0.self_attention.rel_proj.weight",
                "decoder.layers.0.mlp.global_scale", "decoder.layers.1.mlp.router.global_scale",
                "decoder.layers.1.mlp.shared_experts.experts.1.linear_fc2.weight",
                "decoder.layers.1.self_attention.k_sconv.weight", "decoder.layers.1.mlp.mlp_sconv.weight",
            } <= keys  # fmt: skip
            return
        if name == "qwen3_5_moe":
            # linear and full layers keyed layer by layer; the gated delta net's in_proj and conv1d saved as
            # megatron-core splits them (each part TP-independent); the carried MTP layer; no vision tower
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert {
                "decoder.layers.0.self_attention.in_proj.weight.z", "decoder.layers.0.self_attention.conv1d.weight.key",
                "decoder.layers.0.self_attention.A_log", "decoder.layers.3.self_attention.linear_qkv.weight",
                "decoder.layers.3.mlp.shared_experts.gate_weight", "mtp.layers.0.eh_proj.weight",
            } <= keys  # fmt: skip
            assert not any("visual" in k for k in keys)
            return
        if name == "deepseek_v4":
            # its own model's keys: a CSA layer's indexer, hash-routing tables, the carried MTP layer
            # (tests/megatron/test_megatron_dsv4_ckpt.py loads them back against transformers)
            keys = {k for k in dist_checkpointing.load_tensors_metadata(str(release))}
            assert "decoder.layers.2.self_attention.indexer.linear_wq_b.weight" in keys
            assert {"decoder.layers.0.mlp.router.tid2eid", "decoder.hc_head.hc_head_fn"} <= keys
            assert "mtp.layers.0.e_proj.weight" in keys
            return
        template = {}
        for tensor in hf.files.weight_map:
            like = hf.read(tensor)
            template[tensor] = ShardedTensor.from_rank_offsets(tensor, torch.empty_like(like), replica_id=0)
        loaded = dist_checkpointing.load(template, str(release))
        for tensor in hf.files.weight_map:
            assert torch.equal(loaded[tensor], hf.read(tensor)), tensor


@pytest.mark.parametrize("name", FAMILIES)
def test_torch_dist_records_the_sharded_state_metadata_it_was_written_with(torch_dist_of, name):
    # Megatron-LM rebuilds its sharded keys from this record; without it a loader falls back
    # to metadata of its own, which need not name the keys this checkpoint holds.
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(torch_dist_of(name) / RELEASE))
    assert dist_checkpointing.load_content_metadata(preloaded_state_dict=common) == SHARDED_METADATA


def _megatron_from(torch_dist_dir, config):
    from megatron.core import dist_checkpointing

    model = build_model(config)
    common = dist_checkpointing.load_common_state_dict(str(torch_dist_dir / RELEASE))
    metadata = dist_checkpointing.load_content_metadata(preloaded_state_dict=common)
    state = dist_checkpointing.load(
        model.sharded_state_dict(metadata=metadata), str(torch_dist_dir / RELEASE)
    )
    model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    return model.float().eval()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_loaded_megatron_attention_computes_what_hf_attention_computes(tiny, torch_dist_of, name):
    config = json.loads((tiny(name) / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tiny(name), dtype=torch.float32).eval()
    x = torch.randn(6, 1, config["hidden_size"], generator=torch.Generator().manual_seed(0))
    with single_process_group(), torch.no_grad():
        mg = _megatron_from(torch_dist_of(name), config)
        for i in (0, config["num_hidden_layers"] - 1):
            attn, ref = mg.decoder.layers[i].self_attention, hf.model.layers[i].self_attn
            # The TE layout fuses the input norm into linear_qkv.
            normed = hf.model.layers[i].input_layernorm(x)
            q, k, v = attn.get_query_key_value_tensors(x)[:3]
            d = config["head_dim"]
            assert torch.allclose(q, ref.q_norm(ref.q_proj(normed).unflatten(-1, (-1, d))), atol=1e-5)
            assert torch.allclose(k, ref.k_norm(ref.k_proj(normed).unflatten(-1, (-1, d))), atol=1e-5)
            assert torch.allclose(v, ref.v_proj(normed).unflatten(-1, (-1, d)), atol=1e-5)
            assert torch.equal(attn.linear_proj.weight, ref.o_proj.weight)
        assert torch.equal(mg.embedding.word_embeddings.weight, hf.model.embed_tokens.weight)
        # with tied embeddings (Qwen3-4B) megatron's output layer has no weight of its own
        output = (
            mg.output_layer.weight
            if not config["tie_word_embeddings"]
            else mg.shared_embedding_or_output_weight()
        )
        assert torch.equal(output, hf.lm_head.weight)
        assert torch.equal(mg.decoder.final_layernorm.weight, hf.model.norm.weight)


def test_loaded_megatron_dense_mlp_computes_what_hf_mlp_computes(tiny, torch_dist_of):
    config = json.loads((tiny("qwen3") / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tiny("qwen3"), dtype=torch.float32).eval()
    x = torch.randn(6, 1, config["hidden_size"], generator=torch.Generator().manual_seed(1))
    with single_process_group(), torch.no_grad():
        mg = _megatron_from(torch_dist_of("qwen3"), config)
        for i in range(config["num_hidden_layers"]):
            out, _ = mg.decoder.layers[i].mlp(x)  # the TE layout fuses the norm into linear_fc1
            expected = hf.model.layers[i].mlp(hf.model.layers[i].post_attention_layernorm(x))
            assert torch.allclose(out, expected, atol=1e-5)


def test_loaded_megatron_experts_and_router_hold_the_hf_experts(tiny, torch_dist_of):
    path = tiny("qwen3_moe")
    config = json.loads((path / "config.json").read_text())
    x = torch.randn(5, config["hidden_size"], generator=torch.Generator().manual_seed(2))
    with single_process_group(), torch.no_grad(), CheckpointReader(path) as hf:
        mg = _megatron_from(torch_dist_of("qwen3_moe"), config)
        layer = mg.decoder.layers[1].mlp
        assert torch.equal(layer.router.weight, hf.read("model.layers.1.mlp.gate.weight").float())
        for e in (0, 7):
            w = {
                p: hf.read(f"model.layers.1.mlp.experts.{e}.{p}_proj.weight").float()
                for p in ("gate", "up", "down")
            }
            expected = (torch.nn.functional.silu(x @ w["gate"].T) * (x @ w["up"].T)) @ w["down"].T
            out, _ = layer.experts.local_experts[e](x)
            assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "inkling"])
def test_layout_fills_every_row_of_every_megatron_weight_exactly_once(tiny, name):
    from miles.megatron.compat import cpu_placed

    config = json.loads((tiny(name) / "config.json").read_text())
    with single_process_group(), cpu_placed():  # a router with an expert bias is built on the CPU here
        shapes = {
            k: tuple(v.shape)
            for k, v in build_model(config).state_dict().items()
            if not k.endswith("_extra_state")
        }
    placed = dict(layout(config))
    assert set(placed) == set(shapes)
    for tensor, pieces in placed.items():
        rows = sorted((p.at, p.at + p.stop - p.start) for p in pieces)
        assert rows[0][0] == 0 and rows[-1][1] == shapes[tensor][0], tensor
        assert all(a[1] == b[0] for a, b in zip(rows, rows[1:], strict=False)), tensor  # no gap, no overlap


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_common_pt_carries_the_args_megatron_lm_checks_on_load(tiny, torch_dist_of, name):
    # Megatron-LM's load_checkpoint reads the TP/PP sizes the checkpoint was written with, and
    # check_checkpoint_args compares these three with the run's arguments without a default.
    from megatron.core import dist_checkpointing

    config = json.loads((tiny(name) / "config.json").read_text())
    args = dist_checkpointing.load_common_state_dict(str(torch_dist_of(name) / RELEASE))["args"]
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
    )
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (1, 1)
    assert args.num_query_groups == config["num_key_value_heads"] and args.kv_channels == config["head_dim"]
    assert args.untie_embeddings_and_output_weights is (not config["tie_word_embeddings"])
    assert args.rotary_base == config["rope_parameters"]["rope_theta"]


def test_families_without_a_megatron_layout_carry_no_megatron_args(tiny, tmp_path, inkling_unbuilt):
    from megatron.core import dist_checkpointing

    out = tmp_path / "torch_dist"
    out.mkdir()
    convert_to_torch_dist(tiny("inkling"), out, "inkling")  # as while the backend did not build Inkling
    common = dist_checkpointing.load_common_state_dict(str(out / RELEASE))
    assert common["miles"]["layout"] == "hf-names" and "args" not in common


@pytest.mark.parametrize("name", ["qwen3", "glm_moe_dsa"])
def test_a_nan_in_the_source_is_reported_as_a_broken_source_not_a_rerun(tiny_copy, tmp_path, name):
    from miles.ckpt.errors import CheckpointError
    from miles.ckpt.shards import read_header, read_weight_map

    path = tiny_copy(name)
    tensor = (
        "model.layers.1.mlp.down_proj.weight" if name == "qwen3" else "model.layers.0.mlp.down_proj.weight"
    )
    shard = path / read_weight_map(path).weight_map[tensor]
    header = read_header(shard)
    cols = header.tensors[tensor].shape[1]
    with open(shard, "r+b") as f:
        f.seek(header.offset(header.tensors[tensor]) + 2 * (3 * cols + 4))
        f.write(b"\xc0\x7f")  # bf16 NaN at [3, 4]
    out = tmp_path / "td"
    out.mkdir()
    with pytest.raises(
        CheckpointError, match=rf"tensor {tensor} holds NaN/Inf \(first at index \[3, 4\]\)"
    ) as info:
        convert_to_torch_dist(path, out, name)
    assert "a rerun cannot fix it" in str(info.value) and "rerun the step" not in str(info.value)


def test_an_fp8_checkpoint_is_refused_before_anything_is_written(fp8_of, tmp_path):
    # float8 blocks cast without their scales would load as wrong weights and still compare equal to
    # the (equally unscaled) source tensors
    from miles.ckpt.errors import CheckpointError

    src = fp8_of("qwen3")
    out = tmp_path / "td"
    out.mkdir()
    with pytest.raises(
        CheckpointError, match=r"a quantized checkpoint \(quantization_config quant_method 'fp8'; "
    ):
        convert_to_torch_dist(src, out, "qwen3")
    assert list(out.iterdir()) == []
    with pytest.raises(CheckpointError, match=rf"python -m miles.ckpt dequantize {src} <dir>"):
        convert_to_torch_dist(src, out, "qwen3")
