"""DeepSeek-V4's torch_dist, as prepare-ckpt writes it: the model's own keys, loaded back equal, with
transformers' logits.

The converter prepare-ckpt runs turns the tiny bfloat16 DeepSeek-V4 checkpoint (Flash's switches)
into megatron keys through the family's mapping (its own model, not a GPTModel), loads it back and
compares every tensor and, on a 320-token probe (past the sliding window, two heavily compressed
entries, more compressed entries than the indexer keeps), the logits with transformers'. The
hash-routing table stays int64, the parameters transformers keeps in float32 (sinks, compressor
position biases, hyper-connections, norms) stay float32 in a bfloat16 model, and common.pt records
the Megatron-LM arguments of the seed's DeepSeek-V4 job. DeepSeek's published tensor names convert
to the same release.
"""

from __future__ import annotations

import json

import pytest
import torch

from miles.ci.register import register_cpu_ci
from tests.support import dry_start as dry

register_cpu_ci(est_time=10, suite="stage-b-cpu")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    root = tmp_path_factory.mktemp("dsv4")
    hf = make_tiny_checkpoint("deepseek_v4", 4, root / "hf", progress=False)
    out = root / "torch_dist"
    out.mkdir()
    convert_to_torch_dist(hf, out, "deepseek_v4")  # raises unless it loads back equal, logits within 1e-4
    return hf, out


def test_the_probe_reaches_every_attention_path(converted):
    from miles.families.model import probe_tokens

    config = json.loads((converted[0] / "config.json").read_text())
    length = probe_tokens(config).shape[1]
    assert length > config["sliding_window"]
    assert length // config["compress_rates"]["heavily_compressed_attention"] >= 2
    assert length // config["compress_rates"]["compressed_sparse_attention"] > config["index_topk"]


def test_torch_dist_holds_the_models_keys_dtypes_and_transformers_logits(converted):
    from miles.ckpt.shards import CheckpointReader
    from miles.ckpt.torch_dist import RELEASE, read_common
    from miles.families.model import hf_logit_gap, load_model
    from miles.megatron.checkpoint import single_process_group
    from miles.megatron.compat import cpu_placed

    hf, out = converted
    config = json.loads((hf / "config.json").read_text())
    common = read_common(out / RELEASE)
    assert common["miles"] == {"layout": "megatron-gpt", "model_type": "deepseek_v4"}
    args = vars(common["args"])
    assert args["experimental_attention_variant"] == "dsv4" and args["dsv4_hc_mult"] == 4
    assert args["dsv4_compress_ratios"] == [0, 0, 4, 128, 0]  # 4 layers, then the sliding MTP layer
    assert args["dsv4_n_hash_layers"] == 3 and args["mtp_num_layers"] == 1
    with single_process_group(), cpu_placed():
        assert hf_logit_gap(hf, load_model(config, out / RELEASE, dtype=torch.float32), config) <= 1e-5
        state = load_model(config, out / RELEASE, dtype=torch.bfloat16).state_dict()
    assert state["decoder.layers.0.self_attention.wq_a.weight"].dtype == torch.bfloat16
    for kept in ("self_attention.attn_sink", "hc_attn.fn", "input_layernorm.weight"):
        assert state[f"decoder.layers.3.{kept}"].dtype == torch.float32, kept
    assert state["decoder.layers.3.self_attention.compressor.ape"].dtype == torch.float32
    assert state["decoder.layers.3.mlp.router.expert_bias"].dtype == torch.float32
    with CheckpointReader(hf) as reader:
        for i in range(3):  # the hash-routed layers
            table = state[f"decoder.layers.{i}.mlp.router.tid2eid"]
            assert table.dtype == torch.int64
            assert torch.equal(table, reader.read(f"model.layers.{i}.ffn.gate.tid2eid"))
    assert "mtp.layers.0.transformer_layer.self_attention.wq_a.weight" in state


def test_published_names_convert_to_the_same_release(converted, tmp_path):
    from safetensors.torch import load_file, save_file

    from miles.ckpt.shards import INDEX_NAME
    from miles.ckpt.torch_dist import RELEASE, convert_to_torch_dist
    from miles.families.deepseek_v4 import published_name

    hf, out = converted
    published = tmp_path / "published"
    published.mkdir()
    index = json.loads((hf / INDEX_NAME).read_text())
    renamed = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {published_name(k): v for k, v in load_file(hf / shard).items()}
        save_file(tensors, published / shard, metadata={"format": "pt"})
        renamed.update(dict.fromkeys(tensors, shard))
    assert "embed.weight" in renamed and "model.embed_tokens.weight" not in renamed
    (published / INDEX_NAME).write_text(json.dumps({**index, "weight_map": renamed}))
    (published / "config.json").write_text((hf / "config.json").read_text())
    again = tmp_path / "torch_dist"
    again.mkdir()
    convert_to_torch_dist(published, again, "deepseek_v4")
    for name in sorted(p.name for p in (out / RELEASE).iterdir()):
        assert (again / RELEASE / name).read_bytes() == (out / RELEASE / name).read_bytes(), name


def test_the_recipes_gpu_form_dry_starts_on_two_cpu_ranks(tmp_path):
    """The command the recipe renders for 4 H200s (Megatron, TP 4 with sequence parallelism, EP 4,
    the torch_dist as --ref-load) passes miles.train's argument and checkpoint checks: at the same
    layout scaled to 2 ranks (TP 2, EP 2) and the model flags at the 4-layer tiny DeepSeek-V4's
    sizes, every rank builds its model chunk and loads the converted checkpoint, then stops
    (--dry-start). The flags that act only on a GPU (Transformer Engine's layer spec, the optimizer's
    CPU offload from GPU memory), which the CPU start refuses (miles.megatron.options), are left out:
    this is the CPU, and only those."""
    from miles.ckpt.tiny import make_tiny_checkpoint
    from miles.ckpt.torch_dist import convert_to_torch_dist

    argv, hf, ref = dry.gpu_command("deepseek_v4", tmp_path)
    assert ref.name == "DeepSeek-V4-Flash-4layer_torch_dist"
    make_tiny_checkpoint("deepseek_v4", 4, hf)  # under the name the plan gives the prepared checkpoint
    ref.mkdir()
    convert_to_torch_dist(hf, ref, "deepseek_v4")
    config = json.loads((hf / "config.json").read_text())
    # the tiny model stretches the compressed layers' YaRN over 256 positions, Flash over 65536
    original = config["rope_parameters"]["compress"]["original_max_position_embeddings"]
    dry.scale(argv, "deepseek_v4", config, **{"--original-max-position-embeddings": original})
    gpu_only = dry.without_gpu_only(argv)
    assert set(gpu_only) == {
        "--moe-grouped-gemm", "--transformer-impl", "--optimizer-cpu-offload", "--overlap-cpu-optimizer-d2h-h2d",
        "--use-precision-aware-optimizer",
    }, gpu_only  # fmt: skip
    assert all("Transformer Engine" in why or "needs a GPU" in why for why in gpu_only.values()), gpu_only
    out = dry.dry_start(argv)
    assert "tp2·pp1·cp1·ep2·etp1+sp" in out and f"holds {ref}; no rollout" in out, out[-3000:]
    assert "miles.families.deepseek_v4.model.Model" in out, out[
        -3000:
    ]  # the first line names the family's own model
