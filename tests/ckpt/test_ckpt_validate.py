"""Validation: every bad input is an error naming file, tensor and rule, and the source is untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.errors import CheckpointError
from miles.ckpt.shards import read_header, read_weight_map
from miles.ckpt.validate import validate_checkpoint

register_cpu_ci(est_time=10, suite="stage-b-cpu")


def _fails(path: Path, family: str, match: str, **kwargs) -> str:
    with pytest.raises(CheckpointError, match=match) as info:
        validate_checkpoint(path, family, **kwargs)
    return str(info.value)


def _shard_of(path: Path, tensor: str) -> Path:
    return path / read_weight_map(path).weight_map[tensor]


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_truncated_shard_is_named_and_nothing_is_written(tiny_copy, tree_digest):
    path = tiny_copy("qwen3")
    shard = _shard_of(path, "model.layers.3.mlp.down_proj.weight")
    shard.write_bytes(shard.read_bytes()[:-1000])
    before = tree_digest(path)
    message = _fails(path, "qwen3", "truncated")
    assert f"{shard}: [header]" in message and "fetch it again" in message
    assert tree_digest(path) == before


def test_header_offset_mismatch_is_named(tiny_copy):
    path = tiny_copy("qwen3_moe")
    shard = _shard_of(path, "model.norm.weight")
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 2]
    text = json.dumps(header).encode()
    shard.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    _fails(path, "qwen3_moe", rf"tensor {name}: shape .* data_offsets span")


def test_shard_named_in_the_index_but_missing_is_named_with_its_tensor_count(tiny_copy):
    path = tiny_copy("glm_moe_dsa")
    shard = _shard_of(path, "model.layers.1.self_attn.o_proj.weight")
    count = sum(1 for v in read_weight_map(path).weight_map.values() if v == shard.name)
    shard.unlink()
    _fails(path, "glm_moe_dsa", rf"{shard.name}: \[missing shard\] the index maps {count} tensors here")


def test_wrong_layer_count_says_how_to_fix_it(tiny):
    message = _fails(
        tiny("inkling"),
        "inkling",
        r"\[num_hidden_layers\] is 4 but the model is a 5-layer slice",
        expect_layers=5,
    )
    assert "fetch a deeper checkpoint" in message
    _fails(tiny("inkling"), "inkling", "add the trim step", expect_layers=2)


def test_shape_that_contradicts_the_config_names_the_tensor(tiny_copy):
    path = tiny_copy("qwen3")
    _edit_config(path, intermediate_size=512)
    message = _fails(
        path, "qwen3", r"tensor model\.layers\.0\.mlp\.down_proj\.weight: \[shape\] has shape \[128, 384\]"
    )
    assert "implies [128, 512]" in message and "different models" in message


def test_tensor_the_config_does_not_expect_is_reported(tiny_copy):
    path = tiny_copy("deepseek_v4")
    _edit_config(
        path, num_hidden_layers=3, layer_types=None, mlp_layer_types=None, num_nextn_predict_layers=0
    )
    _fails(path, "deepseek_v4", r"model\.layers\.3\..*\[unexpected tensor\]")


def test_index_and_shards_must_list_the_same_tensors(tiny_copy):
    path = tiny_copy("qwen3")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    moved = "model.norm.weight"
    other = next(s for s in set(index["weight_map"].values()) if s != index["weight_map"][moved])
    index["weight_map"][moved] = other
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    message = _fails(path, "qwen3", r"\[index\]")
    assert f"tensor {moved}" in message and f"the index places it in {other}" in message


def test_family_model_type_and_architectures_are_checked(tiny, tiny_copy):
    _fails(tiny("qwen3"), "qwen3_moe", r"\[model_type\] is 'qwen3'; family qwen3_moe expects qwen3_moe")
    path = tiny_copy("qwen3")
    _edit_config(path, architectures=["Qwen3Model"])
    _fails(
        path,
        "qwen3",
        r"\[architectures\] is \['Qwen3Model'\]; qwen3 checkpoints declare \['Qwen3ForCausalLM'\]",
    )


def test_auto_map_is_refused_unless_the_plan_allows_it(tiny_copy):
    path = tiny_copy("qwen3")
    _edit_config(path, auto_map={"AutoModelForCausalLM": "modeling_x.X"})
    _fails(path, "qwen3", r"\[auto_map\] asks for remote code")
    validate_checkpoint(path, "qwen3", allow_auto_map=True)


def _plant(path: Path, tensor: str, index: tuple[int, int], raw: bytes) -> None:
    shard = _shard_of(path, tensor)
    header = read_header(shard)
    info = header.tensors[tensor]
    item = info.nbytes // info.numel
    with open(shard, "r+b") as f:
        f.seek(header.offset(info) + (index[0] * info.shape[1] + index[1]) * item)
        f.write(raw)


def test_every_value_is_scanned_and_a_nan_is_one_line_naming_tensor_and_index(tiny_copy):
    path = tiny_copy("qwen3")
    tensor = "model.layers.2.self_attn.o_proj.weight"
    _plant(path, tensor, (100, 37), b"\xc0\x7f")  # bf16 NaN deep inside the tensor
    message = _fails(path, "qwen3", rf"tensor {tensor}: \[nan/inf\] NaN at index \[100, 37\]")
    assert "\n" not in message and "fetch the checkpoint again or repair it" in message
    validate_checkpoint(path, "qwen3", scan_fraction=0)  # --scan-nan 0: headers only


def test_inf_in_an_fp32_tensor_and_nan_in_an_fp8_tensor_are_found(tiny_copy, fp8_of, tmp_path):
    path = tiny_copy("deepseek_v4")
    _plant(path, "model.layers.1.hc_ffn_fn", (3, 5), b"\x00\x00\x80\xff")  # fp32 -Inf
    _fails(path, "deepseek_v4", r"tensor model\.layers\.1\.hc_ffn_fn: \[nan/inf\] -Inf at index \[3, 5\]")
    fp8 = tmp_path / "fp8"
    shutil.copytree(fp8_of("qwen3"), fp8)
    _plant(fp8, "model.layers.0.mlp.down_proj.weight", (7, 9), b"\x7f")  # e4m3 NaN
    _fails(fp8, "qwen3", r"down_proj\.weight: \[nan/inf\] NaN at index \[7, 9\]")


def test_a_sampled_scan_reads_evenly_spaced_windows(tiny_copy):
    path = tiny_copy("qwen3")
    tensor = "model.embed_tokens.weight"
    _plant(path, tensor, (0, 0), b"\x80\x7f")  # the first window of every sample holds the start
    _fails(path, "qwen3", rf"{tensor}: \[nan/inf\] \+Inf at index \[0, 0\]", scan_fraction=0.01)


def test_wrong_dtype_for_the_config_is_reported(tiny_copy):
    path = tiny_copy("qwen3")
    _edit_config(path, dtype="float16")
    _fails(path, "qwen3", r"\[dtype\] is BF16; config dtype allows \['F16', 'F32'\]")


def test_prepare_ckpt_stops_at_validate_with_one_line_and_without_the_scan_fp8_refuses(tiny_copy, tmp_path):
    import subprocess
    import sys

    source = tiny_copy("qwen3")
    tensor = "model.layers.3.mlp.gate_proj.weight"
    _plant(source, tensor, (200, 64), b"\x80\xff")  # bf16 -Inf

    def prepare(*extra: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "miles.ckpt", "prepare", "--quiet", "--family", "qwen3",
                "--model", "q", "--source", str(source), "--model-dir", str(tmp_path / "models"),
                "--layers", "4", "--plan-steps", "fetch,validate,fp8", *extra]  # fmt: skip
        return subprocess.run(argv, capture_output=True, text=True, check=False)

    first = prepare()
    assert first.returncode == 1 and len(first.stderr.strip().splitlines()) == 1, first.stderr
    assert (
        first.stderr.startswith("error: validate of q: ")
        and f"{tensor}: [nan/inf] -Inf at index [200, 64]" in first.stderr
    )
    assert not (tmp_path / "models" / "q_fp8").exists()
    unscanned = prepare("--scan-nan", "0")
    assert unscanned.returncode == 1 and len(unscanned.stderr.strip().splitlines()) == 1, unscanned.stderr
    assert unscanned.stderr.startswith("error: fp8 of q: ") and "-Inf at index [200, 64]" in unscanned.stderr
    assert not (tmp_path / "models" / "q_fp8").exists()
