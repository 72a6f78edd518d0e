"""Safetensors shards without the library: headers checked against sizes, streaming writer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from miles.ci.register import register_cpu_ci
from miles.ckpt.errors import CheckpointError
from miles.ckpt.shards import (
    CheckpointReader,
    ShardWriter,
    read_header,
    read_weight_map,
    tensor_bytes,
    write_index,
)

register_cpu_ci(est_time=1, suite="stage-a-cpu")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5, generator=g).bfloat16(),
        "b.bias": torch.randn(7, generator=g),
        "c.ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d.empty": torch.empty(0, 4),
    }


def test_header_of_a_library_written_shard_lists_every_tensor(tmp_path: Path):
    save_file(_tensors(), tmp_path / "x.safetensors", metadata={"format": "pt"})
    header = read_header(tmp_path / "x.safetensors")
    assert set(header.tensors) == set(_tensors())
    assert header.tensors["a.weight"].dtype == "BF16" and header.tensors["a.weight"].shape == (3, 5)
    assert header.metadata == {"format": "pt"}


def test_writer_output_reads_back_with_the_safetensors_library(tmp_path: Path):
    tensors = _tensors()
    path = tmp_path / "out.safetensors"
    layout = [
        (n, {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}[t.dtype], tuple(t.shape))
        for n, t in tensors.items()
    ]
    writer = ShardWriter(path, layout, {"format": "pt"})
    for name, t in tensors.items():
        data = tensor_bytes(t)
        if len(data) > 1:  # a tensor may arrive in parts
            writer.write_part(name, data[: len(data) // 2])
            writer.write_part(name, data[len(data) // 2 :])
        else:
            writer.write(name, data)
    size, digest = writer.close()
    assert size == path.stat().st_size and len(digest) == 64
    with safe_open(path, "pt") as f:
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t)


def test_writer_refuses_tensors_out_of_layout_order(tmp_path: Path):
    writer = ShardWriter(tmp_path / "o.safetensors", [("a", "F32", (2,)), ("b", "F32", (2,))])
    with pytest.raises(CheckpointError, match="layout expects a"):
        writer.write("b", tensor_bytes(torch.zeros(2)))
    writer.abort()


def test_truncated_shard_is_reported_with_its_size_and_the_fix(tmp_path: Path):
    path = tmp_path / "t.safetensors"
    save_file(_tensors(), path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(
        CheckpointError, match=r"t\.safetensors: file is \d+ bytes .* truncated; fetch it again"
    ):
        read_header(path)


def test_offsets_that_disagree_with_the_shape_are_reported(tmp_path: Path):
    path = tmp_path / "h.safetensors"
    save_file({"w": torch.zeros(4, 4)}, path)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header["w"]["shape"] = [4, 5]  # 80 bytes claimed, 64 stored
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    with pytest.raises(
        CheckpointError, match=r"tensor w: shape \[4, 5\] of F32 needs 80 bytes but data_offsets span 64"
    ):
        read_header(path)


def test_overlapping_tensors_are_reported(tmp_path: Path):
    path = tmp_path / "o.safetensors"
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(12))
    with pytest.raises(CheckpointError, match="tensor b starts at data offset 4, which overlaps"):
        read_header(path)


def test_a_file_that_is_not_safetensors_is_reported(tmp_path: Path):
    path = tmp_path / "n.safetensors"
    path.write_bytes(b"<html>rate limited</html>")
    with pytest.raises(CheckpointError, match="not safetensors"):
        read_header(path)


def test_weight_map_comes_from_the_index_or_the_single_shard(tmp_path: Path):
    save_file({"x": torch.zeros(2)}, tmp_path / "model.safetensors")
    files = read_weight_map(tmp_path)
    assert files.weight_map == {"x": "model.safetensors"} and not files.indexed
    write_index(tmp_path, {"x": "model.safetensors"}, 8)
    assert read_weight_map(tmp_path).indexed
    assert json.loads((tmp_path / "model.safetensors.index.json").read_text())["metadata"] == {
        "total_size": 8
    }


def test_reader_returns_tensors_by_name_across_shards(tmp_path: Path):
    save_file({"x": torch.ones(2)}, tmp_path / "s1.safetensors")
    save_file({"y": torch.arange(3.0)}, tmp_path / "s2.safetensors")
    write_index(tmp_path, {"x": "s1.safetensors", "y": "s2.safetensors"}, 20)
    with CheckpointReader(tmp_path) as reader:
        assert torch.equal(reader.read("y"), torch.arange(3.0))
        with pytest.raises(CheckpointError, match="no tensor z"):
            reader.read("z")
