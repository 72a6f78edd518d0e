"""Which accelerator this machine has (cpu | cuda | rocm), checked before anything runs on it.

`detect()` asks torch (`torch.version.hip` / `torch.version.cuda`, device count) and falls
back to the vendor tools (`rocm-smi`, `amd-smi`, `nvidia-smi`) when torch is not installed.
`resolve()` honours `MILES_HARDWARE_PLATFORM` (set by the ROCm image) but cross-checks it
against those facts, so a mis-set variable stops the run instead of sending CUDA work down
the AMD path. `job_env()` builds the environment a training job needs on that platform.

torch is imported only inside the functions that need it: `python -m miles.ci list` must
stay a bare-Python command.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

ENV_VAR = "MILES_HARDWARE_PLATFORM"
_TOOL_TIMEOUT_S = 20


class Platform(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"


class PlatformError(RuntimeError):
    """The machine cannot run what was asked of it; the message says what is missing."""


class PlatformMismatch(PlatformError):
    """`MILES_HARDWARE_PLATFORM` disagrees with what torch (or the vendor tool) reports."""


@dataclass(frozen=True)
class PlatformInfo:
    """What was found: the platform, how many accelerators are visible, and from where."""

    platform: Platform
    device_count: int
    torch_build: str | None  # "cuda 12.8", "rocm 7.2", "cpu"; None when torch is absent
    source: str  # where the facts came from: "torch 2.13.0", "nvidia-smi", "MILES_HARDWARE_PLATFORM", ...

    def describe(self) -> str:
        build = f"torch build {self.torch_build}" if self.torch_build else "no torch"
        return f"{self.platform} with {self.device_count} visible GPU(s) ({build}; from {self.source})"


def parse_platform(value: str, *, origin: str = ENV_VAR) -> Platform:
    """`"rocm"` -> Platform.ROCM; a clear error for anything else."""
    try:
        return Platform(value.strip().lower())
    except ValueError:
        known = ", ".join(p.value for p in Platform)
        raise PlatformError(f"{origin}={value!r} is not a platform; use one of {known}") from None


def detect() -> PlatformInfo:
    """The platform of this machine, from torch when it is installed, else from vendor tools."""
    try:
        import torch
    except ImportError:
        return detect_from_tools()
    return _from_torch(torch)


def _from_torch(torch) -> PlatformInfo:
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    source = f"torch {torch.__version__}"
    if hip:
        # torch.cuda is the HIP device API on ROCm builds; it honours HIP_VISIBLE_DEVICES.
        return PlatformInfo(Platform.ROCM, torch.cuda.device_count(), f"rocm {_major_minor(hip)}", source)
    if cuda:
        count = torch.cuda.device_count()
        # A CUDA build with no visible GPU is a CPU machine as far as running work goes.
        platform = Platform.CUDA if count else Platform.CPU
        return PlatformInfo(platform, count, f"cuda {_major_minor(cuda)}", source)
    return PlatformInfo(Platform.CPU, 0, "cpu", source)


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def detect_from_tools(
    which: Callable[[str], str | None] = shutil.which,
) -> PlatformInfo:
    """Count GPUs with the vendor tools; used when torch is not installed (image checks)."""
    for tool, args, counter in _TOOLS:
        path = which(tool)
        if not path:
            continue
        try:
            proc = subprocess.run(
                [path, *args], capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        count = counter(proc.stdout) if proc.returncode == 0 else 0
        if count:
            platform = Platform.CUDA if tool == "nvidia-smi" else Platform.ROCM
            return PlatformInfo(platform, count, None, tool)
    return PlatformInfo(Platform.CPU, 0, None, "no torch and no GPU tool reporting a device")


def _count_rocm_smi(text: str) -> int:
    return len(set(re.findall(r"^GPU\[(\d+)\]", text, flags=re.MULTILINE)))


def _count_amd_smi(text: str) -> int:
    return len(re.findall(r"^GPU:\s*\d+", text, flags=re.MULTILINE))


def _count_nvidia_smi(text: str) -> int:
    return len(re.findall(r"^GPU \d+:", text, flags=re.MULTILINE))


_TOOLS = (
    ("rocm-smi", ("--showid",), _count_rocm_smi),
    ("amd-smi", ("list",), _count_amd_smi),
    ("nvidia-smi", ("-L",), _count_nvidia_smi),
)


def resolve(env: Mapping[str, str] = os.environ, detected: PlatformInfo | None = None) -> PlatformInfo:
    """The platform to run on: `MILES_HARDWARE_PLATFORM` if set and consistent, else `detect()`.

    Forcing `cpu` is always allowed. Forcing `rocm` or `cuda` must match the torch build (or,
    without torch, the vendor tool); otherwise `PlatformMismatch` names both facts.
    """
    info = detected if detected is not None else detect()
    value = env.get(ENV_VAR, "").strip()
    if not value:
        return info
    wanted = parse_platform(value)
    if wanted is Platform.CPU:
        return PlatformInfo(Platform.CPU, 0, info.torch_build, f"{ENV_VAR}=cpu over {info.source}")
    actual = _build_platform(info)
    if actual is not wanted:
        raise PlatformMismatch(
            f"{ENV_VAR}={value} but this machine is {info.describe()}; "
            f"unset {ENV_VAR} or run on a {wanted} machine with a {wanted} torch build"
        )
    return PlatformInfo(
        wanted, info.device_count, info.torch_build, f"{ENV_VAR}={value}, checked by {info.source}"
    )


def _build_platform(info: PlatformInfo) -> Platform:
    """The platform the software targets: the torch build when known, else the detected one."""
    if info.torch_build:
        head = info.torch_build.split()[0]
        return Platform(head) if head in ("cuda", "rocm") else Platform.CPU
    return info.platform


def require(
    platform: Platform | str,
    gpus: int = 0,
    env: Mapping[str, str] = os.environ,
    detected: PlatformInfo | None = None,
) -> PlatformInfo:
    """Check that this machine is `platform` with at least `gpus` visible GPUs; one clear error if not."""
    wanted = parse_platform(str(platform), origin="platform")
    info = resolve(env, detected)
    if info.platform is not wanted:
        raise PlatformError(f"needs {wanted} with {gpus} GPU(s); this machine is {info.describe()}")
    if info.device_count < gpus:
        raise PlatformError(
            f"needs {gpus} visible {wanted} GPU(s); this machine is {info.describe()}"
            f"{_visible_hint(wanted, env)}"
        )
    return info


def _visible_hint(platform: Platform, env: Mapping[str, str]) -> str:
    name = "HIP_VISIBLE_DEVICES" if platform is Platform.ROCM else "CUDA_VISIBLE_DEVICES"
    return f" ({name}={env[name]})" if name in env else ""


# Ray must not rewrite the visible-device variables of the actors it starts: on ROCm the
# runner is pinned to half a host by HIP_VISIBLE_DEVICES and Ray would override it.
RAY_NOSET_VARS = (
    "RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES",
)
# ROCm runtime settings of the jobs; the job's own values win. They are the runtime variables the
# seed framework's ROCm image sets (miles/recipes/references/rocm_image_env.json, read from
# radixark/miles docker/Dockerfile.rocm at 31f1ca961a94cb860cec3b2dea34ec332bfa8f76), but
# MILES_HARDWARE_PLATFORM (the image's fact about itself, never a job's) and SGLANG_USE_ROCM700A
# (a switch for ROCm 7.0 builds, 0 there; miles' image is ROCm 7.2). docker/Dockerfile.rocm sets
# the same (tests/unit/test_platform.py keeps the three equal).
ROCM_RUNTIME_ENV = {
    # ROCm 7.2's dma-buf IPC leaks the memory a process exports, which every weight push to
    # the engine does; legacy IPC releases it (sglang docker/rocm.Dockerfile, ROCM-21485)
    "HSA_ENABLE_IPC_MODE_LEGACY": "1",
    # keep the scratch memory kernels were given instead of reclaiming it after each launch
    "HSA_NO_SCRATCH_RECLAIM": "1",
    # kernel arguments in device memory, as SGLang's ROCm kernels expect
    "HIP_FORCE_DEV_KERNARG": "1",
    # enough RCCL channels for MI300/MI350 collective bandwidth
    "NCCL_MIN_NCHANNELS": "112",
    # SGLang's aiter kernels (its default attention backend on ROCm)
    "SGLANG_USE_AITER": "1",
    # a --context-length past the checkpoint's derived one is taken with a warning, not refused
    # (sglang 0.5.23 srt/configs/model_config.py)
    "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
    # triton fused-MoE weights padded for the ROCm kernels (srt/layers/moe/utils.py)
    "SGLANG_MOE_PADDING": "1",
    # each scheduler process pinned to its GPU's cores (srt/managers/scheduler.py)
    "SGLANG_SET_CPU_AFFINITY": "1",
    # the fused MLA decode with rope on ROCm (deepseek_common/forward_mla_fused_rope_rocm.py)
    "SGLANG_ROCM_FUSED_DECODE_MLA": "1",
    # torch.compile's inductor autotunes its kernels, pointwise ones too
    "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
    "TORCHINDUCTOR_MAX_AUTOTUNE_POINTWISE": "1",
    # Ray leaves the device variables of a num_gpus=0 actor alone (the seed's image: so Megatron's
    # device checks find the GPUs)
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
}
# What the seed's image sets that ROCm jobs do not get, and why.
NOT_A_JOB_SETTING = {
    "MILES_HARDWARE_PLATFORM": "the image's fact about itself: a job started outside the image is not ROCm by fiat",
    "SGLANG_USE_ROCM700A": "a switch for ROCm 7.0 builds (0 in the seed's image by default); miles' image is ROCm 7.2",
}


def job_env(platform: Platform | str, env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`env` plus what a training job needs on `platform`; the input is not modified.

    On ROCm: HIP_VISIBLE_DEVICES is mirrored to CUDA_VISIBLE_DEVICES (libraries that only
    read the CUDA name see the same devices), Ray is told not to reset them, NVLS (an
    NVIDIA-only NCCL feature RCCL rejects) is switched off, and ROCM_RUNTIME_ENV is added
    where the job does not set it. CUDA and CPU get nothing extra, so the shared NVIDIA path
    carries no ROCm settings.
    """
    platform = parse_platform(str(platform), origin="platform")
    out = dict(env)
    if platform is not Platform.ROCM:
        return out
    hip = out.get("HIP_VISIBLE_DEVICES")
    if hip is not None:
        cuda = out.get("CUDA_VISIBLE_DEVICES")
        if cuda is not None and cuda != hip:
            raise PlatformError(
                f"HIP_VISIBLE_DEVICES={hip} and CUDA_VISIBLE_DEVICES={cuda} disagree; on ROCm set only "
                "HIP_VISIBLE_DEVICES (it is mirrored to CUDA_VISIBLE_DEVICES)"
            )
        out["CUDA_VISIBLE_DEVICES"] = hip
    for name in RAY_NOSET_VARS:
        out[name] = "1"
    out["NCCL_NVLS_ENABLE"] = "0"
    for name, value in ROCM_RUNTIME_ENV.items():
        out.setdefault(name, value)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m miles.platform`: print what was detected and what MILES_HARDWARE_PLATFORM resolves to."""
    del argv
    info = detect()
    print(f"detected: {info.describe()}")
    try:
        print(f"resolved: {resolve(detected=info).describe()}")
    except PlatformError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
