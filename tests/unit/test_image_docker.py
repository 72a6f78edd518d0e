"""refresh-image and check-image against a stand-in `docker`, and the patch script with real git.

No docker engine exists on the development machines or in CI's test job, so `docker` here is
a small script on PATH that logs its arguments and answers `imagetools inspect` and `run`
from files the test writes. Everything else (hashing, staging, the pins check) is real.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from miles.ci.machine.stacks import image_config
from miles.ci.register import register_cpu_ci
from miles.image.config import load_images
from miles.image.inputs import LABEL_HASH, LABEL_TAG, variant_inputs
from miles.image.plan import ImageError, check_image, plan_refresh, refresh, subprocess_runner

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "docker" / "apply-patches.sh"

FAKE_DOCKER = """#!/usr/bin/env bash
echo "$*" >> "$FAKE_DOCKER_DIR/calls.log"
if [[ "$1 $2 $3" == "buildx imagetools inspect" ]]; then
    answer="$FAKE_DOCKER_DIR/inspect/$(printf '%s' "$4" | tr '/:' '__')"
    [[ -f "$answer" ]] && cat "$answer" && exit 0
    echo "ERROR: $4: not found" >&2; exit 1
fi
if [[ "$1 $2" == "buildx build" ]]; then exit "${FAKE_BUILD_EXIT:-0}"; fi
if [[ "$1" == "run" ]]; then cat "$FAKE_DOCKER_DIR/packages.json"; exit 0; fi
exit 3
"""


@pytest.fixture
def docker(tmp_path: Path, monkeypatch) -> Path:
    home = tmp_path / "fake-docker"
    (home / "inspect").mkdir(parents=True)
    (home / "bin").mkdir()
    script = home / "bin" / "docker"
    script.write_text(FAKE_DOCKER)
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_DOCKER_DIR", str(home))
    monkeypatch.setenv("PATH", f"{home / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return home


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    config = load_images()
    for variant in config.variants.values():
        for rel in variant_inputs(ROOT, variant, config):
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, root / rel)
    return root


def _calls(docker: Path) -> list[str]:
    log = docker / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def _publish(docker: Path, ref: str, labels: dict[str, str]) -> None:
    answer = {"config": {"Labels": labels}}
    (docker / "inspect" / ref.replace("/", "_").replace(":", "_")).write_text(json.dumps(answer))


def _plan(project: Path, **kw):
    return plan_refresh(
        project,
        "rocm720-mi35x",
        image="ghcr.io/x/miles",
        today=dt.date(2026, 3, 9),
        config=image_config(),
        **kw,
    )


def test_build_is_skipped_when_the_alias_carries_the_same_inputs(docker, project):
    plan = _plan(project)
    older = "ghcr.io/x/miles:rocm720-mi35x-20260301-" + plan.inputs.short
    _publish(docker, plan.alias, {LABEL_HASH: plan.inputs.digest, LABEL_TAG: older})
    result = refresh(project, plan, subprocess_runner)
    assert (result.built, result.tag) == (False, older)
    assert not any(call.startswith("buildx build") for call in _calls(docker))


def test_new_inputs_are_built_from_a_context_of_exactly_those_inputs(docker, project):
    plan = _plan(project)
    (project / "unrelated.txt").write_text("not an input\n")
    result = refresh(project, plan, subprocess_runner)
    assert (result.built, result.tag) == (True, plan.tag)
    (build,) = [c for c in _calls(docker) if c.startswith("buildx build")]
    assert build.endswith(plan.context) and f"--tag {plan.tag}" in build
    staged = sorted(
        p.relative_to(project / plan.context).as_posix() for p in (project / plan.context).rglob("*")
    )
    staged = [p for p in staged if (project / plan.context / p).is_file()]
    assert staged == sorted(path for path, _ in plan.inputs.entries if "#" not in path)


def test_a_dated_tag_with_other_inputs_is_never_overwritten(docker, project):
    plan = _plan(project)
    _publish(docker, plan.tag, {LABEL_HASH: "f" * 64})
    with pytest.raises(ImageError, match="never overwritten"):
        refresh(project, plan, subprocess_runner)
    assert not any(call.startswith("buildx build") for call in _calls(docker))


def test_pins_disagreement_stops_before_docker_is_called(docker, project):
    dockerfile = project / "docker" / "Dockerfile.rocm"
    dockerfile.write_text(dockerfile.read_text().replace("SGLANG_VERSION=0.5.23", "SGLANG_VERSION=0.5.9"))
    with pytest.raises(ImageError, match=r"sglang: found 0.5.9, lock pins 0.5.23"):
        refresh(project, _plan(project), subprocess_runner)
    assert _calls(docker) == []


def test_a_failed_build_says_the_tag_was_not_written(docker, project, monkeypatch):
    monkeypatch.setenv("FAKE_BUILD_EXIT", "1")
    with pytest.raises(ImageError, match="was not written"):
        refresh(project, _plan(project), subprocess_runner)


def test_check_image_diffs_installed_packages_against_the_lock(docker):
    from miles.image.pins import parse_lock

    lock = parse_lock(ROOT / "requirements" / "rocm-mi350.txt")
    installed = {name: pin.version for name, pin in lock.pins.items()}
    installed["torch"] = "2.14.0+rocm7.2"
    del installed["numba"]
    installed["sgl-kernel"] = "0.4.10"
    (docker / "packages.json").write_text(json.dumps(installed))
    result = check_image(ROOT, "ghcr.io/x/miles:rocm720-mi35x-20260309-0123abcd", run=subprocess_runner)
    assert not result.ok
    assert [m.name for m in result.mismatches] == ["numba", "torch"]
    assert "sgl-kernel" in result.render()
    assert result.missing_builds == ("sglang-kernel", "amd-aiter", "amd-mori", "torch-memory-saver")


def _rocm_image_packages(**changes) -> dict[str, str]:
    """What `pip list` shows in a complete ROCm image: the lock plus the source builds."""
    from miles.image.pins import parse_lock

    installed = {
        name: pin.version for name, pin in parse_lock(ROOT / "requirements" / "rocm-mi350.txt").pins.items()
    }
    installed |= {
        "sglang-kernel": "0.4.10",
        "amd-aiter": "0.1.13",
        "amd-mori": "0.0.0",
        "torch-memory-saver": "0.0.10",
    }
    return {k: v for k, v in (installed | changes).items() if v is not None}


def test_a_complete_rocm_image_agrees_with_its_lock_and_lists_its_source_builds(docker):
    (docker / "packages.json").write_text(json.dumps(_rocm_image_packages()))
    result = check_image(ROOT, "ghcr.io/x/miles:rocm720-mi35x-20260309-0123abcd", run=subprocess_runner)
    assert result.ok, result.render()
    assert (
        "not in the lock (built in the image): amd-aiter, amd-mori, sglang-kernel, torch-memory-saver"
        in result.render()
    )


def test_check_image_names_a_source_build_the_image_lacks(docker):
    (docker / "packages.json").write_text(
        json.dumps(_rocm_image_packages(**{"amd-aiter": None, "amd-mori": None}))
    )
    result = check_image(ROOT, "ghcr.io/x/miles:rocm720-mi35x-20260309-0123abcd", run=subprocess_runner)
    assert not result.ok and result.mismatches == ()
    assert (
        "  amd-aiter: missing; the image builds it from source (images.toml source_builds)" in result.render()
    )
    assert "  amd-mori: missing;" in result.render()


def test_refresh_dry_shows_each_rocm_source_build_for_the_variants_gpu(project):
    mi35x = _plan(project).render()
    for piece in (
        "builds      sglang-kernel (import sgl_kernel) from sgl-project/sglang (python/sglang/kernels/aot) @ 0.5.23, for GPU_ARCHS=gfx950",
        "builds      amd-aiter (import aiter) from ROCm/aiter @ c16d44b93a528b2a4bfd6d8d3409116d465872a9, for GPU_ARCHS=gfx950",
        "builds      amd-mori (import mori) from ROCm/mori @ 12d1bc32d0c93dcd5062e74f4e0f772e36e1aac4, for GPU_ARCHS=gfx950",
        "builds      torch-memory-saver (import torch_memory_saver) from fzyzcjy/torch_memory_saver @ f05a8754",
    ):  # fmt: skip
        assert piece in mi35x, mi35x
    mi30x = plan_refresh(
        project, "rocm720-mi30x", image="ghcr.io/x/miles", today=dt.date(2026, 3, 9), config=image_config()
    ).render()
    assert "@ 0.5.23, for GPU_ARCHS=gfx942" in mi30x


def test_a_source_build_without_its_pin_stops_the_build(docker, project):
    dockerfile = project / "docker" / "Dockerfile.rocm"
    text = dockerfile.read_text()
    dockerfile.write_text(text.replace("ARG MORI_COMMIT=", "ARG MORI_REF="))
    with pytest.raises(
        ImageError, match=r"amd-mori: docker/Dockerfile.rocm has no `ARG MORI_COMMIT=<release or commit>`"
    ):
        refresh(project, _plan(project), subprocess_runner)
    assert _calls(docker) == []


def _run_lines(dockerfile: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined."""
    return [line.strip() for line in dockerfile.read_text().replace("\\\n", " ").splitlines() if line.strip()]


