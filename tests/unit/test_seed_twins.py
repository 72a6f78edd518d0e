"""The seed lane's GPU twins (tests/e2e/seed/) run commands the trainer accepts, checked on CPU.

Each twin holds a seed test's flags (FLAGS), the recipe and model it runs them with, and its
GPU count. Here every twin's flags parse with `python -m miles.train`'s parser, act in the run
they describe (the Megatron backend with the SGLang engine: nothing refused by
miles.train.consumption), and, where its recipe exists, render into the recipe's GPU command
with the datasets they read fetched by prepare-ckpt.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
TWINS = sorted((ROOT / "tests/e2e/seed").glob("test_*.py"))


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"twin_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _seed_runs():
    return _load(ROOT / "tests/e2e/seed/seed_runs.py")


@pytest.mark.parametrize("path", TWINS, ids=[p.stem for p in TWINS])
def test_a_twins_flags_parse_and_act_with_megatron_and_sglang(path):
    from miles.train.args import parse_config
    from miles.train.consumption import refusal

    twin = _load(path)
    argv = ["--hf-checkpoint", "/m", "--ref-load", "/m_torch_dist", "--train-backend", "megatron"]
    config = parse_config([*argv, *_seed_runs().extra_args(twin.FLAGS)])
    assert refusal(config, "sglang") is None
    assert config.job.world_size == twin.GPUS


@pytest.mark.parametrize("path", TWINS, ids=[p.stem for p in TWINS])
def test_a_twin_renders_into_its_recipes_gpu_command(path):
    from miles.recipes import load
    from miles.recipes.launch import RunOptions, build_plan
    from miles.train.args import parse_config

    twin = _load(path)
    if not (ROOT / f"scripts/run_{twin.RECIPE}.py").exists():
        pytest.skip(f"recipe {twin.RECIPE} is not in this tree")
    extra = tuple(_seed_runs().extra_args(twin.FLAGS))
    options = RunOptions(model=twin.MODEL, gpus_per_node=twin.GPUS, data_dir=".miles/data", extra_args=extra)
    plan = build_plan(load(twin.RECIPE, platform="cuda"), options, "cuda", base_env={})
    config = parse_config(list(plan.train_args))
    assert config.job.world_size == twin.GPUS
    named = [v for f in ("prompt_data",) for v in [getattr(config.data, f)]] + list(
        config.eval.eval_prompt_data or ()
    )
    for value in named:
        if value.startswith(".miles/data/"):
            assert value.split("/")[2] in plan.checkpoint.datasets, value


FP8_TWINS = sorted((ROOT / "tests/e2e/megatron/test_qwen3_30B_A3B").glob("test_*fp8_bridge.py"))


@pytest.mark.parametrize("path", FP8_TWINS, ids=[p.stem for p in FP8_TWINS])
def test_an_fp8_bridge_twin_runs_a_command_the_trainer_accepts_on_its_platform(path, monkeypatch):
    """The FP8 cases' flags (tests/e2e/megatron/test_qwen3_30B_A3B/case.py) parse, act with
    Megatron and SGLang, start from the FP8 checkpoint at the case's world size, and pass SGLang's
    all-to-all the case names; MoRI is refused on CUDA with DeepEP named, as the trainer does."""
    from types import SimpleNamespace

    from miles.train.args import parse_config
    from miles.train.consumption import refusal
    from miles.train.sglang_server import a2a_backend_problem

    twin = _load(path)
    case = twin.case
    plan = SimpleNamespace(hf_dir="/m/Q", torch_dist_dir="/m/Q_torch_dist", data_dir="/d", fp8_dir="/m/Q_fp8")
    config = parse_config(case.fp8_argv(plan, **twin.CASE))
    assert refusal(config, "sglang") is None
    assert config.job.world_size == twin.CASE["gpus"] and config.checkpoint.hf_checkpoint == "/m/Q_fp8"
    assert config.checkpoint.megatron_to_hf_mode != "bridge"
    assert config.sglang.server_args["moe_a2a_backend"] == twin.CASE["a2a"]
    platform = "rocm" if twin.CASE["a2a"] == "mori" else "cuda"
    assert a2a_backend_problem(twin.CASE["a2a"], platform) is None
    if platform == "rocm":
        assert "deepep" in a2a_backend_problem("mori", "cuda")
