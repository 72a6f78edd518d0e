"""FP8 checkpoints: every tile within the e4m3 bound, the rest byte-identical, the serving side's skip list."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.ci.register import register_cpu_ci
from miles.ckpt.dequantize import convert_from_fp8
from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import family
from miles.ckpt.fp8 import SCALE_SUFFIX, convert_to_fp8, dequantize_tensor, should_quantize
from miles.ckpt.plan import FAMILIES
from miles.ckpt.shards import CheckpointReader, read_header, read_weight_map
from miles.ckpt.validate import validate_checkpoint
from tests.support.ckpt import trunk_of

register_cpu_ci(est_time=4, suite="stage-b-cpu")


def _dtypes(path) -> dict[str, str]:
    with CheckpointReader(path) as reader:
        return {n: reader.info(n)[1].dtype for n in reader.files.weight_map}


def _quantization_config(path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("name", FAMILIES)
def test_fp8_checkpoint_keeps_every_tile_within_the_e4m3_bound_and_the_rest_exact(tiny, fp8_of, name):
    src, out = tiny(name), fp8_of(name)
    validate_checkpoint(out, name, expect_layers=4)
    quantized = 0
    with CheckpointReader(src) as a, CheckpointReader(out) as b:
        for tensor in a.files.weight_map:
            _, info = a.info(tensor)
            original = a.read(tensor)
            if not should_quantize(info):
                assert torch.equal(b.read(tensor), original), tensor
                continue
            quantized += 1
            q, scale = b.read(tensor), b.read(tensor + SCALE_SUFFIX)
            assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
            back, grid = dequantize_tensor(tensor, q, scale, torch.float32, grid=True)
            x = original.float()
            bound = torch.maximum(x.abs() * 2**-4, grid * 2**-10) * (1 + 1e-6)
            assert torch.all((back - x).abs() <= bound), tensor
    assert quantized > 0


def test_fp8_config_and_index_describe_the_new_shards(fp8_of):
    out = fp8_of("qwen3_moe")
    q = _quantization_config(out)
    assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == (
        "fp8",
        "e4m3",
        "dynamic",
        [128, 128],
    )
    assert "scale_fmt" not in q  # float scales: Qwen3 has no DSA layers
    assert {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= set(q["modules_to_not_convert"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    with CheckpointReader(out) as reader:
        total = sum(reader.info(n)[1].nbytes for n in reader.files.weight_map)
    assert index["metadata"]["total_size"] == total
    assert "model.layers.0.mlp.experts.0.up_proj.weight" + SCALE_SUFFIX in index["weight_map"]
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


def test_deepseek_v4_keeps_wo_a_compressors_and_the_indexer_scorer_and_quantizes_the_mtp_block(fp8_of):
    dtypes = _dtypes(fp8_of("deepseek_v4"))
    for kept in (
        "model.layers.0.attn.wo_a.weight",
        "model.layers.3.attn.compressor.wkv.weight",  # layer 3 compresses heavily, layer 2 sparsely
        "model.layers.2.attn.compressor.wgate.weight",
        "model.layers.2.attn.indexer.weights_proj.weight",
        "model.layers.2.attn.indexer.compressor.wkv.weight",
        "model.layers.0.ffn.gate.weight",
        "head.weight",
    ):
        assert dtypes[kept] == "BF16", kept
    for quantized in ("model.layers.0.attn.wq_a.weight", "model.layers.2.attn.indexer.wq_b.weight",
                      "model.layers.0.ffn.experts.7.w2.weight", "mtp.0.e_proj.weight", "mtp.0.attn.wq_b.weight"):  # fmt: skip
        assert dtypes[quantized] == "F8_E4M3", quantized


def test_glm_keeps_the_mtp_eh_proj_and_the_indexer_scorer(fp8_of):
    dtypes = _dtypes(fp8_of("glm_moe_dsa"))
    assert dtypes["model.layers.4.eh_proj.weight"] == "BF16"  # the MTP layer after the 4 decoder layers
    assert dtypes["model.layers.4.self_attn.q_a_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.self_attn.indexer.weights_proj.weight"] == "BF16"
    assert dtypes["model.layers.0.self_attn.indexer.wk.weight"] == "F8_E4M3"
    assert "model.layers.4.eh_proj" in _quantization_config(fp8_of("glm_moe_dsa"))["modules_to_not_convert"]


def test_mimo_keeps_the_mtp_input_proj_and_quantizes_the_mtp_layers_decoder_layer(fp8_of):
    dtypes = _dtypes(fp8_of("mimo"))
    assert dtypes["model.mtp_layers.0.input_proj.weight"] == "BF16"  # SGLang's MiMo MTP: a plain nn.Linear
    assert dtypes["model.mtp_layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.mtp_layers.0.token_layernorm.weight"] != "F8_E4M3"
    assert "model.mtp_layers.0.input_proj" in _quantization_config(fp8_of("mimo"))["modules_to_not_convert"]


@pytest.mark.parametrize("name", ["deepseek_v4", "glm_moe_dsa"])
def test_dsa_models_get_ue8m0_scales_that_are_exact_powers_of_two(fp8_of, name):
    out = fp8_of(name)
    assert _quantization_config(out)["scale_fmt"] == "ue8m0"
    with CheckpointReader(out) as reader:
        scales = [reader.read(n) for n in reader.files.weight_map if n.endswith(SCALE_SUFFIX)]
    for scale in scales:
        assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


def test_fused_3d_experts_are_quantized_per_expert_with_gate_and_up_tiled_apart(tiny, fp8_of):
    out = fp8_of("inkling")
    name = "model.layers.1.mlp.experts.gate_up_proj"  # the tiny's layer 0 is dense, as the published model's
    with CheckpointReader(tiny("inkling")) as src, CheckpointReader(out) as reader:
        experts, rows, cols = src.info(name)[1].shape
        assert reader.info(name)[1].dtype == "F8_E4M3"
        scale = reader.read(name + SCALE_SUFFIX)
        down = reader.read("model.layers.1.mlp.experts.down_proj" + SCALE_SUFFIX)
        # each expert's gate half and up half has its own 128-row tiles
        assert tuple(scale.shape) == (experts, 2 * math.ceil(rows / 2 / 128), math.ceil(cols / 128))
        assert tuple(down.shape)[0] == experts
        # each expert gets its own scale: they differ because the experts' weights do
        assert len({float(s.max()) for s in scale}) == experts
    f8 = sum(i.numel for i in _infos(out) if i.dtype == "F8_E4M3")
    assert f8 / sum(i.numel for i in _infos(out) if not i.name.endswith(SCALE_SUFFIX)) > 0.6


def _infos(path):
    files = read_weight_map(path)
    return [t for s in files.shards for t in read_header(path / s).tensors.values()]


def test_fp8_refuses_a_non_finite_weight_naming_tensor_and_index(tiny_copy, tmp_path):
    path = tiny_copy("qwen3")
    tensor = "model.layers.1.mlp.up_proj.weight"
    shard = path / read_weight_map(path).weight_map[tensor]
    header = read_header(shard)
    cols = header.tensors[tensor].shape[1]
    with open(shard, "r+b") as f:
        f.seek(header.offset(header.tensors[tensor]) + 2 * (5 * cols + 7))
        f.write(b"\x80\x7f")  # bf16 +Inf at [5, 7]
    out = tmp_path / "fp8"
    out.mkdir()
    with pytest.raises(CheckpointError, match=rf"tensor {tensor}: \+Inf at index \[5, 7\]; FP8 has no form"):
        convert_to_fp8(path, out, workers=2)


_CPU_FALLBACK_GAP = pytest.mark.xfail(
    strict=True,
    reason="transformers' CPU fallback (dequantize while loading) pairs only `<module>.weight` with "
    "its `weight_scale_inv`, so fused 3-D expert tensors arrive unscaled; the GPU path (FP8Experts) "
    "reads them right, see test_ckpt_fp8_load.py",
)


@pytest.mark.parametrize(
    "name", [pytest.param(f, marks=_CPU_FALLBACK_GAP) if f == "inkling" else f for f in FAMILIES]
)
def test_transformers_reads_the_fp8_checkpoint_as_miles_dequantizes_it(fp8_of, tmp_path, name):
    # On CPU transformers' fine-grained FP8 loader dequantizes; it must see the same weights
    # as our own dequantize, so both models give the same logits.
    out = fp8_of(name)
    back = tmp_path / "back"
    back.mkdir()
    convert_from_fp8(out, back, dtype="float32")
    assert not any(n.endswith(SCALE_SUFFIX) for n in read_weight_map(back).weight_map)
    attention = "sdpa" if family(name).sdpa else "eager"
    ids = torch.randint(3, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = []
    for path in (out, back):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attention, **trunk_of(path)
        )
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-4)


def test_dequantize_restores_fused_experts_within_the_fp8_error(tiny, fp8_of, tmp_path):
    back = tmp_path / "back"
    back.mkdir()
    convert_from_fp8(fp8_of("inkling"), back, dtype="float32")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    with (
        CheckpointReader(tiny("inkling")) as src,
        CheckpointReader(back) as out,
        CheckpointReader(fp8_of("inkling")) as q,
    ):
        x, got = src.read(name).float(), out.read(name)
        _, grid = dequantize_tensor(name, q.read(name), q.read(name + SCALE_SUFFIX), torch.float32, grid=True)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert torch.all((got - x).abs() <= torch.maximum(x.abs() * 2**-4, grid * 2**-10) * (1 + 1e-6))