def test_the_rocm_image_builds_its_kernels_for_the_variants_gpu():
    # without AMDGPU_TARGET and with no GPU on the build machine, sgl-kernel's setup_rocm.py
    # targets gfx942 with FNUZ FP8 (sgl-project/sglang sgl-kernel/setup_rocm.py at 01b582cb)
    runs = [line for line in _run_lines(ROOT / "docker" / "Dockerfile.rocm") if line.startswith("RUN ")]

    def step(marker: str) -> str:
        (line,) = [run for run in runs if marker in run]
        return line

    assert "AMDGPU_TARGET=${GPU_ARCHS} python setup_rocm.py install" in step("setup_rocm.py")
    assert "GPU_ARCHS=${GPU_ARCHS}" in step("/opt/aiter")
    assert "MORI_GPU_ARCHS=${GPU_ARCHS}" in step("/opt/mori")
    # torch-memory-saver's setup.py builds for HIP only with hipcc on PATH (miles/image/facts/)
    assert "export PATH=/opt/rocm/bin:${PATH}" in step("torch_memory_saver.git")


def test_the_rocm_image_says_which_gpu_its_kernels_are_built_for():
    # the lane's preflight compares MILES_GPU_ARCH with the GPU (ROCm runtime settings: test_platform.py)
    env = " ".join(
        line for line in _run_lines(ROOT / "docker" / "Dockerfile.rocm") if line.startswith("ENV ")
    )
    assert "MILES_GPU_ARCH=${GPU_ARCHS}" in env


