"""Crafted safetensors headers: every field is checked for type and size before any arithmetic,
so each is one line naming the shard and the rule, fast, from the command a user runs.

The rules are safetensors' own reader's (huggingface/safetensors, safetensors/src/tensor.rs:
`Metadata` holds `Option<HashMap<String, String>>` as __metadata__, a `TensorInfo` has a known
`Dtype`, `shape: Vec<usize>` and two `usize` data_offsets, and `Metadata::validate` refuses a
shape whose product overflows with `ValidationOverflow`), plus torch's own limit: sizes,
strides and storage sizes are int64, so a product of the non-zero sizes at or past 2**63
cannot be held even when a zero size makes the tensor empty.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.cli import main
from miles.ckpt.errors import CheckpointError
from miles.ckpt.shards import read_header

register_cpu_ci(est_time=2, suite="stage-a-cpu")

W = "model.layers.0.mlp.down_proj.weight"


def _shard(path: Path, header: dict | bytes, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)
    return path


def _checkpoint(root: Path, header: dict | bytes, data: bytes = b"") -> Path:
    root.mkdir()
    _shard(root / "model.safetensors", header, data)
    config = {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1,
        # the keys qwen3's schema requires, so that the header is the only problem
        "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 16, "intermediate_size": 16,
    }  # fmt: skip
    (root / "config.json").write_text(json.dumps(config))
    return root


def _entry(dtype="F32", shape=(1,), offsets=(0, 4)) -> dict:
    return {
        "dtype": dtype,
        "shape": list(shape) if isinstance(shape, tuple) else shape,
        "data_offsets": offsets,
    }


# The five, then more of the same kind.
CRAFTED = {
    "dtype is a list": ({W: _entry(dtype=["F32"])}, b"\0" * 4, "unknown dtype list"),
    "metadata is a list": ({"__metadata__": ["format"], W: _entry()}, b"\0" * 4, "__metadata__ is list"),
    "JSON nested 100,000 deep": (
        b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b"",
        "nested too deeply",
    ),
    "240 huge dimensions": ({W: _entry("BF16", [2**64 - 1] * 240, [0, 0])}, b"", "shape is 240 dimensions"),
    "200,000 dimensions": ({W: _entry(shape=[1] * 200_000)}, b"\0" * 4, "shape is 200000 dimensions"),
    "dtype is an object": ({W: _entry(dtype={"F32": 1})}, b"\0" * 4, "unknown dtype dict"),
    "dtype is a number": ({W: _entry(dtype=4)}, b"\0" * 4, "unknown dtype 4"),
    "metadata value is a number": (
        {"__metadata__": {"format": 1}, W: _entry()},
        b"\0" * 4,
        "non-string values",
    ),
    "shape is a string": ({W: _entry(shape="[1]")}, b"\0" * 4, "shape is str"),
    "a size is a bool": ({W: _entry(shape=[True, 4], offsets=[0, 16])}, b"\0" * 16, "whole numbers"),
    "a size is a float": ({W: _entry(shape=[1.0])}, b"\0" * 4, "whole numbers"),
    "a size is negative": ({W: _entry(shape=[-1, -4])}, b"\0" * 4, "whole numbers"),
    "a size past 2**64": ({W: _entry(shape=[2**64])}, b"\0" * 4, "whole numbers"),
    "a zero hides huge sizes": (
        {W: _entry("BF16", [0, 2**62, 2**62], [0, 0])},
        b"",
        "overflows a 64-bit size",
    ),
    "sizes overflow before a zero": (
        {W: _entry("BF16", [2**40, 2**40, 0], [0, 0])},
        b"",
        "overflows a 64-bit",
    ),
    "offsets are bools": ({W: _entry(offsets=[False, True])}, b"\0" * 4, "data_offsets"),
    "three offsets": ({W: _entry(offsets=[0, 2, 4])}, b"\0" * 4, "data_offsets"),
    "offsets end before they begin": ({W: _entry(offsets=[4, 0])}, b"\0" * 4, "end before they begin"),
    "an offset of 4400 digits": (
        b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, ' + b"9" * 4400 + b"]}}",
        b"\0" * 4,
        "not valid JSON",
    ),
    "the header is a list": (b"[" * 50 + b"]" * 50, b"", "not a JSON object"),
    "an entry is a list": ({W: ["F32", [1], [0, 4]]}, b"\0" * 4, "not an object"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_header_is_one_line_naming_the_shard(tmp_path, case):
    header, data, expected = CRAFTED[case]
    path = _shard(tmp_path / "x.safetensors", header, data)
    with pytest.raises(CheckpointError) as info:
        read_header(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and expected in message, message
    assert "\n" not in message and len(message) < 600, message


@pytest.mark.parametrize("case", ["dtype is a list", "metadata is a list", "JSON nested 100,000 deep",
                                  "240 huge dimensions", "200,000 dimensions"])  # fmt: skip
@pytest.mark.parametrize("command", ["validate", "fp8"])
def test_validate_and_fp8_end_a_crafted_header_in_one_line_exit_1(tmp_path, capsys, case, command):
    header, data, expected = CRAFTED[case]
    src = _checkpoint(tmp_path / "src", header, data)
    argv = (
        ["validate", str(src), "--family", "qwen3"]
        if command == "validate"
        else ["fp8", str(src), str(tmp_path / "out")]
    )
    assert main(argv) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and expected in line, line
    assert not (tmp_path / "out").exists()


def test_an_empty_tensor_with_sizes_torch_cannot_hold_is_refused_by_fp8(tmp_path):
    """[2**62, 0, 2**62]: the product is 0, so no byte count gives it away, yet torch cannot
    build it (its strides overflow int64). fp8 refuses it before converting anything."""
    src = _checkpoint(tmp_path / "src", {W: _entry("BF16", [2**62, 0, 2**62], [0, 0])})
    done = subprocess.run(
        [sys.executable, "-m", "miles.ckpt", "fp8", str(src), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: {src / 'model.safetensors'}: tensor {W}: shape [4611686018427387904, 0, 4611686018427387904] "
        "of BF16 overflows a 64-bit size (torch cannot hold it); the header is corrupt"
    ]


def test_a_header_that_is_valid_still_reads(tmp_path):
    path = _shard(
        tmp_path / "ok.safetensors",
        {
            "__metadata__": {"format": "pt"},
            W: _entry("BF16", [2, 2], [0, 8]),
            "e": _entry("F32", [0, 3], [8, 8]),
        },
        b"\0" * 8,
    )
    header = read_header(path)
    assert header.tensors[W].shape == (2, 2) and header.tensors["e"].numel == 0
    assert header.metadata == {"format": "pt"}
