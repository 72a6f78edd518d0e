"""Weights pushed to an FP8 engine are what prepare-ckpt's FP8 step writes for the same tensors.

Each family's tiny checkpoint is prepared by the command `invoke prepare-ckpt` runs
(`python -m miles.ckpt prepare ... --plan-steps fetch,validate,fp8`); the trainer's tensors are
the bf16 checkpoint's own, pushed through the export an engine started from the FP8 directory
gets. Every tensor the export emits must equal the FP8 file's bit for bit, and the FP8 files
must hold nothing the export leaves out.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from miles.ci.register import register_cpu_ci
from miles.ckpt.plan import FAMILIES
from miles.ckpt.shards import CheckpointReader
from miles.train.fp8_export import Fp8ExportError, fp8_export_for, module_matches

# measured: 79 s of CPU (a tiny checkpoint prepared by `python -m miles.ckpt prepare` in a
# subprocess); the implicit 15 s timed out in a lane run at load 4.6
register_cpu_ci(est_time=40, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """prepared(family) -> (bf16 dir, fp8 dir), made by `python -m miles.ckpt prepare`."""
    root = tmp_path_factory.mktemp("prepared")
    made = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            name = f"tiny-{family}"
            done = subprocess.run(
                [sys.executable, "-m", "miles.ckpt", "prepare", "--family", family, "--source", f"tiny:{family}",
                 "--model", name, "--model-dir", str(root), "--plan-steps", "fetch,validate,fp8",
                 "--workers", "2", "--quiet"],
                capture_output=True, text=True, cwd=ROOT, timeout=600,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr[-2000:]
            made[family] = (root / name, root / f"{name}_fp8")
        return made[family]

    return get


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with CheckpointReader(path) as reader:
        return {name: reader.read(name) for name in reader.files.weight_map}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_the_bf16_weights_is_bit_exact_with_the_fp8_checkpoint(prepared, family):
    bf16, fp8 = prepared(family)
    export = fp8_export_for(fp8)
    written = _tensors(fp8)
    pushed = dict(export(_tensors(bf16).items()))
    assert set(pushed) == set(written)
    differing = [
        n
        for n, t in pushed.items()
        if t.dtype != written[n].dtype or not torch.equal(_bits(t), _bits(written[n]))
    ]
    assert not differing, differing[:5]
    assert sum(t.dtype == torch.float8_e4m3fn for t in pushed.values()) == len(export.quantized) > 0


def test_dsa_checkpoints_get_power_of_two_scales_and_the_others_float_scales(prepared):
    assert fp8_export_for(prepared("glm_moe_dsa")[1]).pow2_scales is True
    assert fp8_export_for(prepared("qwen3_moe")[1]).pow2_scales is False


def test_skipped_modules_are_pushed_unquantized(prepared):
    bf16, fp8 = prepared("qwen3_moe")
    skipped = json.loads((fp8 / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    pushed = dict(fp8_export_for(fp8)(_tensors(bf16).items()))
    router = "model.layers.0.mlp.gate.weight"
    assert any(module_matches(s, router.rsplit(".", 1)[0]) for s in skipped)
    assert pushed[router].dtype == torch.bfloat16 and router + "_scale_inv" not in pushed


def test_an_unquantized_checkpoint_needs_no_export(prepared):
    assert fp8_export_for(prepared("qwen3")[0]) is None


def _with_quantization(path: Path, tmp_path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **changes}
    out = tmp_path / "ckpt"
    out.mkdir()
    for item in path.iterdir():  # copies: a checkpoint's files may not link out of its folder
        if item.is_file() and item.name != "config.json":
            shutil.copyfile(item, out / item.name)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_a_skip_list_that_contradicts_the_files_is_refused_naming_the_tensor(prepared, tmp_path):
    fp8 = prepared("qwen3")[1]
    ckpt = _with_quantization(fp8, tmp_path, modules_to_not_convert=["model.layers.0.self_attn"])
    with pytest.raises(Fp8ExportError, match=r"keeps model\.layers\.0\.self_attn\.\w+_proj\.weight in bf16"):
        fp8_export_for(ckpt)


@pytest.mark.parametrize(
    ("changes", "rule"),
    [
        ({"quant_method": "mxfp4"}, "quant_method is 'mxfp4'"),
        (
            {"weight_block_size": [128, 64]},
            "weight_block_size is \\[128, 64\\]; miles quantizes square blocks",
        ),
        ({"weight_block_size": None}, "weight_block_size is None"),
        ({"scale_fmt": "e8m0_packed"}, "scale_fmt is 'e8m0_packed'"),
    ],
)
def test_a_quantization_miles_cannot_reproduce_is_refused_with_the_rule(prepared, tmp_path, changes, rule):
    ckpt = _with_quantization(prepared("qwen3")[1], tmp_path, **changes)
    with pytest.raises(Fp8ExportError, match=rule):
        fp8_export_for(ckpt)


def test_a_diverged_weight_is_named_instead_of_pushed(prepared):
    bf16, fp8 = prepared("qwen3")
    export = fp8_export_for(fp8)
    name = sorted(export.quantized)[0]
    weight = _tensors(bf16)[name].clone()
    weight[1, 2] = float("nan")
    with pytest.raises(Fp8ExportError, match=f"trainer weight {name}: .*NaN at index \\[1, 2\\]"):
        list(export([(name, weight)]))
