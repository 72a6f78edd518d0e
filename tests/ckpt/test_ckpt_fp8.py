"""FP8 checkpoints: every tile within the e4m3 bound, the rest byte-identical, and transformers agrees."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from miles.ci.register import register_cpu_ci
from miles.ckpt.families import family
from miles.ckpt.fp8 import SCALE_SUFFIX, convert_from_fp8, convert_to_fp8, should_quantize
from miles.ckpt.plan import FAMILIES
from miles.ckpt.shards import CheckpointReader, read_weight_map
from miles.ckpt.validate import validate_checkpoint

register_cpu_ci(est_time=30, suite="stage-b-cpu")


@pytest.fixture(scope="module")
def fp8_of(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    made = {}

    def get(name: str):
        if name not in made:
            out = root / name
            out.mkdir()
            convert_to_fp8(tiny(name), out, workers=2)
            made[name] = out
        return made[name]

    return get


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
            rows, cols = q.shape
            full = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            x = original.float()
            bound = torch.maximum(x.abs() * 2**-4, full * 2**-10) * (1 + 1e-6)
            assert torch.all((q.float() * full - x).abs() <= bound), tensor
    assert quantized > 0


def test_fp8_config_and_index_describe_the_new_shards(fp8_of):
    out = fp8_of("qwen3_moe")
    config = json.loads((out / "config.json").read_text())
    q = config["quantization_config"]
    assert (q["quant_method"], q["fmt"], q["activation_scheme"], q["weight_block_size"]) == (
        "fp8",
        "e4m3",
        "dynamic",
        [128, 128],
    )
    assert {"lm_head", "model.embed_tokens", "mlp.gate"} <= set(q["modules_to_not_convert"])
    index = json.loads((out / "model.safetensors.index.json").read_text())
    with CheckpointReader(out) as reader:
        total = sum(reader.info(n)[1].nbytes for n in reader.files.weight_map)
    assert index["metadata"]["total_size"] == total
    assert "model.layers.0.mlp.experts.0.up_proj.weight" + SCALE_SUFFIX in index["weight_map"]
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


@pytest.mark.parametrize("name", FAMILIES)
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
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention)
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.allclose(logits[0], logits[1], atol=1e-5, rtol=1e-4)
