"""Tiny checkpoints shared by the checkpoint tests (from the shared cache: built once per lane run)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny() -> Callable[..., Path]:
    """tiny(family, layers=4) -> a finished tiny checkpoint dir (tests.support.ckpt); read-only."""
    from tests.support.ckpt import tiny_hf

    return lambda family, layers=4: tiny_hf(family, layers)


@pytest.fixture(scope="session")
def fp8_of(tiny, tmp_path_factory) -> Callable[[str], Path]:
    """fp8_of(family) -> the FP8 form of tiny(family) (4 layers), made once per session; read-only."""
    from miles.ckpt.fp8 import convert_to_fp8

    root = tmp_path_factory.mktemp("fp8")
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            out = root / family
            out.mkdir()
            convert_to_fp8(tiny(family), out, workers=2)
            made[family] = out
        return made[family]

    return get


@pytest.fixture
def tiny_copy(tiny, tmp_path) -> Callable[..., Path]:
    """tiny_copy(family, layers=4) -> a private copy the test may damage."""

    from tests.support.ckpt import private

    def get(family: str, layers: int = 4) -> Path:
        return private(tiny(family, layers), tmp_path / f"copy-{family}-{layers}")

    return get


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(Path(root).rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="session")
def tree_digest() -> Callable[[Path], dict[str, str]]:
    """tree_digest(root) -> {relative path: sha256} of every file, to prove a tree was not touched."""
    return _tree_digest
