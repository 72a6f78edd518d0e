"""What a family's own modules support of a layout is refused before anything starts, in the build's words.

DeepSeek-V4 cannot split a sequence over context-parallel ranks and splits its grouped output
projection by group (TP must divide o_groups); Inkling cannot use context parallelism either.
`python -m miles.parallel check --config`, the trainer's flag check (what --dry-start and recipe
rendering run) and the family's own build all refuse with the one message the family's limits
give (miles.parallel.FamilyLimits).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles.ci.register import register_cpu_ci
from miles.families import UnmappedModel, family

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]


def _config(name: str, tmp_path: Path, **changes) -> Path:
    spec = family(name)
    config = {
        "model_type": spec.model_types[0],
        "num_hidden_layers": spec.tiny_layers,
        **spec.tiny_dims,
        **changes,
    }
    if name == "deepseek_v4":  # transformers folds compress_ratios into layer_types
        config["layer_types"] = ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention"]  # fmt: skip
        config["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "miles.parallel", "check", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_layout_check_refuses_deepseek_v4_at_cp2_with_the_builds_message(tmp_path):
    path = _config("deepseek_v4", tmp_path)
    config = json.loads((path / "config.json").read_text())
    message = family("deepseek_v4").limits(config).cp_problem(2)
    assert message.startswith("--context-parallel-size 2: DeepSeek-V4's sliding windows")
    done = _check("--world-size", "2", "--cp", "2", "--config", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"family-cp: {path.name}: {message}" in done.stdout
    with pytest.raises(UnmappedModel) as built:
        family("deepseek_v4").build_model(
            SimpleNamespace(context_parallel_size=2, tensor_model_parallel_size=1), config, 512
        )
    assert str(built.value) == message


def test_the_layout_check_refuses_a_tp_that_does_not_divide_o_groups_with_the_builds_message(tmp_path):
    path = _config("deepseek_v4", tmp_path, o_groups=2, num_attention_heads=8)
    config = json.loads((path / "config.json").read_text())
    message = family("deepseek_v4").limits(config).tp_problem(4)
    assert message == (
        "--tensor-model-parallel-size 4 does not divide o_groups 2: the grouped output projection splits by group; "
        "pick a tensor-parallel size dividing it (1, 2)"
    )
    done = _check("--world-size", "4", "--tp", "4", "--sp", "--config", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"family-tp: {path.name}: {message}" in done.stdout
    with pytest.raises(UnmappedModel) as built:
        family("deepseek_v4").build_model(
            SimpleNamespace(context_parallel_size=1, tensor_model_parallel_size=4), config, 512
        )
    assert str(built.value) == message
    assert (
        _check("--world-size", "4", "--tp", "2", "--sp", "--ep", "2", "--config", str(path)).returncode == 0
    )


def test_inklings_build_and_the_layout_check_refuse_cp_in_the_same_words(tmp_path):
    path = _config("inkling", tmp_path)
    config = json.loads((path / "config.json").read_text())
    message = family("inkling").limits(config).cp_problem(2)
    done = _check("--world-size", "2", "--cp", "2", "--config", str(path))
    assert done.returncode == 1 and f"family-cp: {path.name}: {message}" in done.stdout, done.stdout
    with pytest.raises(UnmappedModel) as built:
        family("inkling").finish_model(SimpleNamespace(), SimpleNamespace(context_parallel_size=2), config)
    assert str(built.value) == message


def test_the_trainers_flag_check_refuses_what_the_family_cannot_build(tmp_path, capsys):
    """What --dry-start and a recipe's render run before anything loads (miles.train.layout)."""
    from miles.train.args import parse_config

    path = _config("deepseek_v4", tmp_path)
    argv = ["--hf-checkpoint", str(path), "--train-backend", "megatron", "--actor-num-gpus-per-node", "2",
            "--context-parallel-size", "2", "--rollout-batch-size", "2"]  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        parse_config(argv)
    assert stopped.value.code == 2
    config = json.loads((path / "config.json").read_text())
    assert family("deepseek_v4").limits(config).cp_problem(2) in capsys.readouterr().err


def test_a_family_without_limits_passes_where_megatron_core_does(tmp_path):
    path = _config("qwen3", tmp_path)
    assert _check("--world-size", "2", "--cp", "2", "--config", str(path)).returncode == 0
