"""The GPU lane preflight's look at the engine stack: what the rollout engine imports, which GPU
the image's kernels are built for, and whether the driver can run the stack. One line each.

- engine: every module of the stack's `engine_modules` (miles/image/images.toml) imports in the
  lane's interpreter; a missing one is named with where it comes from (the lock, or the
  image's source build).
- gpu arch (ROCm): the GPU's architecture (torch's gcnArchName) is the one the image was built
  for (`MILES_GPU_ARCH`, set by docker/Dockerfile.rocm) and one sgl_kernel's code objects
  target (the `amdgcn-amd-amdhsa--gfxNNN` offload-bundle IDs in its shared objects): a gfx942
  build runs no kernel on a gfx950 GPU.
- driver: NVIDIA's kernel module is at least the minimum driver of the CUDA major the stack's
  torch is built for (CUDA Toolkit release notes, table 3: CUDA 13.x GA needs >= 580.65.06,
  12.x >= 525.60.13 on Linux); on ROCm /dev/kfd exists and an amdgpu driver that reports its
  release series (30.x) is one the stack's ROCm release supports (ROCm 7.2.2 release notes:
  MI350X/MI355X with amdgpu 30.10, 30.20 or 30.30).

Standard library only: the probes run in a subprocess of the lane's interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

CUDA_MIN_DRIVER = {13: (580, 65, 6), 12: (525, 60, 13)}
ROCM_AMDGPU_SERIES = {"7.2": ("30.10", "30.20", "30.30")}
_BUNDLE_ARCH = re.compile(rb"amdgcn-amd-amdhsa--(gfx[0-9a-f]+)")
_NVIDIA_MODULE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+)\.(\d+)(?:\.(\d+))?")

# Run in the lane's interpreter: import each module, and say what torch sees.
_PROBE = r"""
import importlib, importlib.util, json, sys
out = {"modules": {}, "torch": None, "gpu_arch": None, "sgl_kernel_dir": None}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
        out["modules"][name] = None
    except BaseException as exc:
        text = str(exc).strip().splitlines()
        out["modules"][name] = f"{type(exc).__name__}: {text[0] if text else ''}"
spec = importlib.util.find_spec("sgl_kernel")
if spec is not None and spec.submodule_search_locations:
    out["sgl_kernel_dir"] = list(spec.submodule_search_locations)[0]
try:
    import torch
    out["torch"] = {"cuda": torch.version.cuda, "hip": torch.version.hip}
    if torch.version.hip and torch.cuda.is_available() and torch.cuda.device_count():
        out["gpu_arch"] = torch.cuda.get_device_properties(0).gcnArchName.split(":")[0]
except Exception:
    pass
