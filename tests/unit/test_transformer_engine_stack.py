"""Transformer Engine on both GPU lanes: locks, images and preflight say the same thing.

CUDA: the lock pins TE's meta package and CUDA 13 core library at one version, and
docker/Dockerfile builds the torch extension (an sdist) at that version. ROCm: AMD's build,
from the release tag images.toml names, which docker/Dockerfile.rocm must state. The image
plan refuses a disagreement before docker is called; `refresh-image --dry` shows where each
part comes from; a GPU lane's preflight imports TE in a child process, one line per problem.

TE itself cannot be installed here (its core library needs CUDA): the preflight is run for
real against this machine (TE missing), and once with a stand-in distribution that only
carries version metadata, to see a version disagreement reported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from miles.ci.machine.stacks import image_config
from miles.ci.register import register_cpu_ci
from miles.image.config import load_images
from miles.image.pins import parse_lock
from miles.image.plan import ImageError, plan_refresh, refresh
from miles.image.te import expected_version, te_problems, te_sources

register_cpu_ci(est_time=7, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]
GPU_VARIANTS = ("cu13", "rocm720-mi35x", "rocm720-mi30x")


def test_every_gpu_stack_carries_transformer_engine_and_states_it_consistently():
    config = load_images()
    assert {config.variant(v).stack for v in GPU_VARIANTS} == set(te_sources())
    for variant in GPU_VARIANTS:
        assert te_problems(ROOT, config.variant(variant)) == [], variant
    lock = parse_lock(ROOT / "requirements/cuda-h200.txt")
    assert lock.pins["transformer-engine"].version == lock.pins["transformer-engine-cu13"].version
    # the torch extension is an sdist a resolver would have to compile: the image builds it
    assert "transformer-engine-torch" not in lock.pins
    # what the extension imports at run time is locked on both lanes
    for stack in ("cuda-h200", "rocm-mi350"):
        pins = parse_lock(ROOT / f"requirements/{stack}.txt").pins
        assert {"onnx", "onnxscript", "einops", "nvdlfw-inspect"} <= set(pins), stack


def _project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    for rel in (
        "requirements/cuda-h200.txt",
        "requirements/rocm-mi350.txt",
        "docker/Dockerfile",
        "docker/Dockerfile.rocm",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, root / rel)
    shutil.copytree(ROOT / "docker" / "patches", root / "docker" / "patches")
    shutil.copy2(ROOT / "docker" / "apply-patches.sh", root / "docker" / "apply-patches.sh")
    return root


def _edit(path: Path, old: str, new: str) -> int:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return text[: text.index(old)].count("\n") + 1


def test_a_dockerfile_arg_that_is_not_the_locks_version_is_reported(tmp_path):
    root = _project(tmp_path)
    line = _edit(
        root / "docker/Dockerfile",
        "ARG TRANSFORMER_ENGINE_VERSION=2.9.0",
        "ARG TRANSFORMER_ENGINE_VERSION=2.19.0",
    )
    pin = parse_lock(root / "requirements/cuda-h200.txt").pins["transformer-engine"]
    assert te_problems(root, load_images().variant("cu13")) == [
        f"transformer-engine: docker/Dockerfile:{line} says 2.19.0, requirements/cuda-h200.txt:{pin.line} pins 2.9.0"
    ]


def test_an_image_building_the_torch_extension_at_another_version_is_refused_before_docker(tmp_path):
    root = _project(tmp_path)
    _edit(
        root / "docker/Dockerfile",
        '"transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}"',
        '"transformer-engine-torch"',
    )
    plan = plan_refresh(root, "cu13", image="ghcr.io/x/miles", config=image_config())
    calls = []
    with pytest.raises(
        ImageError, match="does not build transformer-engine-torch==\\$\\{TRANSFORMER_ENGINE_VERSION\\}"
    ):
        refresh(root, plan, run=lambda command: calls.append(command) or (0, ""))
    assert calls == []  # nothing reached docker


def test_a_rocm_image_building_another_release_tag_is_reported(tmp_path):
    root = _project(tmp_path)
    line = _edit(
        root / "docker/Dockerfile.rocm",
        "ARG TRANSFORMER_ENGINE_REF=v2.10_rocm",
        "ARG TRANSFORMER_ENGINE_REF=v2.8_rocm",
    )
    assert te_problems(root, load_images().variant("rocm720-mi35x")) == [
        f"transformer-engine: docker/Dockerfile.rocm:{line} builds ROCm/TransformerEngine at v2.8_rocm, "
        "miles/image/images.toml [transformer_engine.rocm-mi350] says v2.10_rocm"
    ]


def test_refresh_image_dry_shows_where_transformer_engine_comes_from():
    done = subprocess.run(
        [sys.executable, "-m", "invoke", "refresh-image", "--variant", "cu13", "--dry"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = {line[:12].strip(): line[12:] for line in done.stdout.splitlines() if line[:1] != " "}
    assert lines["te"].startswith("transformer-engine 2.9.0 (requirements/cuda-h200.txt:")
    assert "transformer-engine-torch built in the image against torch 2.14.1" in lines["te"]
    assert lines["te pins"] == "lock, Dockerfile and images.toml agree"


def _preflight(lane: str, extra_path: Path | None = None) -> list[str]:
    code = f"from pathlib import Path; from miles.ci.machine.te_preflight import check_transformer_engine as c; print(repr(c({lane!r}, Path({str(ROOT)!r}))))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(extra_path or ""), str(ROOT)]))}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return eval(done.stdout.strip().splitlines()[-1])


def test_preflight_on_a_machine_without_transformer_engine_is_one_line_per_gpu_lane():
    assert _preflight("cuda-h200") == [
        "transformer-engine: not installed (ModuleNotFoundError: No module named 'transformer_engine'); the lane's "
        "Megatron jobs build its layer spec: use the image docker/Dockerfile builds"
    ]
    assert _preflight("cpu") == []


def test_preflight_names_installed_versions_that_are_not_the_locks(tmp_path):
    # a stand-in: distribution metadata only (TE's package cannot exist here), at other versions
    for name, version in (("transformer_engine", "2.19.0"), ("transformer_engine_cu13", "2.19.0")):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    problems = _preflight("cuda-h200", tmp_path)
    assert problems[0].startswith(
        "transformer-engine: import transformer_engine.pytorch failed: ModuleNotFoundError"
    )
    pin = parse_lock(ROOT / "requirements/cuda-h200.txt").pins["transformer-engine"]
    assert problems[1] == (
        "transformer-engine: installed transformer-engine 2.19.0, transformer-engine-cu13 2.19.0, "
        f"transformer-engine-torch missing; requirements/cuda-h200.txt:{pin.line} pins 2.9.0"
    )


def test_every_gpu_stacks_te_is_one_megatron_core_supports():
    from miles.image import te_support

    # megatron-core 0.16.1 names the range it is tested with in its own Requires-Dist
    spec = te_support.tested_range()
    assert te_support.in_range("2.9.0", spec) and te_support.in_range("2.11.0", spec)
    assert not te_support.in_range("2.20.2", spec) and not te_support.in_range("2.8.0", spec)
    for variant in ("cu13", "rocm720-mi35x"):
        assert te_problems(ROOT, load_images().variant(variant)) == []
    # every TE name megatron-core imports resolves in the CUDA stack's release, but those whose
    # absence is explained (and each of those is really absent there)
    version, _ = expected_version(ROOT, "cuda-h200")
    imports = te_support.te_imports(te_support.installed_megatron_core())
    assert te_support.unsupported(version, imports) == []
    missing = te_support.load_facts(version)["missing"]
    assert set(te_support.ACCEPTED_MISSING) <= set(missing)
    assert {i.key for i in imports} == set(missing) | set(te_support.load_facts(version)["resolved"])


def test_a_te_past_megatron_cores_range_is_reported_with_what_it_loses(tmp_path):
    root = _project(tmp_path)
    _edit(
        root / "docker/Dockerfile",
        "ARG TRANSFORMER_ENGINE_VERSION=2.9.0",
        "ARG TRANSFORMER_ENGINE_VERSION=2.20.2",
    )
    lock = root / "requirements/cuda-h200.txt"
    lock.write_text(lock.read_text().replace("==2.9.0\n", "==2.20.2\n"))
    problems = te_problems(root, load_images().variant("cu13"))
    assert problems[0].startswith("transformer-engine 2.20.2 (requirements/cuda-h200.txt:")
    assert "is outside megatron-core 0.16.1's tested range" in problems[0]
    assert problems[1].startswith(
        "transformer-engine: transformer_engine.pytorch.module.base:get_workspace (megatron/core/extensions/"
        "transformer_engine.py:2446): missing in transformer-engine 2.20.2, so megatron-core falls back "
        "(te_general_gemm = None)"
    )
