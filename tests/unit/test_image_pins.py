"""Locks against installed packages and Dockerfiles; the repository's own pins agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.image.config import load_images
from miles.image.install import install_arguments, torch_source_warning
from miles.image.pins import LockError, check_dockerfile, diff_installed, parse_lock

register_cpu_ci(est_time=1, suite="stage-a-cpu")

ROOT = Path(__file__).resolve().parents[2]

LOCK = """\
# header
torch==2.14.1+rocm7.2
numba==0.65.1
PyYAML==6.0.4
sglang==0.5.23
"""


@pytest.fixture
def lock(tmp_path: Path):
    path = tmp_path / "requirements" / "rocm-mi350.txt"
    path.parent.mkdir()
    path.write_text(LOCK)
    return parse_lock(path, root=tmp_path)


def test_lock_names_are_normalized(lock):
    assert lock.pins["pyyaml"].version == "6.0.4"
    assert lock.where("numba") == "requirements/rocm-mi350.txt:3"


def test_an_unpinned_line_is_refused_with_its_line(tmp_path):
    path = tmp_path / "x.txt"
    path.write_text("torch==2.14.1\nnumba>=0.60\n")
    with pytest.raises(LockError, match=r"x.txt:2: 'numba>=0.60' is not pinned"):
        parse_lock(path)


def test_installed_diff_names_wrong_and_missing_versions(lock):
    installed = {"torch": "2.13.0+cpu", "pyyaml": "6.0.4", "sglang": "0.5.23"}
    lines = [str(m) for m in diff_installed(lock, installed)]
    assert lines == [
        "numba: missing, lock pins 0.65.1 (requirements/rocm-mi350.txt:3)",
        "torch: found 2.13.0+cpu, lock pins 2.14.1+rocm7.2 (requirements/rocm-mi350.txt:2)",
    ]


def test_a_local_build_tag_satisfies_an_untagged_pin(tmp_path):
    path = tmp_path / "l.txt"
    path.write_text("torch==2.14.1\n")
    assert diff_installed(parse_lock(path), {"torch": "2.14.1+cu130"}) == []


def test_dockerfile_arg_version_must_equal_the_lock(tmp_path, lock):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\nARG ROCM_VERSION=7.2\nARG SGLANG_VERSION=0.5.20\n")
    (mismatch,) = check_dockerfile(dockerfile, lock, root=tmp_path)
    assert str(mismatch) == (
        "sglang: found 0.5.20, lock pins 0.5.23 (Dockerfile:3 vs requirements/rocm-mi350.txt:5)"
    )


def test_dockerfile_inline_pins_are_checked_across_continued_lines(tmp_path, lock):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM x\nRUN pip install \\\n    numba==0.60.0 pyyaml==6.0.4 \\\n    extra==1.0\n")
    found = {(m.name, m.expected, m.found) for m in check_dockerfile(dockerfile, lock, root=tmp_path)}
    assert found == {("numba", "0.65.1", "0.60.0"), ("extra", None, "1.0")}


def test_repository_dockerfiles_agree_with_their_locks():
    config = load_images()
    for variant in config.variants.values():
        lock = parse_lock(ROOT / config.stack(variant.stack).lock_path, root=ROOT)
        assert check_dockerfile(ROOT / variant.dockerfile, lock, root=ROOT) == [], variant.name


def test_rocm_lock_pins_numba_and_the_rocm_torch_build():
    lock = parse_lock(ROOT / "requirements" / "rocm-mi350.txt")
    assert lock.pins["numba"].version == "0.65.1"
    assert lock.pins["torch"].version.endswith("+rocm7.2")
    assert lock.pins["sglang"].version.startswith("0.5.")
    assert "sglang-kernel" not in lock.pins  # built from source in the ROCm image


def test_every_stack_pins_the_megatron_core_the_cpu_lane_trains_with():
    # The CPU lane runs the Megatron backend under gloo to prove what the GPU lanes run; a GPU
    # lock on another megatron-core would make that proof about a different library.
    config = load_images()
    versions = {
        name: parse_lock(ROOT / config.stack(name).lock_path).pins["megatron-core"].version
        for name in ("cpu", "cuda-h200", "rocm-mi350")
    }
    assert len(set(versions.values())) == 1, versions


def test_every_stack_lock_parses_and_pins_its_python_line():
    config = load_images()
    cpu = parse_lock(ROOT / config.stack("cpu").lock_path)
    assert cpu.pins["torch"].version == "2.13.0"  # a version PyPI serves; the CPU index has its +cpu build
    assert cpu.pins["megatron-core"].version.startswith("0.16.")
    cuda = parse_lock(ROOT / config.stack("cuda-h200").lock_path)
    assert "+" not in cuda.pins["torch"].version  # PyPI's CUDA build


def test_uv_gets_pips_find_links_and_extra_index():
    stack = load_images().stack("cpu")
    env = {"PIP_FIND_LINKS": "/opt/wheels /srv/more", "PIP_EXTRA_INDEX_URL": "https://example.invalid/cpu"}
    args = install_arguments(stack, ROOT, venv_backend="uv", env=env)
    assert args[:4] == ["--find-links", "/opt/wheels", "--find-links", "/srv/more"]
    assert "--extra-index-url" in args and "unsafe-best-match" in args
    assert args[-2:] == ["-r", str(ROOT / "requirements" / "cpu.txt")]
    # pip reads those variables itself
    assert install_arguments(stack, ROOT, venv_backend="virtualenv", env=env) == args[-2:]


def test_a_stack_with_exclusions_installs_without_dependencies():
    args = install_arguments(load_images().stack("rocm-mi350"), ROOT, venv_backend="virtualenv", env={})
    assert "--no-deps" in args


def test_the_cpu_lock_pins_only_versions_pypi_serves():
    lock = parse_lock(ROOT / "requirements" / "cpu.txt")
    assert [name for name, pin in lock.pins.items() if "+" in pin.version] == []
    assert "torch==2.13.0\n" in (ROOT / "requirements" / "cpu.in").read_text()


def test_a_public_torch_pin_hints_at_the_cpu_index_when_nothing_names_it():
    stack = load_images().stack("cpu")
    hint = torch_source_warning(stack, ROOT, {})
    assert "PyPI serves its CUDA-capable build" in hint
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in hint
    assert torch_source_warning(stack, ROOT, {"PIP_EXTRA_INDEX_URL": stack.torch_index}) is None
    assert torch_source_warning(load_images().stack("cuda-h200"), ROOT, {}) is None


def test_missing_torch_index_is_explained():
    stack = load_images().stack("rocm-mi350")
    warning = torch_source_warning(stack, ROOT, {})
    assert "torch==" in warning and "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/rocm7.2" in warning
    assert torch_source_warning(stack, ROOT, {"PIP_FIND_LINKS": "/opt/wheels"}) is None