def _patch_tree(tmp_path: Path) -> tuple[Path, Path]:
    target = tmp_path / "src"
    target.mkdir()
    (target / "kernel.py").write_text("def arch():\n    return 'gfx942'\n")
    patches = tmp_path / "patches"
    patches.mkdir()
    (patches / "0001-gfx950.patch").write_text(
        "--- a/kernel.py\n+++ b/kernel.py\n@@ -1,2 +1,2 @@\n def arch():\n-    return 'gfx942'\n+    return 'gfx950'\n"
    )
    return patches, target


def _apply(patches: Path, target: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), str(patches), str(target)], capture_output=True, text=True)


def test_patch_applies_then_is_detected_as_already_applied(tmp_path):
    patches, target = _patch_tree(tmp_path)
    first = _apply(patches, target)
    assert first.returncode == 0 and "applied: 0001-gfx950.patch" in first.stdout
    assert "gfx950" in (target / "kernel.py").read_text()
    again = _apply(patches, target)
    assert again.returncode == 0 and "already applied, skipped: 0001-gfx950.patch" in again.stdout


def test_a_patch_that_does_not_apply_fails_the_build_by_name(tmp_path):
    patches, target = _patch_tree(tmp_path)
    (target / "kernel.py").write_text("def arch():\n    return 'gfx90a'\n")
    done = _apply(patches, target)
    assert done.returncode == 1
    assert "error: 0001-gfx950.patch does not apply" in done.stderr
    assert "gfx90a" in (target / "kernel.py").read_text()
