"""miles.recipes.launch and the recipe scripts: plans, environment merging, dry runs, real runs."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.platform import PlatformError
from miles.recipes import load, names, shared
from miles.recipes.launch import LaunchError, RunOptions, build_plan, check_pins, format_plan, run
from miles.recipes.script import ScriptError, main, parse_env_vars, resolve_fields

register_cpu_ci(est_time=2, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
FIXED = RunOptions(model_dir="/models", data_dir="/data", output_dir="/runs", run_id="t", python="python")


def test_one_node_cpu_plan_forks_two_gloo_ranks_and_a_gpu_plan_starts_them_with_torchrun():
    plan = build_plan(shared("qwen3_4b"), FIXED, base_env={})
    assert plan.mode == "torchrun" and plan.platform == "cpu"
    assert plan.command[:6] == ("python", "-m", "miles.train.forked_ranks", "--nproc-per-node", "2", "-m")
    assert plan.command[6] == "miles.train"
    gpu = build_plan(load("qwen3_4b", platform="rocm"), FIXED, base_env={})
    assert gpu.command[:6] == ("python", "-m", "torch.distributed.run", "--standalone", "--nnodes", "1")
    assert dict(plan.env)["OMP_NUM_THREADS"] == "1"


def test_extra_args_come_last_so_they_win():
    plan = build_plan(shared("qwen3_4b"), replace(FIXED, extra_args=("--lr", "5e-6")), base_env={})
    assert plan.command[-2:] == ("--lr", "5e-6")
    assert plan.command.index("--lr") < len(plan.command) - 2  # the recipe's own value stays, earlier


def test_num_rollout_goes_before_extra_args():
    plan = build_plan(
        shared("qwen3_4b"), replace(FIXED, num_rollout=2, extra_args=("--num-rollout", "5")), base_env={}
    )
    assert plan.train_args[-4:] == ("--num-rollout", "2", "--num-rollout", "5")


def test_extra_env_vars_merge_last_over_the_recipe_and_platform():
    options = replace(FIXED, extra_env=(("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "0"), ("MY_FLAG", "1")))
    plan = build_plan(load("inkling", platform="rocm"), options, base_env={})
    env = dict(plan.env)
    assert env["SGLANG_ENABLE_UNIFIED_RADIX_TREE"] == "0" and env["MY_FLAG"] == "1"


def test_rocm_plan_mirrors_hip_visible_devices():
    plan = build_plan(load("inkling", platform="rocm"), FIXED, base_env={"HIP_VISIBLE_DEVICES": "4,5,6,7"})
    env = dict(plan.env)
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert "HIP_VISIBLE_DEVICES" not in env  # unchanged from the caller's, so not part of the plan


def test_cuda_plan_carries_no_rocm_settings():
    plan = build_plan(shared("qwen3_4b"), replace(FIXED, model="Qwen3-4B"), base_env={})
    assert plan.platform == "cuda"
    assert not [k for k, _ in plan.env if k.startswith("RAY_EXPERIMENTAL") or k.startswith("NCCL")]


def test_several_nodes_plan_a_ray_job_with_node_setup(monkeypatch):
    from miles.recipes.recipe import ParallelProfile

    recipe = load("qwen3_4b", platform="rocm")
    two_nodes = replace(recipe.profiles[0], nodes=2, suite=None)
    recipe = replace(recipe, profiles=(*recipe.profiles, two_nodes))
    plan = build_plan(recipe, replace(FIXED, nodes=2, gpus_per_node=4, head_address="10.0.0.1"), base_env={})
    assert isinstance(plan.profile, ParallelProfile) and plan.mode == "ray"
    assert plan.command[:5] == ("ray", "job", "submit", "--address", "http://10.0.0.1:8265")
    runtime_env = json.loads(plan.command[plan.command.index("--runtime-env-json") + 1])
    assert runtime_env["env_vars"]["NCCL_NVLS_ENABLE"] == "0"
    assert plan.prelude[0][:3] == ("ray", "start", "--head")
    entrypoint = plan.command[plan.command.index("--") + 1 :]
    assert entrypoint[:9] == (
        "python", "-m", "miles.recipes.ray_job", "--nodes", "2", "--procs-per-node", "4", "--gpus-per-node", "4",
    )  # fmt: skip
    assert entrypoint[entrypoint.index("--") + 1 :] == ("python", "-m", "miles.train", *plan.train_args)


def test_a_ray_address_on_one_node_is_refused():
    recipe = load("qwen3_4b", platform="cpu")
    options = replace(FIXED, model="tiny", ray_address="http://127.0.0.1:8265")
    with pytest.raises(LaunchError, match="drop --ray-address, or give --num-nodes above 1"):
        build_plan(recipe, options, "cpu", base_env={})


def test_a_ray_run_without_a_cluster_is_one_line(tmp_path):
    """The launcher submits a plan of several nodes to the cluster's dashboard; none answers here."""
    import importlib.util

    from miles.train.remote.group import free_port

    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    recipe = load("qwen3_4b", platform="cpu")
    address = f"http://127.0.0.1:{free_port()}"
    options = replace(
        FIXED, model="tiny", nodes=2, gpus_per_node=1, ray_address=address, output_dir=str(tmp_path)
    )
    plan = build_plan(recipe, options, "cpu", base_env={})
    with pytest.raises(LaunchError, match=f"no Ray cluster answers at {address}"):
        run(plan, env={})


