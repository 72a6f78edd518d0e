"""miles.platform: detection, the MILES_HARDWARE_PLATFORM cross-check, and job environments.

This machine has a CPU build of torch and no GPU, so the CUDA/ROCm facts are given as
PlatformInfo records and the vendor tools as small scripts printing what the real tools print
(a GPU and its tools cannot exist here).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.platform import (
    Platform,
    PlatformError,
    PlatformInfo,
    PlatformMismatch,
    detect,
    detect_from_tools,
    job_env,
    require,
    resolve,
)

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
ROCM_BUILD = PlatformInfo(Platform.ROCM, 4, "rocm 7.2", "torch 2.9.0")
CUDA_BUILD = PlatformInfo(Platform.CUDA, 8, "cuda 12.8", "torch 2.9.0")
CPU_BUILD = PlatformInfo(Platform.CPU, 0, "cpu", "torch 2.13.0")


def _fake_tool(tmp_path: Path, name: str, output: str) -> Path:
    tool = tmp_path / name
    # Shell builtins only: the tests put nothing else on PATH.
    lines = "".join(f"echo '{line}'\n" for line in output.splitlines())
    tool.write_text(f"#!/bin/sh\n{lines}")
    tool.chmod(0o755)
    return tool


def test_detect_reports_the_cpu_torch_build_of_this_machine():
    import torch

    info = detect()
    assert info.platform is Platform.CPU
    assert info.device_count == 0
    assert info.torch_build == "cpu"
    assert info.source == f"torch {torch.__version__}"


def test_detect_falls_back_to_vendor_tools_when_torch_is_absent(tmp_path, monkeypatch):
    _fake_tool(tmp_path, "nvidia-smi", "GPU 0: NVIDIA H200 (UUID: GPU-a)\nGPU 1: NVIDIA H200 (UUID: GPU-b)")
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect() == PlatformInfo(Platform.CUDA, 2, None, "nvidia-smi")


def test_rocm_smi_devices_are_counted_once_each(tmp_path):
    tool = _fake_tool(
        tmp_path,
        "rocm-smi",
        "GPU[0]\t\t: Device ID: 0x74a5\nGPU[0]\t\t: Device Rev: 0x00\nGPU[1]\t\t: Device ID: 0x74a5",
    )
    info = detect_from_tools(which=lambda name: str(tool) if name == "rocm-smi" else None)
    assert info == PlatformInfo(Platform.ROCM, 2, None, "rocm-smi")


def test_no_torch_and_no_tool_is_cpu(monkeypatch):
    info = detect_from_tools(which=lambda name: None)
    assert info.platform is Platform.CPU and info.device_count == 0 and info.torch_build is None


def test_unset_variable_resolves_to_the_detected_platform():
    assert resolve({}, detected=ROCM_BUILD) == ROCM_BUILD


def test_rocm_variable_on_a_cpu_torch_build_names_both_facts():
    with pytest.raises(PlatformMismatch) as err:
        resolve({"MILES_HARDWARE_PLATFORM": "rocm"}, detected=CPU_BUILD)
    message = str(err.value)
    assert "MILES_HARDWARE_PLATFORM=rocm" in message
    assert "torch build cpu" in message


def test_rocm_variable_on_this_machine_is_refused():
    with pytest.raises(PlatformMismatch, match="MILES_HARDWARE_PLATFORM=rocm.*torch build cpu"):
        resolve({"MILES_HARDWARE_PLATFORM": "rocm"})


def test_rocm_variable_on_a_cuda_build_is_refused():
    with pytest.raises(PlatformMismatch, match="torch build cuda 12.8"):
        resolve({"MILES_HARDWARE_PLATFORM": "rocm"}, detected=CUDA_BUILD)


def test_cuda_variable_on_a_rocm_build_is_refused():
    with pytest.raises(PlatformMismatch, match="MILES_HARDWARE_PLATFORM=cuda.*rocm 7.2"):
        resolve({"MILES_HARDWARE_PLATFORM": "cuda"}, detected=ROCM_BUILD)


def test_matching_variable_is_honoured_and_says_it_was_checked():
    info = resolve({"MILES_HARDWARE_PLATFORM": "ROCm"}, detected=ROCM_BUILD)
    assert (info.platform, info.device_count) == (Platform.ROCM, 4)
    assert "checked by torch 2.9.0" in info.source


def test_cpu_can_be_forced_on_a_gpu_machine():
    info = resolve({"MILES_HARDWARE_PLATFORM": "cpu"}, detected=CUDA_BUILD)
    assert (info.platform, info.device_count) == (Platform.CPU, 0)


def test_unknown_platform_value_lists_the_known_ones():
    with pytest.raises(PlatformError, match="'mi350' is not a platform; use one of cpu, cuda, rocm"):
        resolve({"MILES_HARDWARE_PLATFORM": "mi350"}, detected=CPU_BUILD)


def test_require_reports_missing_gpus_with_the_visible_devices_variable():
    env = {"HIP_VISIBLE_DEVICES": "0,1"}
    two = PlatformInfo(Platform.ROCM, 2, "rocm 7.2", "torch 2.9.0")
    with pytest.raises(PlatformError, match=r"needs 4 visible rocm GPU\(s\).*HIP_VISIBLE_DEVICES=0,1"):
        require("rocm", gpus=4, env=env, detected=two)


def test_require_rejects_the_wrong_vendor():
    with pytest.raises(PlatformError, match="needs rocm with 4 GPU"):
        require(Platform.ROCM, gpus=4, env={}, detected=CUDA_BUILD)


def test_rocm_job_env_mirrors_hip_devices_and_pins_ray_and_nccl():
    env = {"HIP_VISIBLE_DEVICES": "4,5,6,7", "PATH": "/bin"}
    out = job_env("rocm", env)
    assert out["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert out["RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES"] == "1"
    assert out["RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES"] == "1"
    assert out["NCCL_NVLS_ENABLE"] == "0"
    assert out["PATH"] == "/bin"
    assert env == {"HIP_VISIBLE_DEVICES": "4,5,6,7", "PATH": "/bin"}


def test_rocm_jobs_get_the_runtime_settings_a_colocated_engine_needs_unless_they_set_their_own():
    out = job_env("rocm", {"NCCL_MIN_NCHANNELS": "32"})
    assert out["HSA_ENABLE_IPC_MODE_LEGACY"] == "1" and out["HSA_NO_SCRATCH_RECLAIM"] == "1"
    assert out["HIP_FORCE_DEV_KERNARG"] == "1" and out["NCCL_MIN_NCHANNELS"] == "32"


def test_the_rocm_image_sets_the_same_runtime_settings():
    from pathlib import Path

    from miles.platform import ROCM_RUNTIME_ENV

    text = (Path(__file__).resolve().parents[2] / "docker" / "Dockerfile.rocm").read_text()
    env = " ".join(line.strip() for line in text.replace("\\\n", " ").splitlines() if line.startswith("ENV "))
    assert all(f"{name}={value}" in env for name, value in ROCM_RUNTIME_ENV.items()), env


def test_rocm_job_env_refuses_disagreeing_device_lists():
    with pytest.raises(PlatformError, match="HIP_VISIBLE_DEVICES=0,1 and CUDA_VISIBLE_DEVICES=2,3 disagree"):
        job_env(Platform.ROCM, {"HIP_VISIBLE_DEVICES": "0,1", "CUDA_VISIBLE_DEVICES": "2,3"})


def test_cuda_job_env_carries_no_rocm_settings():
    out = job_env("cuda", {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert out == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_importing_the_module_does_not_import_torch():
    code = "import sys, miles.platform; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ}, check=False)
    assert proc.returncode == 0


def test_rocm_jobs_get_every_runtime_variable_the_seeds_image_sets():
    from miles.platform import NOT_A_JOB_SETTING, ROCM_RUNTIME_ENV
    from miles.recipes.references import rocm_image_env

    seed = rocm_image_env()["env"]  # radixark/miles docker/Dockerfile.rocm, re-read by `references --check`
    out = job_env("rocm", {})
    missing = {k: v for k, v in seed.items() if k not in NOT_A_JOB_SETTING and out.get(k) != v}
    assert missing == {}
    assert set(NOT_A_JOB_SETTING) <= set(seed)
    assert {"SGLANG_MOE_PADDING", "SGLANG_ROCM_FUSED_DECODE_MLA", "SGLANG_SET_CPU_AFFINITY",
            "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN", "TORCHINDUCTOR_MAX_AUTOTUNE",
            "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"} <= set(ROCM_RUNTIME_ENV)  # fmt: skip
