"""`invoke lock` end to end: real uv resolutions over a folder of small local wheels, offline."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from miles.ci.register import register_cpu_ci
from miles.image.config import Stack
from miles.image.lock import LockFailed, lock_stack
from miles.image.pins import parse_lock

register_cpu_ci(est_time=2, suite="stage-a-cpu")


def _wheel(folder: Path, name: str, version: str, *requires: str) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", meta)
        wheel.writestr(
            f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.fixture
def index(tmp_path: Path, monkeypatch) -> list[str]:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "torch", "2.9.1", "nvidia-nccl-cu13==2.27.5", "triton==3.5.1")
    _wheel(wheels, "nvidia-nccl-cu13", "2.27.5")
    _wheel(wheels, "triton", "3.5.1")
    _wheel(wheels, "sglang", "0.5.23", "torch==2.9.1", "numba==0.65.1")
    _wheel(wheels, "numba", "0.65.1")
    _wheel(wheels, "helper", "1.0")
    _wheel(wheels, "helper", "2.0")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    return ["--offline", "--no-index", "--find-links", str(wheels)]


def _stack(**kw) -> Stack:
    base = dict(
        name="rocm-x", backend="rocm", python="3.11", platform="x86_64-manylinux_2_28", torch_index="idx"
    )
    return Stack(**{**base, **kw})


def _root(tmp_path: Path, requirements: str) -> Path:
    root = tmp_path / "project"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "rocm-x.in").write_text(requirements)
    return root


def test_rocm_lock_renames_the_torch_family_and_leaves_out_cuda_packages(tmp_path, index):
    stack = _stack(
        torch_build="rocm7.2",
        retag=("torch",),
        rename=(("triton", "pytorch-triton-rocm"),),
        exclude=("nvidia-*",),
    )
    root = _root(tmp_path, "sglang\n")
    result = lock_stack(root, stack, extra=index)
    text = (root / "requirements" / "rocm-x.txt").read_text()
    lock = parse_lock(root / "requirements" / "rocm-x.txt")
    assert {n: p.version for n, p in lock.pins.items()} == {
        "numba": "0.65.1",
        "pytorch-triton-rocm": "3.5.1",
        "sglang": "0.5.23",
        "torch": "2.9.1+rocm7.2",
    }
    assert result.excluded == ("nvidia-nccl-cu13",)
    assert "Left to the image's source builds: nvidia-nccl-cu13." in text
    assert text.startswith("# Pinned stack 'rocm-x': Python 3.11, x86_64-manylinux_2_28.")


def test_pins_appended_by_hand_are_kept_at_their_version(tmp_path, index):
    stack = _stack(name="rocm-x")
    root = _root(tmp_path, "numba\n")
    lock_path = root / "requirements" / "rocm-x.txt"
    lock_path.write_text("numba==0.65.1\nhelper==1.0\n")
    result = lock_stack(root, stack, extra=index)
    assert parse_lock(lock_path).pins["helper"].version == "1.0"
    assert result.changed == () and result.removed == ()
    upgraded = lock_stack(root, stack, upgrade=True, extra=index)
    assert upgraded.changed == ("helper 1.0 -> 2.0",)


def test_a_failed_resolution_leaves_the_lock_untouched(tmp_path, index):
    root = _root(tmp_path, "no-such-package\n")
    lock_path = root / "requirements" / "rocm-x.txt"
    lock_path.write_text("numba==0.65.1\n")
    with pytest.raises(LockFailed, match="no-such-package"):
        lock_stack(root, _stack(), extra=index)
    assert lock_path.read_text() == "numba==0.65.1\n"


def test_a_stack_without_a_torch_build_pins_the_public_version_of_a_local_build(tmp_path, index):
    """A wheel folder (or the CPU index) offers torch 2.9.1+cpu; the lock says 2.9.1, which
    PyPI serves and the +cpu build still satisfies."""
    wheels = Path(index[-1])
    _wheel(wheels, "torch", "2.9.1+cpu", "helper==1.0")
    (wheels / "torch-2.9.1-py3-none-any.whl").unlink()  # only the local build is on offer
    stack = _stack(name="cpu-x", backend="cpu", torch_index="https://download.pytorch.org/whl/cpu")
    root = tmp_path / "project"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "cpu-x.in").write_text("torch==2.9.1\n")
    lock_stack(root, stack, extra=index)
    text = (root / "requirements" / "cpu-x.txt").read_text()
    assert {n: p.version for n, p in parse_lock(root / "requirements" / "cpu-x.txt").pins.items()} == {
        "helper": "1.0",
        "torch": "2.9.1",
    }
    assert "# Public versions only: PyPI serves every pin." in text


def test_the_cpu_lock_leaves_out_the_cuda_libraries_of_pypis_torch(tmp_path, index):
    """Where only PyPI's torch (which depends on CUDA libraries) is on offer, the cpu stack's
    lock still holds none of them: the CPU build it installs needs none."""
    from miles.ci.machine.stacks import image_config

    stack = image_config().stack("cpu")
    assert stack.excluded("nvidia-nccl-cu13") and stack.excluded("triton") and not stack.excluded("torch")
    root = tmp_path / "project"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "cpu.in").write_text("torch==2.9.1\n")
    result = lock_stack(root, stack, extra=index)
    text = (root / "requirements" / "cpu.txt").read_text()
    assert {n: p.version for n, p in parse_lock(root / "requirements" / "cpu.txt").pins.items()} == {
        "torch": "2.9.1"
    }
    assert "# Left out, the CPU build of torch needs none of them: nvidia-nccl-cu13, triton." in text
    assert "left out, the CPU build of torch needs none of them: nvidia-nccl-cu13, triton" in result.render()