def test_format_plan_shows_layout_environment_and_a_runnable_command():
    text = format_plan(build_plan(load("inkling", platform="rocm"), FIXED, base_env={}))
    assert "layout     tp4·pp1·cp1·ep4·etp1+sp on 4 rank(s) for Inkling-Small-4layer: valid (dp=1)" in text
    assert "  NCCL_NVLS_ENABLE=0" in text
    assert (
        "  python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 4 -m miles.train \\"
        in text
    )
    assert text.rstrip().endswith("--seed 1234")


def test_run_starts_the_command_with_the_plan_environment_and_makes_the_directories(tmp_path):
    out = tmp_path / "seen.json"
    options = replace(FIXED, output_dir=str(tmp_path / "runs"), model_dir=str(tmp_path / "models"))
    plan = build_plan(shared("qwen3_4b"), options, base_env={})
    probe = f"import json, os; json.dump(dict(os.environ), open({str(out)!r}, 'w')); raise SystemExit(3)"
    plan = replace(plan, command=(sys.executable, "-c", probe))
    assert run(plan, env={"PATH": os.environ["PATH"], "CALLER": "kept"}) == 3
    seen = json.loads(out.read_text())
    assert seen["CALLER"] == "kept" and seen["OMP_NUM_THREADS"] == "1" and seen["PYTHONUNBUFFERED"] == "1"
    assert (tmp_path / "runs" / "t" / "checkpoints").is_dir()


def test_run_refuses_a_gpu_plan_on_this_machine():
    plan = build_plan(load("inkling", platform="rocm"), FIXED, base_env={})
    with pytest.raises(PlatformError, match="needs rocm with 4 GPU"):
        run(plan, env={})


def test_pins_at_another_version_are_named():
    with pytest.raises(LaunchError, match=r"numba==0.65.1 \(found not installed\), pytest==0.0.1 \(found "):
        check_pins((("numba", "0.65.1"), ("pytest", "0.0.1")))


def test_script_arguments_bind_to_miles_script_variables_and_flags_win():
    values = resolve_fields(
        {"num_rollout": 7}, {"MILES_SCRIPT_NUM_ROLLOUT": "3", "MILES_SCRIPT_MODEL": "tiny"}
    )
    assert values["num_rollout"] == (7, "flag")
    assert values["model"] == ("tiny", "MILES_SCRIPT_MODEL")
    assert values["output_dir"] == (".miles/runs", "default")


