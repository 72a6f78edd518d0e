"""torch_dist refuses weights that are not float tensors, whatever the header calls them.

The issue's case: FP8 bytes relabelled as U8 (config.json's quantization_config removed) were
accepted and cast value by value into megatron's parameters. The run is the one a user types,
`python -m miles.ckpt prepare ... --plan-steps fetch,torch_dist` (validate, which would also
refuse the dtype, left out of the plan as a user may).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.ckpt.cli import main
from miles.ckpt.shards import read_weight_map

register_cpu_ci(est_time=2, suite="stage-b-cpu")

MODEL = "m"


@pytest.fixture(autouse=True)
def _private_digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MILES_CACHE_DIR", str(tmp_path / "digest-cache"))


def relabel(root: Path, dtypes: dict[str, str]) -> None:
    """Give tensors another dtype name in their shard's header (same byte size, same offsets)."""
    for shard in sorted(set(read_weight_map(root).weight_map.values())):
        path = root / shard
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        hit = [name for name in header if name in dtypes]
        for name in hit:
            header[name]["dtype"] = dtypes[name]
        if hit:
            text = json.dumps(header, separators=(",", ":")).encode()
            assert len(text) <= n
            path.write_bytes(raw[:8] + text + b" " * (n - len(text)) + raw[8 + n :])


def edit_config(root: Path, **changes) -> None:
    config = json.loads((root / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (root / "config.json").write_text(json.dumps(config))


def one_line(capsys, source: Path, models: Path) -> str:
    capsys.readouterr()
    argv = ["prepare", "--quiet", "--family", "qwen3", "--model", MODEL, "--source", str(source), "--layers", "4",
            "--model-dir", str(models), "--plan-steps", "fetch,torch_dist"]  # fmt: skip
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: torch_dist of {MODEL}: "), lines
    assert not (models / f"{MODEL}_torch_dist").exists()
    return lines[0]


def test_fp8_bytes_relabelled_as_u8_are_refused(fp8_of, tmp_path, capsys):
    source = Path(shutil.copytree(fp8_of("qwen3"), tmp_path / "relabelled"))
    f8 = sorted(
        n
        for n in read_weight_map(source).weight_map
        if f"{n}_scale_inv" in read_weight_map(source).weight_map
    )
    relabel(source, dict.fromkeys(f8, "U8"))
    edit_config(source, quantization_config=None)
    line = one_line(capsys, source, tmp_path / "models")
    assert f"tensor {f8[0]} is U8, but a weight is a float tensor" in line, line


def test_a_bf16_weight_relabelled_as_i16_is_refused(tiny_copy, tmp_path, capsys):
    source = tiny_copy("qwen3")
    name = "model.layers.0.mlp.up_proj.weight"
    relabel(source, {name: "I16"})
    line = one_line(capsys, source, tmp_path / "models")
    assert f"tensor {name} is I16, but a weight is a float tensor" in line, line


def test_a_quantization_config_that_is_a_string_is_one_line(tiny_copy, tmp_path, capsys):
    source = tiny_copy("qwen3")
    edit_config(source, quantization_config="fp8")
    line = one_line(capsys, source, tmp_path / "models")
    assert "a quantized checkpoint (quantization_config quant_method 'fp8'" in line, line
