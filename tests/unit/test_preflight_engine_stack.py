"""The GPU lane preflight's engine-stack lines: imports, GPU architecture, driver.

There is no GPU here. The imports are real (this interpreter lacks the ROCm engine's
packages); the GPU architecture torch would report on an MI350 is given as a string; the
sgl_kernel package is a folder holding a shared object with the offload-bundle IDs a HIP
build carries; the driver files are written where the kernel would expose them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from miles.ci.machine.gpu_stack import check_driver, check_engine_modules, check_gpu_arch, kernel_archs, probe
from miles.ci.register import register_cpu_ci
from miles.image.config import load_images

register_cpu_ci(est_time=6, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
ROCM = load_images().stack("rocm-mi350")


def test_a_missing_rocm_engine_package_is_one_line_naming_its_source_build():
    found = probe(["aiter", "json"])["modules"]
    assert found["json"] is None
    lines = check_engine_modules(ROCM, found)
    assert lines == [
        "engine: the rollout engine imports aiter, which fails here (ModuleNotFoundError: No module named 'aiter'); "
        "the image builds amd-aiter from ROCm/aiter (docker/Dockerfile.rocm): run the lane in its image"
    ]


def test_every_rocm_engine_module_is_checked_and_cuda_ones_point_at_the_lock():
    cuda = load_images().stack("cuda-h200")
    lines = check_engine_modules(cuda, {"flashinfer": "ModuleNotFoundError: No module named 'flashinfer'"})
    assert lines == [
        "engine: the rollout engine imports flashinfer, which fails here (ModuleNotFoundError: No module named "
        "'flashinfer'); install requirements/cuda-h200.txt (`nox -s <lane>`) or use the lane's image"
    ]
    assert {"sglang", "sgl_kernel", "aiter", "torch_memory_saver"} <= set(ROCM.engine_modules)


def test_the_glm_rocm_overlay_s_moe_backend_is_among_the_engine_modules():
    from miles.recipes import load

    rocm = load("glm5_2_744b_a40b", platform="rocm")
    backends = {v for group in rocm.args for flag, v in group[1] if flag == "--sglang-moe-a2a-backend"}
    assert backends == {"mori"} and "mori" in ROCM.engine_modules


def _sgl_kernel(tmp_path: Path, *archs: str) -> Path:
    package = tmp_path / "site" / "sgl_kernel"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    bundles = b"".join(b"hipv4-amdgcn-amd-amdhsa--" + a.encode() + b"\x00" for a in archs)
    (package / "common_ops.cpython-312-x86_64-linux-gnu.so").write_bytes(
        b"\x7fELF" + b"\x00" * 64 + b"__CLANG_OFFLOAD_BUNDLE__" + bundles + b"\x00" * 64
    )
    return package


def test_a_gfx942_kernel_build_on_a_gfx950_gpu_is_one_line(tmp_path):
    package = _sgl_kernel(tmp_path, "gfx942")
    env = {**os.environ, "PYTHONPATH": str(package.parent)}
    found = probe([], env=env)
    assert found["sgl_kernel_dir"] == str(package)
    (line,) = check_gpu_arch("gfx950", {"MILES_GPU_ARCH": "gfx950"}, found["sgl_kernel_dir"])
    assert line.startswith(
        f"gpu arch: sgl_kernel ({package}/common_ops.cpython-312-x86_64-linux-gnu.so) carries code "
    )
    assert (
        "for gfx942 only, this GPU is gfx950: no SGLang kernel can run; rebuild it with AMDGPU_TARGET=gfx950"
        in line
    )
    assert line.endswith("use the image variant built for it (rocm720-mi35x)")


def test_a_kernel_build_for_this_gpu_passes(tmp_path):
    package = _sgl_kernel(tmp_path, "gfx942", "gfx950")
    assert kernel_archs(package)[0] == ["gfx942", "gfx950"]
    assert check_gpu_arch("gfx950", {"MILES_GPU_ARCH": "gfx950"}, str(package)) == []


def test_an_image_built_for_another_gpu_is_one_line():
    assert check_gpu_arch("gfx950", {"MILES_GPU_ARCH": "gfx942"}, None) == [
        "gpu arch: this GPU is gfx950, the image is built for gfx942 (MILES_GPU_ARCH); use the image variant "
        "built for it (rocm720-mi35x)"
    ]


def _nvidia(tmp_path: Path, version: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "driver" / "nvidia").mkdir(parents=True)
    (proc / "driver" / "nvidia" / "version").write_text(
        f"NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  (dvs-builder@U22)\n"
    )
    return proc


def test_an_nvidia_driver_too_old_for_the_stacks_cuda_is_one_line(tmp_path):
    (line,) = check_driver("cuda", {"cuda": "13.0"}, proc=_nvidia(tmp_path / "old", "570.86.15"))
    assert line == (
        "driver: NVIDIA driver 570.86.15 is older than 580.65.6, the minimum for CUDA 13 (the stack's torch is "
        "built for CUDA 13.0); run on a runner with a newer driver"
    )
    assert check_driver("cuda", {"cuda": "13.0"}, proc=_nvidia(tmp_path / "new", "580.95.05")) == []


def _amd(tmp_path: Path, version: str | None, kfd: bool = True) -> dict:
    (tmp_path / "dev").mkdir(parents=True)
    if kfd:
        (tmp_path / "dev" / "kfd").write_text("")
    if version:
        (tmp_path / "sys" / "module" / "amdgpu").mkdir(parents=True)
        (tmp_path / "sys" / "module" / "amdgpu" / "version").write_text(version + "\n")
    return {"dev": tmp_path / "dev", "sys_dir": tmp_path / "sys"}


def test_rocm_needs_the_kfd_device_and_an_amdgpu_release_the_stack_supports(tmp_path):
    hip = {"hip": "7.2.53211"}
    (line,) = check_driver("rocm", hip, **_amd(tmp_path / "no-kfd", None, kfd=False))
    assert line.startswith("driver: /dev/kfd is missing: the amdgpu kernel driver is not loaded here")
    (line,) = check_driver("rocm", hip, **_amd(tmp_path / "old", "30.40.1"))
    assert line.startswith("driver: amdgpu 30.40.1 is not one ROCm 7.2 supports (amdgpu 30.10, 30.20, 30.30;")
    assert check_driver("rocm", hip, **_amd(tmp_path / "ok", "30.30.2")) == []
    assert (
        check_driver("rocm", hip, **_amd(tmp_path / "in-tree", "6.16.13")) == []
    )  # no release series to compare


def test_the_rocm_lane_preflight_names_the_missing_engine_packages_here():
    env = {**os.environ, "MILES_PREFLIGHT_MIN_FREE_GB": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "miles.ci", "preflight", "--lane", "rocm-mi350"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 3
    engine = [line for line in done.stderr.splitlines() if line.startswith("preflight: engine: ")]
    named = [line.split(" imports ", 1)[1].split(",", 1)[0] for line in engine]
    assert {"aiter", "torch_memory_saver", "mori"} <= set(named), done.stderr