def test_model_dir_falls_back_to_the_shared_miles_model_dir():
    assert resolve_fields({}, {"MILES_MODEL_DIR": "/data/models"})["model_dir"] == (
        "/data/models",
        "MILES_MODEL_DIR",
    )
    both = {"MILES_MODEL_DIR": "/data/models", "MILES_SCRIPT_MODEL_DIR": "/fast/models"}
    assert resolve_fields({}, both)["model_dir"] == ("/fast/models", "MILES_SCRIPT_MODEL_DIR")


def test_a_malformed_boolean_variable_is_named():
    with pytest.raises(ScriptError, match="MILES_SCRIPT_DRY_RUN='maybe' is not a boolean"):
        resolve_fields({}, {"MILES_SCRIPT_DRY_RUN": "maybe"})


def test_extra_env_vars_accept_json_and_name_value_pairs():
    assert parse_env_vars('{"A": 1, "B": "x y"}') == (("A", "1"), ("B", "x y"))
    assert parse_env_vars("A=1 B='x y'") == (("A", "1"), ("B", "x y"))
    with pytest.raises(ScriptError, match="'B' is not NAME=value"):
        parse_env_vars("A=1 B")


def test_script_dry_run_echoes_the_arguments_table(capsys):
    env = {"MILES_SCRIPT_RUN_ID": "from-env", "MILES_SCRIPT_DRY_RUN": "1"}
    assert main("qwen3_4b", argv=["train", "--platform", "cpu"], env=env) == 0
    out = capsys.readouterr().out
    assert re.search(r"^run_id +from-env +MILES_SCRIPT_RUN_ID$", out, re.MULTILINE)
    assert re.search(r"^num_gpus_per_node +2 +recipe profile$", out, re.MULTILINE)
    assert "miles.train" in out


def test_script_train_without_a_prepared_checkpoint_says_to_prepare(tmp_path, capsys):
    argv = ["train", "--platform", "cpu", "--model-dir", str(tmp_path)]
    assert main("inkling", argv=argv, env={}) == 2
    err = capsys.readouterr().err
    assert (
        f"checkpoint {tmp_path}/Inkling-Small-tiny, {tmp_path}/Inkling-Small-tiny_torch_dist is missing"
        in err
    )
    assert "run `python scripts/run_inkling.py prepare --model tiny` first" in err


def _script_calls(path: Path) -> list[tuple]:
    """The main(...) calls of a recipe script, as (name, platform) pairs."""
    calls = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "main":
            platform = next((k.value.value for k in node.keywords if k.arg == "platform"), None)
            calls.append((node.args[0].value, platform))
    return calls


def test_every_recipe_has_a_shared_and_an_amd_script_that_run_it_and_nothing_else():
    shared_scripts = sorted((ROOT / "scripts").glob("run_*.py"))
    amd_scripts = sorted((ROOT / "scripts" / "amd").glob("run_*.py"))
    assert sorted(p.stem for p in shared_scripts) == sorted(f"run_{n}" for n in names())
    assert sorted(p.stem for p in amd_scripts) == sorted(f"run_{n}" for n in names())
    for path in shared_scripts:
        assert _script_calls(path) == [(path.stem.removeprefix("run_"), None)], path
    for path in amd_scripts:
        assert _script_calls(path) == [(path.stem.removeprefix("run_"), "rocm")], path


