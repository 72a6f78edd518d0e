"""FP8 checkpoints are validated as FP8 before a value is dequantized.

`python -m miles.ckpt dequantize` used to accept scales that are inf, NaN, negative, zero or
int32, an F8 weight with no scale (its bytes copied as they were), an E5M2 weight (read as
e4m3), a quantization_config block size the scales do not follow, and F8 bytes that encode
NaN. Each is now one line naming the tensor (and index) and the rule, exit 1, with nothing
written. The checkpoints are built here byte by byte (one decoder linear, its scale, a norm),
so each case is exactly the one named; the command is the one a user types.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.ckpt.cli import main
from miles.ckpt.fp8 import quantize_blockwise
from miles.ckpt.shards import ShardWriter, tensor_bytes

register_cpu_ci(est_time=1, suite="stage-a-cpu")

W = "model.layers.0.mlp.down_proj.weight"
S = W + "_scale_inv"
NORM = "model.layers.0.input_layernorm.weight"
QCONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _fp8_parts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, scale = quantize_blockwise(torch.randn(256, 192, generator=g).to(torch.bfloat16))
    return q, scale


def _write(root: Path, tensors: list[tuple[str, str, tuple[int, ...], bytes]], qconfig=QCONFIG) -> Path:
    root.mkdir()
    writer = ShardWriter(root / "model.safetensors", [(n, d, s) for n, d, s, _ in tensors], {"format": "pt"})
    for name, _, _, data in tensors:
        writer.write(name, data)
    writer.close()
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1}
    if qconfig is not None:
        config["quantization_config"] = qconfig
    (root / "config.json").write_text(json.dumps(config))
    return root


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(tensor_bytes(t))


def _checkpoint(root: Path, *, q=None, scale=None, weight_dtype="F8_E4M3", scale_dtype="F32", drop_scale=False,
                qconfig=QCONFIG) -> Path:  # fmt: skip
    q0, s0 = _fp8_parts()
    q = q0 if q is None else q
    scale = s0 if scale is None else scale
    norm = torch.ones(192, dtype=torch.bfloat16)
    tensors = [(W, weight_dtype, tuple(q.shape), _bytes(q))]
    if not drop_scale:
        tensors.append((S, scale_dtype, tuple(scale.shape), _bytes(scale)))
    tensors.append((NORM, "BF16", (192,), _bytes(norm)))
    return _write(root, tensors, qconfig)


def _refused(capsys, src: Path, tmp_path: Path) -> str:
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["dequantize", str(src), str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    return lines[0]


def _scale_with(value: float, dtype=torch.float32) -> torch.Tensor:
    _, scale = _fp8_parts()
    scale = scale.clone()
    scale[1, 1] = value
    return scale.to(dtype)


# --- the cases ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"), [(float("inf"), "inf"), (float("nan"), "nan"), (-0.01, "-0.01"), (0.0, "0")]
)
def test_a_scale_that_is_not_positive_and_finite_is_refused(tmp_path, capsys, value, shown):
    src = _checkpoint(tmp_path / "src", scale=_scale_with(value))
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {S}: scale {shown} at index [1, 1]" in line and "positive and finite" in line, line


def test_an_int32_scale_is_refused(tmp_path, capsys):
    _, scale = _fp8_parts()
    src = _checkpoint(tmp_path / "src", scale=(scale * 1e6).to(torch.int32), scale_dtype="I32")
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {S} is I32; a scale is a float" in line, line


def test_an_f8_weight_without_its_scale_is_refused(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", drop_scale=True)
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {W}: an FP8 weight whose scale {S} is missing" in line, line


def test_an_e5m2_weight_is_refused(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", weight_dtype="F8_E5M2")
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {W}: is F8_E5M2; dequantize reads float8_e4m3fn weights" in line, line


@pytest.mark.parametrize("blocks", [[64, 64], [100, 100]])
def test_a_block_size_the_scales_do_not_follow_is_refused(tmp_path, capsys, blocks):
    src = _checkpoint(tmp_path / "src", qconfig={**QCONFIG, "weight_block_size": blocks})
    line = _refused(capsys, src, tmp_path)
    assert f"quantization_config weight_block_size is {blocks}; dequantize reads 128x128 tiles" in line, line


def test_f8_bytes_that_encode_nan_are_refused_with_their_index(tmp_path, capsys):
    q, _ = _fp8_parts()
    raw = q.view(torch.uint8).clone()
    raw[130, 7] = 0x7F  # e4m3fn: exponent and mantissa all ones is NaN
    src = _checkpoint(tmp_path / "src", q=raw.view(torch.float8_e4m3fn))
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {W}: NaN at index [130, 7] (an e4m3 NaN byte)" in line, line


# --- more of the same kind ------------------------------------------------------------------


def test_a_negative_nan_byte_is_refused_too(tmp_path, capsys):
    q, _ = _fp8_parts()
    raw = q.view(torch.uint8).clone()
    raw[0, 191] = 0xFF
    src = _checkpoint(tmp_path / "src", q=raw.view(torch.float8_e4m3fn))
    assert "NaN at index [0, 191]" in _refused(capsys, src, tmp_path)


def test_a_scale_so_large_the_value_overflows_is_refused(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", scale=_scale_with(3e38))
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {W}: the value at index" in line and "overflows bfloat16 once scaled" in line, line


def test_an_e8m0_weight_is_refused(tmp_path, capsys):
    src = _checkpoint(tmp_path / "src", weight_dtype="F8_E8M0")
    assert f"tensor {W}: is F8_E8M0" in _refused(capsys, src, tmp_path)


def test_a_scale_beside_a_bf16_weight_is_refused(tmp_path, capsys):
    weight = torch.randn(256, 192).to(torch.bfloat16)
    _, scale = _fp8_parts()
    tensors = [(W, "BF16", (256, 192), _bytes(weight)), (S, "F32", tuple(scale.shape), _bytes(scale))]
    src = _write(tmp_path / "src", tensors)
    line = _refused(capsys, src, tmp_path)
    assert f"tensor {S}: a scale of a BF16 weight" in line, line


def test_a_scale_without_its_weight_is_refused(tmp_path, capsys):
    _, scale = _fp8_parts()
    src = _write(tmp_path / "src", [(S, "F32", tuple(scale.shape), _bytes(scale))])
    assert f"tensor {S}: a scale of no weight in its shard" in _refused(capsys, src, tmp_path)


def test_a_float8_scale_is_refused(tmp_path, capsys):
    _, scale = _fp8_parts()
    src = _checkpoint(tmp_path / "src", scale=scale.to(torch.float8_e4m3fn), scale_dtype="F8_E4M3")
    assert f"tensor {S} is F8_E4M3; a scale is a float" in _refused(capsys, src, tmp_path)


def test_a_scale_grid_of_the_wrong_shape_is_refused(tmp_path, capsys):
    _, scale = _fp8_parts()
    src = _checkpoint(tmp_path / "src", scale=scale[:1].clone())
    assert "does not tile" in _refused(capsys, src, tmp_path)


@pytest.mark.parametrize(
    ("qconfig", "rule"),
    [
        (None, "quant_method is None, not 'fp8'"),
        ({"quant_method": "awq"}, "quant_method is 'awq', not 'fp8'"),
        ("fp8", "quantization_config is 'fp8', not an object"),
        ({**QCONFIG, "fmt": "e5m2"}, "fmt is 'e5m2'; dequantize reads e4m3 only"),
        ({**QCONFIG, "weight_block_size": "128"}, "weight_block_size is '128'"),
        ({**QCONFIG, "weight_block_size": [128]}, "weight_block_size is [128]"),
        ({**QCONFIG, "weight_block_size": [True, 128]}, "weight_block_size is [True, 128]"),
    ],
)
def test_a_quantization_config_dequantize_cannot_follow_is_refused(tmp_path, capsys, qconfig, rule):
    src = _checkpoint(tmp_path / "src", qconfig=qconfig)
    line = _refused(capsys, src, tmp_path)
    assert rule in line, line


def test_a_valid_fp8_checkpoint_still_dequantizes(tmp_path, capsys):
    from miles.ckpt.fp8 import dequantize_blockwise
    from miles.ckpt.shards import CheckpointReader

    q, scale = _fp8_parts()
    src = _checkpoint(tmp_path / "src")
    assert main(["dequantize", str(src), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    with CheckpointReader(tmp_path / "out") as reader:
        assert reader.info(W)[1].dtype == "BF16" and S not in reader.files.weight_map
        assert torch.equal(reader.read(W), dequantize_blockwise(q, scale))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