print(json.dumps(out))
"""


def probe(modules: Sequence[str], python: str = sys.executable, env: Mapping[str, str] | None = None) -> dict:
    """What the lane's interpreter imports and sees (modules: name -> error or None)."""
    done = subprocess.run(
        [python, "-c", _PROBE, json.dumps(list(modules))],
        capture_output=True, text=True, timeout=600, env=dict(env) if env is not None else None,
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {
            "modules": dict.fromkeys(modules, f"the probe failed: {tail}"),
            "torch": None,
            "gpu_arch": None,
        }
    return json.loads(lines[-1])


def check_engine_modules(stack, found: Mapping[str, str | None]) -> list[str]:
    """One line per engine module that does not import, saying where it should come from."""
    builds = {b.module: b for b in stack.source_builds}
    lines = []
    for name in stack.engine_modules:
        error = found.get(name)
        if error is None:
            continue
        build = builds.get(name)
        where = (
            f"the image builds {build.dist} from {build.repo} (docker/Dockerfile.rocm): run the lane in its image"
            if build
            else f"install {stack.lock_path} (`nox -s <lane>`) or use the lane's image"
        )
        lines.append(f"engine: the rollout engine imports {name}, which fails here ({error}); {where}")
    return lines


def kernel_archs(package_dir: str | Path | None) -> tuple[list[str], str | None]:
    """(GPU architectures the shared objects under `package_dir` carry code for, the first such file)."""
    if not package_dir:
        return [], None
    archs: set[str] = set()
    first = None
    for path in sorted(Path(package_dir).rglob("*.so")):
        found = {m.decode() for m in _BUNDLE_ARCH.findall(path.read_bytes())}
        if found and first is None:
            first = str(path)
        archs |= found
    return sorted(archs), first


def variant_for_arch(arch: str, config=None) -> str | None:
    from miles.image.config import load_images

    config = config or load_images()
    for variant in config.variants.values():
        if arch in dict(variant.build_args).get("GPU_ARCHS", "").split(";"):
            return variant.name
    return None


def check_gpu_arch(gpu_arch: str | None, env: Mapping[str, str], sgl_kernel_dir: str | None) -> list[str]:
    """The image's and sgl_kernel's architectures against the GPU's (ROCm)."""
    if not gpu_arch:
        return []
    variant = variant_for_arch(gpu_arch)
    fix = f"use the image variant built for it ({variant})" if variant else f"build an image for {gpu_arch}"
    lines = []
    image = env.get("MILES_GPU_ARCH", "")
    if image and gpu_arch not in image.split(";"):
        lines.append(
            f"gpu arch: this GPU is {gpu_arch}, the image is built for {image} (MILES_GPU_ARCH); {fix}"
        )
    archs, where = kernel_archs(sgl_kernel_dir)
    if archs and gpu_arch not in archs:
        lines.append(
            f"gpu arch: sgl_kernel ({where}) carries code for {', '.join(archs)} only, this GPU is {gpu_arch}: "
            f"no SGLang kernel can run; rebuild it with AMDGPU_TARGET={gpu_arch} or {fix}"
        )
    return lines


def nvidia_driver(proc: Path = Path("/proc")) -> tuple[int, ...] | None:
    try:
        text = (proc / "driver" / "nvidia" / "version").read_text()
    except OSError:
        return None
    match = _NVIDIA_MODULE.search(text)
    return tuple(int(g) for g in match.groups() if g is not None) if match else None


def check_driver(
    backend: str, torch_build: Mapping[str, str | None] | None, *, proc: Path = Path("/proc"),
    sys_dir: Path = Path("/sys"), dev: Path = Path("/dev"),
) -> list[str]:  # fmt: skip
    """The kernel driver against the runtime the stack's torch is built for."""
    torch_build = torch_build or {}
    if backend == "cuda":
        runtime, driver = torch_build.get("cuda"), nvidia_driver(proc)
        if not runtime or driver is None:
            return []
        major = int(runtime.split(".")[0])
        needed = CUDA_MIN_DRIVER.get(major)
        if needed and driver < needed:
            shown = ".".join(map(str, driver))
            return [
                f"driver: NVIDIA driver {shown} is older than {'.'.join(map(str, needed))}, the minimum for "
                f"CUDA {major} (the stack's torch is built for CUDA {runtime}); run on a runner with a newer driver"
            ]
        return []
    if backend != "rocm":
        return []
    if not (dev / "kfd").exists():
        return [
            "driver: /dev/kfd is missing: the amdgpu kernel driver is not loaded here (in a container: "
            "pass --device=/dev/kfd --device=/dev/dri)"
        ]
    runtime = torch_build.get("hip") or ""
    release = ".".join(runtime.split(".")[:2])
    try:
        version = (sys_dir / "module" / "amdgpu" / "version").read_text().strip()
    except OSError:
        return []
    series = ".".join(version.split(".")[:2])
    supported = ROCM_AMDGPU_SERIES.get(release)
    if supported and version.startswith("30.") and series not in supported:
        return [
            f"driver: amdgpu {version} is not one ROCm {release} supports (amdgpu {', '.join(supported)}; the "
            f"stack's torch is built for HIP {runtime}); update the driver or run on a runner that has it"
        ]
    return []


def gpu_stack_problems(lane: str, backend: str, env: Mapping[str, str], *, machine_only: bool) -> list[str]:
    """Every engine-stack line for `lane` (GPU backends only); the engine imports only once the
    stack is installed (not with --machine-only)."""
    if backend not in ("cuda", "rocm"):
        return []
    from miles.ci.machine.stacks import stack_for_lane

    stack = stack_for_lane(lane)
    found = probe([] if machine_only else stack.engine_modules, env=env if env is not os.environ else None)
    problems = [] if machine_only else check_engine_modules(stack, found["modules"])
    if backend == "rocm":
        problems += check_gpu_arch(found.get("gpu_arch"), env, found.get("sgl_kernel_dir"))
    return problems + check_driver(backend, found.get("torch"))