def test_amd_script_dry_run_prints_a_complete_plan():
    proc = subprocess.run(
        [sys.executable, "scripts/amd/run_glm5_2_744b_a40b.py", "train", "--dry-run", "--run-id", "x"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    for part in (
        "recipe     glm5_2_744b_a40b (rocm form)",
        "--sglang-moe-a2a-backend mori",
        "CUDA_DEVICE_MAX_CONNECTIONS=1",
        "--sequence-parallel",
    ):
        assert part in proc.stdout


def test_prepare_dry_run_prints_the_checkpoint_plan(capsys):
    assert main("glm5_2_744b_a40b", argv=["prepare", "--dry-run", "--platform", "cuda"], env={}) == 0
    out = capsys.readouterr().out
    assert "checkpoint plan: zai-org/GLM-5.2 -> .miles/models/GLM-5.2-744B-A40B-5layer" in out
    assert "steps: fetch, validate, trim, fp8, torch_dist\n" in out  # GLM-5 trains with Megatron
    assert main("inkling", argv=["prepare", "--dry-run", "--platform", "cuda"], env={}) == 0
    assert "steps: fetch, validate, trim, torch_dist\n" in capsys.readouterr().out  # Megatron, bf16 rollouts
    assert main("deepseek_v4", argv=["prepare", "--dry-run", "--platform", "cuda"], env={}) == 0
    assert "steps: fetch, validate, trim, fp8, torch_dist\n" in capsys.readouterr().out


def test_prepare_dry_run_of_a_recipe_with_a_fallback_writes_no_torch_dist(capsys, inkling_unbuilt):
    assert main("inkling", argv=["prepare", "--dry-run", "--platform", "cuda"], env={}) == 0
    assert (
        "torch_dist" not in capsys.readouterr().out.split("steps: ")[1]
    )  # its FSDP fallback loads the HF dir


def test_prepare_with_a_bad_checkpoint_source_exits_2_with_one_line(tmp_path, capsys):
    missing = tmp_path / "no-such-checkpoint"
    argv = ["prepare", "--platform", "cuda", "--source", str(missing), "--model-dir", str(tmp_path)]
    assert main("qwen3_4b", argv=argv, env={}) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: fetch of Qwen3-4B: source {missing} has no config.json")
    assert "Traceback" not in err


def test_shared_script_under_a_wrong_platform_variable_refuses(capsys):
    assert main("inkling", argv=["train", "--dry-run"], env={"MILES_HARDWARE_PLATFORM": "rocm"}) == 2
    assert "MILES_HARDWARE_PLATFORM=rocm but this machine is cpu" in capsys.readouterr().err


def test_megatron_gpu_jobs_run_with_one_device_connection(inkling_unbuilt):
    cuda = build_plan(shared("qwen3_4b"), replace(FIXED, model="Qwen3-4B"), base_env={})
    assert dict(cuda.env)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    rocm = build_plan(load("glm5_2_744b_a40b", platform="rocm"), FIXED, base_env={})
    assert dict(rocm.env)["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    fallback = build_plan(load("inkling", platform="rocm"), FIXED, base_env={})  # FSDP: no Megatron kernels
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in dict(fallback.env)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in dict(build_plan(shared("qwen3_4b"), FIXED, base_env={}).env)


def test_extra_env_that_breaks_the_layouts_device_connections_is_refused():
    options = replace(FIXED, model="Qwen3-4B", extra_env=(("CUDA_DEVICE_MAX_CONNECTIONS", "8"),))
    with pytest.raises(LaunchError, match="needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the launch environment"):
        build_plan(shared("qwen3_4b"), options, base_env={})


def test_mori_all_to_all_renders_on_rocm_and_is_refused_on_cuda_before_anything_starts():
    # GLM-5.2's ROCm form routes SGLang's MoE all-to-all through MoRI (AMD's ROCm library); the
    # same flag on a CUDA plan is refused at render time, with the backend that runs there
    rocm = build_plan(
        load("glm5_2_744b_a40b", platform="rocm"),
        replace(FIXED, model="GLM-5.2-744B-A40B-5layer"),
        base_env={},
    )
    args = list(rocm.command)
    assert args[args.index("--sglang-moe-a2a-backend") + 1] == "mori"
    cuda = replace(FIXED, model="GLM-5.2-744B-A40B-5layer", extra_args=("--sglang-moe-a2a-backend", "mori"))
    with pytest.raises(
        LaunchError, match="mori: MoRI.*AMD GPUs \\(ROCm\\) only.*use --sglang-moe-a2a-backend deepep"
    ):
        build_plan(shared("glm5_2_744b_a40b"), cuda, base_env={})
    assert (
        build_plan(
            shared("glm5_2_744b_a40b"), replace(FIXED, model="GLM-5.2-744B-A40B-5layer"), base_env={}
        ).platform
        == "cuda"
    )
