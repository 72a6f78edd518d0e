"""Step bookkeeping and the pure parts of the steps: manifests, atomic dirs, FP8 math, trim names."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.ckpt.errors import CheckpointError
from miles.ckpt.families import layers_in_name
from miles.ckpt.fp8 import dequantize_blockwise, quantize_blockwise, should_quantize
from miles.ckpt.fp8_rules import modules_to_not_convert
from miles.ckpt.manifest import atomic_dir, clean_stale, fingerprint, finished, read_manifest, write_manifest
from miles.ckpt.progress import Progress
from miles.ckpt.shards import TensorInfo
from miles.ckpt.trim import trim_config, trimmed_name

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def test_atomic_dir_appears_only_complete_and_with_its_manifest(tmp_path: Path):
    final = tmp_path / "out"
    with atomic_dir(final, reads=(), replaces=("fp8",)) as tmp:
        (tmp / "a.txt").write_text("x")
        assert not final.exists()
        write_manifest(tmp, "fp8", "in", {"block": 128})
    assert (final / "a.txt").read_text() == "x"
    assert finished(final, "fp8", "in", {"block": 128})
    assert not finished(final, "fp8", "other-input", {"block": 128})
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_failing_step_leaves_nothing_and_keeps_the_previous_output(tmp_path: Path):
    final = tmp_path / "out"
    with atomic_dir(final, reads=(), replaces=("s",)) as tmp:
        (tmp / "old").write_text("1")
        write_manifest(tmp, "s", "i", {})
    with pytest.raises(RuntimeError), atomic_dir(final, reads=(), replaces=("s",)) as tmp:
        (tmp / "new").write_text("2")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in final.iterdir()) == [".miles-ckpt.json", "old"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_directory_not_written_by_miles_is_never_replaced(tmp_path: Path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine").write_text("keep")
    with (
        pytest.raises(CheckpointError, match="was not written by miles"),
        atomic_dir(tmp_path / "out", reads=(), replaces=("s",)) as tmp,
    ):
        write_manifest(tmp, "s", "i", {})
    assert (tmp_path / "out" / "mine").read_text() == "keep"


def test_killed_runs_leftovers_are_cleaned_but_other_models_are_not(tmp_path: Path):
    for name in (".Qwen2.partial-11", ".Qwen2.stale-12", ".Qwen2.5.partial-13"):
        (tmp_path / name).mkdir()
    clean_stale(tmp_path / "Qwen2")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".Qwen2.5.partial-13"]


def test_manifest_records_sizes_and_hashes_and_a_truncated_file_is_not_finished(tmp_path: Path):
    (tmp_path / "w.bin").write_bytes(b"abcdef")
    write_manifest(tmp_path, "trim", "in", {"layers": 4})
    m = read_manifest(tmp_path)
    assert m.files["w.bin"].size == 6 and m.params == {"layers": 4}
    (tmp_path / "w.bin").write_bytes(b"abc")
    assert not finished(tmp_path, "trim", "in", {"layers": 4})


def test_fingerprint_of_a_foreign_dir_changes_with_its_content(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    before = fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"a": 1}')
    assert fingerprint(tmp_path) != before


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 5), (128, 129)])
def test_fp8_dequantize_is_within_the_e4m3_error_bound_of_each_tile(shape):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(*shape, generator=g) * torch.logspace(-3, 1, shape[1])).bfloat16()
    w[0, 0] = 0.0
    q, scale = quantize_blockwise(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    back = dequantize_blockwise(q, scale, torch.float32)
    tile_scale = scale.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    x = w.float()
    # e4m3 keeps 3 mantissa bits: rounding error <= 2^-4 relative in the normal range and
    # <= 2^-10 absolute (in units of the tile scale) in the subnormal range.
    bound = torch.maximum(x.abs() * 2**-4, tile_scale * 2**-10) * (1 + 1e-6)
    assert torch.all((back - x).abs() <= bound)
    amax = x.abs().amax()
    assert torch.isclose(scale.max(), amax / 448)


def test_fp8_all_zero_tile_has_a_finite_scale_and_stays_zero():
    q, scale = quantize_blockwise(torch.zeros(128, 128, dtype=torch.bfloat16))
    assert torch.isfinite(scale).all() and scale.item() > 0
    assert torch.equal(dequantize_blockwise(q, scale), torch.zeros(128, 128, dtype=torch.bfloat16))


@pytest.mark.parametrize("shape", [(513, 8192), (576, 7168)])
def test_fp8_quantizes_tensors_that_span_several_strips(shape):
    # 513x8192 bf16 is 8.4 MB: more than one 8 MB strip, with a scale row shared by none
    g = torch.Generator().manual_seed(2)
    w = torch.randn(*shape, generator=g).bfloat16()
    q, scale = quantize_blockwise(w)
    assert scale.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    tiles = torch.nn.functional.pad(w.float().abs(), (0, -shape[1] % 128, 0, -shape[0] % 128))
    amax = tiles.reshape(scale.shape[0], 128, scale.shape[1], 128).amax(dim=(1, 3))
    assert torch.equal(scale, amax / 448)
    back = dequantize_blockwise(q, scale, torch.float32)
    assert torch.all((back - w.float()).abs() <= w.float().abs() * 2**-4 + scale.max() * 2**-10)


def test_fp8_power_of_two_scales_cover_each_tile_exactly():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)).bfloat16() * 3
    q, scale = quantize_blockwise(w, pow2_scales=True)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    assert torch.all(q.float().abs() <= 448)
    assert torch.all(q.float().abs().amax() > 224)  # the smallest power of two that fits
    back = dequantize_blockwise(q, scale, torch.float32)
    assert torch.all((back - w.float()).abs() <= w.float().abs() * 2**-4 + scale.max() * 2**-10)


@pytest.mark.parametrize(
    "bad,kind", [(float("nan"), "NaN"), (float("inf"), r"\+Inf"), (-float("inf"), "-Inf")]
)
def test_fp8_refuses_non_finite_values_naming_the_index(bad, kind):
    w = torch.randn(600, 8192).bfloat16()
    w[515, 4000] = bad
    with pytest.raises(CheckpointError, match=rf"{kind} at index \[515, 4000\]"):
        quantize_blockwise(w)


@pytest.mark.parametrize(
    "name,shape,quantized",
    [
        ("model.layers.0.self_attn.q_proj.weight", (4, 4), True),
        ("model.layers.0.mlp.experts.3.down_proj.weight", (4, 4), True),
        ("model.language_model.layers.2.mlp.up_proj.weight", (4, 4), True),
        ("model.llm.layers.2.attn.wq_du.weight", (4, 4), True),
        ("model.layers.0.mlp.experts.gate_up_proj", (2, 4, 4), True),
        ("model.layers.0.mlp.experts.down_proj", (2, 4, 4), True),
        ("mtp.0.e_proj.weight", (4, 4), True),
        ("model.layers.61.eh_proj.weight", (4, 8), False),
        ("model.layers.0.attn.compressor.wgate.weight", (4, 4), False),
        ("model.layers.0.attn.indexer.compressor.wkv.weight", (4, 4), False),
        ("model.layers.0.attn.wo_a.weight", (4, 4), False),
        ("model.layers.0.self_attn.indexer.weights_proj.weight", (2, 4), False),
        ("model.layers.0.self_attn.indexer.wk.weight", (4, 4), True),
        ("model.layers.0.mlp.gate.weight", (8, 4), False),
        ("model.layers.0.ffn.gate.weight", (8, 4), False),
        ("model.layers.61.shared_head.head.weight", (9, 4), False),
        ("model.embed_tokens.weight", (9, 4), False),
        ("lm_head.weight", (9, 4), False),
        ("head.weight", (9, 4), False),
        ("model.visual.blocks.0.attn.qkv.weight", (12, 4), False),
        ("model.vision_tower.encoder_layers.0.projection.weight", (4, 4), False),
        ("model.mm_projector.0.weight", (4, 4), False),
        ("model.layers.0.input_layernorm.weight", (4,), False),
        ("model.layers.0.self_attn.q_norm.weight", (4, 4), False),
        ("model.layers.0.mlp.shared_experts.gate_proj", (1, 4, 4), False),
        ("model.layers.0.self_attn.o_proj.bias", (4, 4), False),
    ],
)
def test_fp8_skip_list(name, shape, quantized):
    info = TensorInfo(name, "BF16", shape, 0, 2 * math.prod(shape))
    assert should_quantize(info) is quantized


def test_modules_to_not_convert_names_kept_linears_never_a_parent_of_quantized_ones():
    kept = ["model.layers.0.mlp.gate.weight", "lm_head.weight", "model.layers.0.attn.compressor.wkv.weight"]
    quantized = ["model.layers.0.attn.wq_a.weight", "model.layers.0.mlp.experts.gate_up_proj"]
    assert modules_to_not_convert(kept, quantized) == [
        "lm_head", "model.layers.0.attn.compressor.wkv", "model.layers.0.mlp.gate",
    ]  # fmt: skip
    # a parameter of the decoder layer itself would name the layer, which holds quantized linears
    assert modules_to_not_convert(["model.layers.0.weight"], quantized) == []


def test_trim_keeps_low_layers_drops_the_rest_and_renumbers_mtp_layers():
    assert trimmed_name("model.embed_tokens.weight", 4, 61) == "model.embed_tokens.weight"
    assert trimmed_name("model.layers.3.mlp.up_proj.weight", 4, 61) == "model.layers.3.mlp.up_proj.weight"
    assert trimmed_name("model.layers.4.mlp.up_proj.weight", 4, 61) is None
    assert trimmed_name("model.layers.61.eh_proj.weight", 4, 61) == "model.layers.4.eh_proj.weight"
    assert trimmed_name("model.language_model.layers.9.x", 4, 61) is None
    assert trimmed_name("model.visual.blocks.9.x", 4, 61) == "model.visual.blocks.9.x"
    assert trimmed_name("model.llm.layers.9.attn.wq_du.weight", 4, 61) is None  # Inkling's published naming


def test_trim_config_cuts_every_per_layer_list():
    config = {
        "num_hidden_layers": 6,
        "layer_types": ["a"] * 6,
        "mlp_layer_types": ["dense"] + ["sparse"] * 5,
        "mlp_only_layers": [0, 5],
        "text_config": None,
    }
    out = trim_config(config, 2)
    assert out["num_hidden_layers"] == 2 and out["layer_types"] == ["a", "a"]
    assert out["mlp_layer_types"] == ["dense", "sparse"] and out["mlp_only_layers"] == [0]
    nested = trim_config({"text_config": {"num_hidden_layers": 6, "layer_types": ["x"] * 6}}, 3)
    assert nested["text_config"] == {"num_hidden_layers": 3, "layer_types": ["x"] * 3}


def test_layer_count_is_read_from_the_model_name():
    assert layers_in_name("Inkling-Small-4layer") == 4
    assert layers_in_name("Qwen3-30B-A3B-5layers") == 5
    assert layers_in_name("Qwen3-4B") is None


def test_progress_line_shows_bytes_tensors_rate_and_eta():
    out = io.StringIO()
    p = Progress("fp8 X", 2_000_000_000, 10, stream=out, interval=0)
    p._start -= 10  # as if 10 s had passed
    p.advance(1_000_000_000, 5)
    line = out.getvalue().strip()
    assert line.startswith("fp8 X: 1.0 GB/2.0 GB  5/10 tensors  100.0 MB/s  ETA 0:10"), line


def test_progress_is_silent_when_disabled():
    out = io.StringIO()
    with Progress("x", 10, enabled=False, stream=out, interval=0) as p:
        p.advance(5)
    assert out.getvalue() == "" and os.linesep not in out.getvalue()
